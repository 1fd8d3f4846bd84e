// The sampled rounding variances of softmax's and the norms' unbiased backward, on CUDA: the
// twins of variance_cpu.cpp's loops (actnn_zoo/functional/_rounding_variance.py says why the
// variances are saved, and has the torch twin both must equal bit for bit).
//
// Status: compiled by scripts/check_cuda_build.sh, NOT yet run on a GPU (none was lent when it
// was written); tests/test_cuda.py compares it with the torch twin and the CPU kernels where a
// GPU is. The per-value arithmetic (the index into strided tensors, the statistics, the group
// lookup, the variance, the correction) is variance.h's, which the CPU kernels run too, so the
// CPU tests cover the math; what is CUDA's own here is the launch and the 1-bit coding, which is
// the library's verified quantize kernel (quant_cuda.cu) on a one-row tensor, as the CPU
// kernel's coding equals quantize(var, 1, 256, seed) of one row.
//
// Why: off the CPU the torch twin ran ~30 small operators a call forward and ~12 backward, each
// a launch and its host work; a converted ResNet-50 step made ~4,000 of them (53 batch norms),
// about 40% of its GPU path's operators (bench_offcpu.py). Here: forward, one kernel for the
// variances, then quantize (two small layout tensors, its kernel) and one cat; backward, one
// kernel.
//
// Argument checks ran before (variance_cpu.cpp: check_codes / check_correct, host-compiled, with
// sizes in their messages); nothing here prints a size.
#include "kernels.h"
#include "grid_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#if defined(__USE_FAST_MATH__)
#error "variance_cuda.cu must not be built with --use_fast_math: it breaks bit parity with the CPU kernels"
#endif

namespace actnn_zoo {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kVarGroupCuda = 256;  // the 1-bit codes' group (variance_cpu.cpp's kVarGroup)

// x_i widened exactly (float16 and bfloat16 to float32; float64 stays float64 for the norm's
// arithmetic in W), as variance_cpu.cpp's value_at reads it.
template <typename T, typename W>
__device__ __forceinline__ float value_at(const VarSource& s, int64_t i) {
  const T x = static_cast<const T*>(s.x)[s.at.at(i)];
  if constexpr (std::is_same<W, double>::value) {
    const double w = static_cast<double>(x);
    return s.shift == nullptr ? static_cast<float>(w) : normalized_value<double>(w, s, i);
  } else {
    const float w = static_cast<float>(x);
    return s.shift == nullptr ? w : normalized_value<float>(w, s, i);
  }
}

// var[k] for every slot k < slots: the variance at flat index offset + k * stride, 0 past numel.
template <typename T, typename W>
__global__ void __launch_bounds__(kThreads)
variance_values_kernel(const VarPayload p, const VarSource s, int64_t numel, int64_t offset,
                       int64_t stride, int64_t slots, float* __restrict__ var) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < slots;
       k += step) {
    const int64_t i = offset + k * stride;
    var[k] = i < numel ? payload_variance(p, i, value_at<T, W>(s, i)) : 0.0f;
  }
}

// grad_in[i] += correction_term(k, i, grad[i]) at the kept indices: distinct i, so no two
// threads write one value (check_correct rejects a grad_in that overlaps itself).
__global__ void __launch_bounds__(kThreads)
variance_correct_kernel(float* __restrict__ gi, const float* __restrict__ g, const VarCorrection c,
                        const Strided gi_at, const Strided g_at, int64_t offset, int64_t stride,
                        int64_t kept) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < kept;
       k += step) {
    const int64_t i = offset + k * stride;
    float& out = gi[gi_at.at(i)];
    out = fadd(out, correction_term(c, k, i, g[g_at.at(i)]));
  }
}

}  // namespace

at::Tensor rounding_variance_codes_cuda(const VarPayload& p, const VarSource& s,
                                        const at::Tensor& src, int64_t numel, int64_t offset,
                                        int64_t stride, int64_t slots, int64_t seed) {
  const c10::cuda::CUDAGuard guard(src.device());
  const auto bytes = src.options().dtype(at::kByte);
  const int64_t vgroups = (slots + kVarGroupCuda - 1) / kVarGroupCuda;
  if (slots == 0) return at::empty({4 * vgroups}, bytes);
  at::Tensor var = at::empty({1, slots}, src.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* v = var.data_ptr<float>();
  const unsigned grid = grid_stride_blocks(slots, kThreads);
  switch (src.scalar_type()) {
    case at::kFloat:
      variance_values_kernel<float, float><<<grid, kThreads, 0, stream>>>(
          p, s, numel, offset, stride, slots, v);
      break;
    case at::kHalf:
      variance_values_kernel<c10::Half, float><<<grid, kThreads, 0, stream>>>(
          p, s, numel, offset, stride, slots, v);
      break;
    case at::kBFloat16:
      variance_values_kernel<c10::BFloat16, float><<<grid, kThreads, 0, stream>>>(
          p, s, numel, offset, stride, slots, v);
      break;
    default:  // float64 (check_codes admits nothing else)
      variance_values_kernel<double, double><<<grid, kThreads, 0, stream>>>(
          p, s, numel, offset, stride, slots, v);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // One row of `slots` values at 1 bit: widths (1,) and byte offsets (0, nbytes), made on the
  // device (no host-to-device copy).
  const int64_t nbytes = (slots + 7) / 8;
  const at::Tensor widths = at::full({1}, 1, bytes);
  const at::Tensor offsets = at::arange(0, 2 * nbytes, nbytes, src.options().dtype(at::kLong));
  auto coded = quantize_cuda(var, widths, offsets, nbytes, kVarGroupCuda, seed, true);
  return at::cat({std::get<1>(coded).view({-1}).view(at::kByte),
                  std::get<2>(coded).view({-1}).view(at::kByte), std::get<0>(coded)});
}

void rounding_variance_correct_cuda(at::Tensor& grad_in, const at::Tensor& grad,
                                    const VarCorrection& c, const Strided& gi_at,
                                    const Strided& g_at, int64_t offset, int64_t stride,
                                    int64_t kept) {
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  variance_correct_kernel<<<grid_stride_blocks(kept, kThreads), kThreads, 0, stream>>>(
      grad_in.data_ptr<float>(), grad.data_ptr<float>(), c, gi_at, g_at, offset, stride, kept);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace actnn_zoo
