// DIVISION dual-precision compression, CUDA kernels: the twins of division_cpu.cpp and of
// actnn_zoo/quant/division_reference.py (same rules, same codes for the same seed).
//
// Status: compiled by scripts/check_cuda_build.sh, NOT yet run on a GPU (no GPU was available
// when it was written); tests/test_division.py runs the CUDA parity test only where CUDA is.
//
// One thread block per (sample, channel) map: block sums (one thread per low-part block, float64
// in the same row-major order as the CPU), the residual's min / max by a block reduction, the
// map's metadata by thread 0, then the codes. Maps of one row can share a byte (a 7x7 map at 2
// bits is 98 bits), so codes are OR-ed into 32-bit words with atomicOr; the data buffer is
// allocated in whole words and its view narrowed to `total` bytes.
//
// Like quant_cuda.cu the kernels trust the per-sample widths and offsets that live on the GPU
// (reading them back would synchronise): an invalid width stores nothing, every store is
// clipped to the buffer. ACTNN_ZOO_DEBUG=1 checks them on the host first (actnn_zoo.quant.api).
#include "division_checks.h"
#include "kernels.h"

// c10/cuda only (as quant_cuda.cu): ATen/cuda/CUDAContext.h pulls in cuSPARSE / cuBLAS headers
// that a bare toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace actnn_zoo {

namespace {

constexpr int kThreads = 256;
// bf16 rounding and the metadata rule (covering_step) come from bf16.h, shared with the CPU.
__device__ __forceinline__ bool valid_width(int b) { return b == 1 || b == 2 || b == 4 || b == 8; }

struct Geo {
  int64_t c, d1, d2, d3, s, block, nb1, nb2, nb3, nblocks;
};

__device__ __forceinline__ int64_t block_of(const Geo& g, int64_t e) {
  const int64_t i3 = e % g.d3;
  const int64_t i2 = (e / g.d3) % g.d2;
  const int64_t i1 = e / (g.d2 * g.d3);
  return ((i1 / g.block) * g.nb2 + i2 / g.block) * g.nb3 + i3 / g.block;
}

template <typename T>
__global__ void division_quantize_kernel(const T* __restrict__ x, Geo g,
                                         const uint8_t* __restrict__ bits,
                                         const int64_t* __restrict__ offsets, int64_t total,
                                         bool has_low, uint32_t key, bool stochastic,
                                         uint32_t* __restrict__ words, uint16_t* __restrict__ low,
                                         float* __restrict__ lo_out,
                                         uint16_t* __restrict__ step_out) {
  const int64_t map = blockIdx.x;
  const int64_t n = map / g.c, ch = map % g.c;
  const T* xm = x + map * g.s;
  uint16_t* lw = has_low ? low + map * g.nblocks : nullptr;
  // 1. low part: one thread per block, float64 sum in row-major order (as the CPU kernel)
  if (has_low) {
    for (int64_t k = threadIdx.x; k < g.nblocks; k += blockDim.x) {
      const int64_t k3 = k % g.nb3, k2 = (k / g.nb3) % g.nb2, k1 = k / (g.nb2 * g.nb3);
      const int64_t e1 = min(g.block, g.d1 - k1 * g.block), e2 = min(g.block, g.d2 - k2 * g.block),
                    e3 = min(g.block, g.d3 - k3 * g.block);
      double sum = 0.0;
      for (int64_t a = 0; a < e1; ++a)
        for (int64_t b = 0; b < e2; ++b) {
          const T* row = xm + ((k1 * g.block + a) * g.d2 + k2 * g.block + b) * g.d3 + k3 * g.block;
          for (int64_t c = 0; c < e3; ++c) sum += static_cast<double>(static_cast<float>(row[c]));
        }
      const double mean = sum / static_cast<double>(e1 * e2 * e3);
      lw[k] = bf16_from_float(static_cast<float>(mean));
    }
    __syncthreads();
  }
  // 2. the residual's min / max / finiteness
  __shared__ float s_min[kThreads], s_max[kThreads];
  __shared__ int s_fin[kThreads];
  float mn = __int_as_float(0x7f800000), mx = -__int_as_float(0x7f800000);
  int fin = 1;
  for (int64_t e = threadIdx.x; e < g.s; e += blockDim.x) {
    const float v = static_cast<float>(xm[e]);
    const float r = has_low ? v - bf16_value(lw[block_of(g, e)]) : v;
    fin &= isfinite(r) ? 1 : 0;
    mn = fminf(mn, r);
    mx = fmaxf(mx, r);
  }
  s_min[threadIdx.x] = mn;
  s_max[threadIdx.x] = mx;
  s_fin[threadIdx.x] = fin;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) {
      s_min[threadIdx.x] = fminf(s_min[threadIdx.x], s_min[threadIdx.x + h]);
      s_max[threadIdx.x] = fmaxf(s_max[threadIdx.x], s_max[threadIdx.x + h]);
      s_fin[threadIdx.x] &= s_fin[threadIdx.x + h];
    }
    __syncthreads();
  }
  // 3. metadata (division_reference.map_metadata)
  const int b = bits[n];
  __shared__ float s_lo;
  __shared__ uint16_t s_step;
  if (threadIdx.x == 0) {
    const float levels = static_cast<float>((1 << (valid_width(b) ? b : 1)) - 1);
    const uint16_t st = s_fin[0] ? covering_step(s_min[0], s_max[0], levels) : kBf16NaN;
    const float lo = st == kBf16NaN ? __int_as_float(0x7fc00000) : s_min[0];
    lo_out[map] = lo;
    step_out[map] = st;
    s_lo = lo;
    s_step = st;
  }
  __syncthreads();
  if (!valid_width(b)) return;
  // 4. codes, OR-ed into the row's words
  const float levels = static_cast<float>((1 << b) - 1);
  const float lo = s_lo;
  const float stf = bf16_value(s_step);
  const float inv = stf > 0.0f ? __fdiv_rn(1.0f, stf) : 0.0f;
  const uint64_t base = static_cast<uint64_t>(n) * (g.c * g.s) + ch * g.s;
  const int64_t bit0 = offsets[n] * 8 + ch * g.s * b;
  for (int64_t e = threadIdx.x; e < g.s; e += blockDim.x) {
    const float v = static_cast<float>(xm[e]);
    const float r = has_low ? v - bf16_value(lw[block_of(g, e)]) : v;
    float t = __fmul_rn(__fsub_rn(r, lo), inv);
    t = __fadd_rn(t, stochastic ? uniform_from_index(base + e, key) : 0.5f);
    t = (t >= 0.0f) ? fminf(t, levels) : 0.0f;
    const uint32_t q = static_cast<uint32_t>(t);
    const int64_t pos = bit0 + e * b;
    if ((pos >> 3) < total && q) atomicOr(words + (pos >> 5), q << (pos & 31));
  }
}

