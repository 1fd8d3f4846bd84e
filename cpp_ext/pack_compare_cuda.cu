// pack_compare on CUDA: the twin of pack_compare_cpu.cpp (same predicates, same bits).
//
// Status: compiled by scripts/check_cuda_build.sh, NOT yet run on a GPU (none was available
// when it was written); tests/test_pack_compare.py runs the CUDA parity test only where CUDA is.
//
// One thread per output byte, grid-stride: a thread reads its 8 inputs and writes 1 byte, so no
// two threads touch the same byte. float16/bfloat16 are widened to float32 exactly.
#include "kernels.h"
#include "grid_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace actnn_zoo {

namespace {

constexpr int kThreads = 256;

template <typename T> struct Widen { using type = float; };
template <> struct Widen<double> { using type = double; };

template <typename T>
__device__ __forceinline__ typename Widen<T>::type widen(T v) {
  return static_cast<typename Widen<T>::type>(v);
}

template <int kKind, typename C>
__device__ __forceinline__ bool predicate(C v, C lo, C hi) {
  if constexpr (kKind == 0) {
    return !(v <= lo);
  } else if constexpr (kKind == 1) {
    return v > lo;
  } else {
    return (v > lo) && (v < hi);
  }
}

template <int kKind, typename T>
__global__ void pack_compare_kernel(const T* __restrict__ x, int64_t n, int64_t nbytes,
                                    typename Widen<T>::type lo, typename Widen<T>::type hi,
                                    uint8_t* __restrict__ out) {
  using C = typename Widen<T>::type;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < nbytes;
       j += stride) {
    const int64_t base = 8 * j;
    const int count = static_cast<int>(n - base < 8 ? n - base : 8);
    uint32_t byte = 0;
    for (int k = 0; k < count; ++k) {
      byte |= static_cast<uint32_t>(predicate<kKind, C>(widen(x[base + k]), lo, hi)) << k;
    }
    out[j] = static_cast<uint8_t>(byte);
  }
}

template <typename T>
void launch(const at::Tensor& x, int64_t kind, double lo, double hi, at::Tensor& out) {
  using C = typename Widen<T>::type;
  const int64_t n = x.numel(), nbytes = out.numel();
  const unsigned grid = grid_stride_blocks(nbytes, kThreads);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const T* xp = x.data_ptr<T>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const C l = static_cast<C>(lo), h = static_cast<C>(hi);
  switch (kind) {
    case 0:
      pack_compare_kernel<0, T><<<grid, kThreads, 0, stream>>>(xp, n, nbytes, l, h, o);
      break;
    case 1:
      pack_compare_kernel<1, T><<<grid, kThreads, 0, stream>>>(xp, n, nbytes, l, h, o);
      break;
    default:
      pack_compare_kernel<2, T><<<grid, kThreads, 0, stream>>>(xp, n, nbytes, l, h, o);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor pack_compare_cuda(const at::Tensor& x, int64_t kind, double lo, double hi) {
  TORCH_CHECK(x.is_cuda(), "pack_compare_cuda: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.is_contiguous(), "pack_compare_cuda: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor out = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  if (n == 0) return out;
  switch (x.scalar_type()) {
    case at::kDouble: launch<double>(x, kind, lo, hi, out); break;
    case at::kFloat: launch<float>(x, kind, lo, hi, out); break;
    case at::kHalf: launch<c10::Half>(x, kind, lo, hi, out); break;
    default: launch<c10::BFloat16>(x, kind, lo, hi, out); break;
  }
  return out;
}

}  // namespace actnn_zoo
