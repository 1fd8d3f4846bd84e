// CUDA randomized Walsh-Hadamard transform per group (see hadamard.h for the definition).
// One thread block per (row, full group): the group is loaded into shared memory (signs applied
// on the way in for the forward transform), log2(g) butterfly stages run with a barrier between
// them, and the scaled result (signs applied on the way out for the inverse) is written back in
// place. Each stage performs exactly the additions of the CPU kernel and the torch reference, so
// the three agree bit for bit (nvcc is run with --fmad=false: the scale multiply is not fused).
//
// Compile-checked only (scripts/check_cuda_build.sh); not yet run on a GPU.
#include "hadamard.h"

// c10's stream header, not ATen/cuda/CUDAContext.h: that one needs cuSPARSE/cuBLAS headers a
// bare toolkit lacks (as in quant_cuda.cu).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

namespace actnn_zoo {
namespace {

__global__ void hadamard_kernel(float* __restrict__ x, int64_t d, int64_t full, int g,
                                uint32_t key, float scale, bool inverse) {
  extern __shared__ float v[];
  const int64_t row = static_cast<int64_t>(blockIdx.x) / full;
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) % full) * g;
  float* __restrict__ src = x + row * d + col0;
  for (int k = threadIdx.x; k < g; k += blockDim.x) {
    const float a = src[k];
    v[k] = inverse ? a : a * hadamard_sign(static_cast<uint64_t>(col0 + k), key);
  }
  __syncthreads();
  const int half = g / 2;
  for (int h = 1; h < g; h <<= 1) {
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
      const int i = (p / h) * 2 * h + (p % h);
      const float a = v[i];
      const float b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
    __syncthreads();
  }
  for (int k = threadIdx.x; k < g; k += blockDim.x) {
    const float y = __fmul_rn(v[k], scale);
    src[k] = inverse ? y * hadamard_sign(static_cast<uint64_t>(col0 + k), key) : y;
  }
}

}  // namespace

at::Tensor hadamard_cuda(at::Tensor& x2d, int64_t group_size, int64_t seed, bool inverse) {
  check_hadamard_args(x2d, group_size);
  const int64_t n = x2d.size(0), d = x2d.size(1), g = group_size;
  const int64_t full = d / g;
  if (n == 0 || full == 0) return x2d;
  const int64_t blocks = n * full;
  TORCH_CHECK(blocks <= 0x7FFFFFFF, "hadamard: ", blocks, " groups exceed one CUDA grid");
  const uint32_t key = hadamard_key(static_cast<uint32_t>(seed));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g)));
  const int threads = static_cast<int>(g / 2 < 256 ? g / 2 : 256);
  const size_t shared = static_cast<size_t>(g) * sizeof(float);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  hadamard_kernel<<<static_cast<unsigned>(blocks), threads, shared, stream>>>(
      x2d.data_ptr<float>(), d, full, static_cast<int>(g), key, scale, inverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return x2d;
}

}  // namespace actnn_zoo