template <typename T>
__global__ void division_dequantize_kernel(const uint8_t* __restrict__ data, int64_t nbytes, Geo g,
                                           const uint8_t* __restrict__ bits,
                                           const int64_t* __restrict__ offsets, bool has_low,
                                           const uint16_t* __restrict__ low,
                                           const float* __restrict__ lo,
                                           const uint16_t* __restrict__ step, T* __restrict__ out) {
  const int64_t map = blockIdx.x;
  const int64_t n = map / g.c, ch = map % g.c;
  const int b = bits[n];
  const float l = lo[map];
  const float st = bf16_value(step[map]);
  const uint16_t* lw = has_low ? low + map * g.nblocks : nullptr;
  const int64_t bit0 = offsets[n] * 8 + ch * g.s * b;
  const uint32_t mask = valid_width(b) ? (1u << b) - 1u : 0u;
  for (int64_t e = threadIdx.x; e < g.s; e += blockDim.x) {
    const int64_t pos = bit0 + e * (valid_width(b) ? b : 0);
    const uint32_t byte = (pos >> 3) < nbytes ? data[pos >> 3] : 0u;
    const float q = static_cast<float>((byte >> (pos & 7)) & mask);
    const float r = __fadd_rn(__fmul_rn(q, st), l);
    const float v = has_low ? __fadd_rn(bf16_value(lw[block_of(g, e)]), r) : r;
    out[map * g.s + e] = static_cast<T>(v);
  }
}

