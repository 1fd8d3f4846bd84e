// Per-sample widths on CUDA. The width greedy of auto precision (precision/solver.py,
// allocate_samples), the twin of allocate_widths_cpu (widths_cpu.cpp): the walk over the
// ordered upgrades and the widths are widths.h's, which the CPU loop runs too; what is CUDA's
// own is the order. The byte offsets of rows at those widths (row_offsets, bindings.cpp),
// whose per-row size is kernels.h's row_bytes, as on the CPU. And the per-sample range
// statistic the widths are chosen from (precision/stats.py, range_statistic): its per-group
// term is widths.h's range_term and its sum runs in group order in double, as the CPU's, so the
// two agree bit for bit.
//
// Status: compiled by scripts/check_cuda_build.sh, NOT yet run on a GPU (none was lent when it
// was written); tests/test_cuda.py compares it with the torch program and the CPU kernel where
// a GPU is.
//
// Why: off the CPU the greedy was a torch program of ~21 small operators (an argsort, two
// cumsums, a scatter ...) per watched layer and step, each a launch and its host work: 1,134 a
// converted ResNet-50 step at batch 64 (scripts/bench_offcpu.py). Here: one output and one
// launch (a scratch buffer besides for more than ~1,800 items).
//
// One block. The order is a rank sort: upgrade u goes to position #{v : r_v > r_u} +
// #{v < u : r_v == r_u}, the stable descending order std::stable_sort and torch's stable
// argsort give, compared through monotone integer keys (-0.0 as +0.0; NaN, which the scores
// never hold, as the largest value, as torch's sort places it) so that the ranks are always a
// permutation. O(k^2) comparisons for k = 3m upgrades, spread over the block: m is a batch
// size. Then one thread walks the order (allocate_walk) in shared memory, and the block writes
// the widths.
#include "kernels.h"
#include "grid_cuda.h"
#include "widths.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace actnn_zoo {
namespace {

constexpr int64_t kSharedBytes = 48 * 1024;  // without opting in to more

// A key whose unsigned order is the float's order (-0.0 as +0.0, every NaN above +Inf).
__device__ __forceinline__ uint32_t order_key_of(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7FFFFFFFu) == 0u) b = 0u;                    // -0.0 -> +0.0
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;  // NaN: the largest
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// scratch: 9k bytes (keys uint32 [k] | order int32 [k] | taken uint8 [k]), in shared memory
// when `shared`, else the global buffer.
__global__ void allocate_widths_kernel(const float* __restrict__ s, int64_t m, double extra,
                                       float g0, float g1, float g2, uint8_t* __restrict__ out,
                                       uint8_t* global_scratch, bool shared) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* base = shared ? smem : global_scratch;
  const int64_t k = 3 * m;
  uint32_t* keys = reinterpret_cast<uint32_t*>(base);
  int32_t* order = reinterpret_cast<int32_t*>(base + 4 * k);
  uint8_t* taken = base + 8 * k;
  for (int64_t u = threadIdx.x; u < k; u += blockDim.x) {
    const int64_t stage = u / m;
    const float g = stage == 0 ? g0 : (stage == 1 ? g1 : g2);
    keys[u] = order_key_of(fmul(g, s[u - stage * m]));
    taken[u] = 0;
  }
  __syncthreads();
  for (int64_t u = threadIdx.x; u < k; u += blockDim.x) {
    const uint32_t ku = keys[u];
    int64_t rank = 0;
    for (int64_t v = 0; v < k; ++v) {
      const uint32_t kv = keys[v];
      rank += (kv > ku) || (kv == ku && v < u);
    }
    order[rank] = static_cast<int32_t>(u);
  }
  __syncthreads();
  if (threadIdx.x == 0) allocate_walk(order, m, extra, taken);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) out[i] = allocated_width(taken, m, i);
}

// (N + 1,) int64 offsets: out[0] = 0, out[r + 1] = out[r] + row_bytes(bits[r], d). One block:
// each thread sums a contiguous chunk of rows, thread 0 scans the chunk sums in shared memory
// (as many as threads, at most 1024), then each thread writes its chunk's running offsets.
__global__ void row_offsets_kernel(const uint8_t* __restrict__ bits, int64_t n, int64_t d,
                                   int64_t* __restrict__ out) {
  __shared__ int64_t part[1024];
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  const int64_t b0 = min(n, static_cast<int64_t>(threadIdx.x) * chunk);
  const int64_t b1 = min(n, b0 + chunk);
  int64_t sum = 0;
  for (int64_t r = b0; r < b1; ++r) sum += row_bytes(bits[r], d);
  part[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const int64_t v = part[t];
      part[t] = acc;
      acc += v;
    }
    out[0] = 0;
  }
  __syncthreads();
  int64_t acc = part[threadIdx.x];
  for (int64_t r = b0; r < b1; ++r) {
    acc += row_bytes(bits[r], d);
    out[r + 1] = acc;
  }
}