Geo geometry(at::IntArrayRef s, int64_t block) {
  Geo g;
  g.c = s[1];
  g.d1 = s[2];
  g.d2 = s[3];
  g.d3 = s[4];
  g.s = g.d1 * g.d2 * g.d3;
  g.block = block;
  g.nb1 = (g.d1 + block - 1) / block;
  g.nb2 = (g.d2 + block - 1) / block;
  g.nb3 = (g.d3 + block - 1) / block;
  g.nblocks = g.nb1 * g.nb2 * g.nb3;
  return g;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> division_quantize_cuda(
    const at::Tensor& x5, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t block, bool has_low, int64_t seed, bool stochastic) {
  // the CPU twin's checks (division_checks.h), less the widths' and offsets' values
  TORCH_CHECK(x5.is_cuda(), "x5 must be a CUDA tensor");
  division_checks::check_x5(x5, "x5");
  division_checks::check_block_total(block, total);
  const Geo g = geometry(x5.sizes(), block);
  const int64_t n = x5.size(0);
  division_checks::check_row_layout(bits, offsets, n);
  if (stochastic) check_not_capturing("division_quantize_cuda");
  auto opts = x5.options();
  at::Tensor words = at::zeros({(total + 3) / 4}, opts.dtype(at::kInt));
  at::Tensor data = words.view(at::kByte).narrow(0, 0, total);
  at::Tensor low = has_low ? at::empty({n, g.c, g.nb1, g.nb2, g.nb3}, opts.dtype(at::kBFloat16))
                           : at::empty({0}, opts.dtype(at::kBFloat16));
  at::Tensor lo = at::empty({n, g.c}, opts.dtype(at::kFloat));
  at::Tensor step = at::empty({n, g.c}, opts.dtype(at::kBFloat16));
  if (x5.numel() == 0) return {data, low, lo, step};
  const uint32_t key = seed_key(static_cast<uint32_t>(seed));
  auto stream = c10::cuda::getCurrentCUDAStream();
  uint16_t* low_p = has_low ? reinterpret_cast<uint16_t*>(low.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* step_p = reinterpret_cast<uint16_t*>(step.data_ptr<at::BFloat16>());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    division_quantize_kernel<T><<<n * g.c, kThreads, 0, stream>>>(
        x5.data_ptr<T>(), g, bits.data_ptr<uint8_t>(), offsets.data_ptr<int64_t>(), total,
        has_low, key, stochastic, reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()), low_p,
        lo.data_ptr<float>(), step_p);
  };
  switch (x5.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "x5 must be float32, float16 or bfloat16, got ", x5.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {data, low, lo, step};
}

at::Tensor division_dequantize_cuda(const at::Tensor& data, const at::Tensor& low,
                                    const at::Tensor& lo, const at::Tensor& step,
                                    const at::Tensor& bits, const at::Tensor& offsets,
                                    int64_t block, bool has_low, at::Tensor& out) {
  // the CPU twin's checks (division_checks.h), less the widths' and offsets' values
  TORCH_CHECK(out.is_cuda(), "out must be a CUDA tensor");
  division_checks::check_x5(out, "out");
  division_checks::check_block_total(block, 0);
  const Geo g = geometry(out.sizes(), block);
  division_checks::check_payload(data, low, lo, step, has_low, out.size(0) * g.c, g.nblocks);
  division_checks::check_row_layout(bits, offsets, out.size(0));
  if (out.numel() == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint16_t* low_p =
      has_low ? reinterpret_cast<const uint16_t*>(low.data_ptr<at::BFloat16>()) : nullptr;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    division_dequantize_kernel<T><<<out.size(0) * g.c, kThreads, 0, stream>>>(
        data.data_ptr<uint8_t>(), data.numel(), g, bits.data_ptr<uint8_t>(),
        offsets.data_ptr<int64_t>(), has_low, low_p, lo.data_ptr<float>(),
        reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>()), out.data_ptr<T>());
  };
  switch (out.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "out must be float32, float16 or bfloat16");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace actnn_zoo