// out[n] = sum over row n's groups, in order, of range_term: one block per row (grid-stride),
// a warp per group (lanes read the group's values side by side), the block's terms of 256
// groups at a time summed in order by one thread.
constexpr int kRangeThreads = 256;
constexpr int kRangeChunk = 256;  // groups per pass

template <typename T>
__global__ void __launch_bounds__(kRangeThreads)
range_statistic_kernel(const T* __restrict__ x, int64_t n_rows, int64_t d, int64_t group_size,
                       float* __restrict__ out) {
  __shared__ double terms[kRangeChunk];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t groups = (d + group_size - 1) / group_size;
  for (int64_t n = blockIdx.x; n < n_rows; n += gridDim.x) {
    const T* row = x + n * d;
    double acc = 0.0;  // thread 0's
    for (int64_t c0 = 0; c0 < groups; c0 += kRangeChunk) {
      const int64_t c1 = min(groups, c0 + kRangeChunk);
      for (int64_t g = c0 + warp; g < c1; g += kRangeThreads / 32) {
        const int64_t start = g * group_size;
        const int64_t len = min(group_size, d - start);
        float mn = __uint_as_float(0x7F800000u), mx = __uint_as_float(0xFF800000u);
        bool bad = false;
        for (int64_t e = lane; e < len; e += 32) {
          const float v = static_cast<float>(row[start + e]);
          bad = bad || ((__float_as_uint(v) & 0x7F800000u) == 0x7F800000u);
          mn = v < mn ? v : mn;
          mx = v > mx ? v : mx;
        }
        bad = __any_sync(0xffffffffu, bad);
        for (int off = 16; off > 0; off >>= 1) {
          const float omn = __shfl_xor_sync(0xffffffffu, mn, off);
          const float omx = __shfl_xor_sync(0xffffffffu, mx, off);
          mn = omn < mn ? omn : mn;
          mx = omx > mx ? omx : mx;
        }
        if (lane == 0) terms[g - c0] = range_term(mn, mx, bad, len);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int64_t g = c0; g < c1; ++g) acc += terms[g - c0];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) out[n] = static_cast<float>(acc);
  }
}

}  // namespace

at::Tensor range_statistic_cuda(const at::Tensor& x2d, int64_t group_size) {
  const c10::cuda::CUDAGuard guard(x2d.device());
  const int64_t n_rows = x2d.size(0), d = x2d.size(1);
  at::Tensor out = at::empty({n_rows}, x2d.options().dtype(at::kFloat));
  if (n_rows == 0) return out;
  if (d == 0) return out.zero_();
  const unsigned grid = grid_stride_blocks(n_rows, 1);  // a block per row
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (x2d.scalar_type()) {
    case at::kFloat:
      range_statistic_kernel<float><<<grid, kRangeThreads, 0, stream>>>(
          x2d.data_ptr<float>(), n_rows, d, group_size, out.data_ptr<float>());
      break;
    case at::kHalf:
      range_statistic_kernel<c10::Half><<<grid, kRangeThreads, 0, stream>>>(
          x2d.data_ptr<c10::Half>(), n_rows, d, group_size, out.data_ptr<float>());
      break;
    default:  // bfloat16 (the caller admits nothing else)
      range_statistic_kernel<c10::BFloat16><<<grid, kRangeThreads, 0, stream>>>(
          x2d.data_ptr<c10::BFloat16>(), n_rows, d, group_size, out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor row_offsets_cuda(int64_t d, const at::Tensor& bits) {
  const c10::cuda::CUDAGuard guard(bits.device());
  const at::Tensor b = bits.contiguous();
  const int64_t n = b.size(0);
  at::Tensor out = at::empty({n + 1}, b.options().dtype(at::kLong));
  const int64_t want = ((n + 31) / 32) * 32;
  const int threads = static_cast<int>(want < 32 ? 32 : (want < 1024 ? want : 1024));
  row_offsets_kernel<<<1, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      b.data_ptr<uint8_t>(), n, d, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor allocate_widths_cuda(const at::Tensor& score, double extra) {
  const c10::cuda::CUDAGuard guard(score.device());
  const int64_t m = score.size(0);
  at::Tensor out = at::empty({m}, score.options().dtype(at::kByte));
  if (m == 0) return out;
  const int64_t k = 3 * m;
  const int64_t bytes = 9 * k;
  const bool shared = bytes <= kSharedBytes;
  at::Tensor scratch;
  if (!shared) scratch = at::empty({bytes}, score.options().dtype(at::kByte));
  float gain[3];
  upgrade_gains(gain);
  const int64_t want = ((k + 31) / 32) * 32;
  const int threads = static_cast<int>(want < 1024 ? want : 1024);
  allocate_widths_kernel<<<1, threads, shared ? static_cast<size_t>(bytes) : 0,
                           c10::cuda::getCurrentCUDAStream()>>>(
      score.data_ptr<float>(), m, extra, gain[0], gain[1], gain[2], out.data_ptr<uint8_t>(),
      shared ? nullptr : scratch.data_ptr<uint8_t>(), shared);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace actnn_zoo
