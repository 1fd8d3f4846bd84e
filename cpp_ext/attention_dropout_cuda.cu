// The attention dropout's keep-mask of one tile on CUDA: the twin of attention_keep_cpu
// (attention_dropout_cpu.cpp); the hash is kernels.h's keep_row_hash / keep_col_hash / keep_of,
// which the CPU loop runs too, so the CPU tests cover the arithmetic.
//
// Status: compiled by scripts/check_cuda_build.sh, NOT yet run on a GPU (none was lent when it
// was written); tests/test_cuda.py compares it with the CPU kernel where a GPU is.
//
// Why: off the CPU the mask was a torch program, ~20 small integer operators a tile after the
// call's row hashes (~3,300 operators a GPT-2 small step at sequence 1024, a fifth of its GPU
// path's operators, scripts/bench_offcpu.py), each a launch and its host work. Here: one output
// and one launch a tile. One thread per element, grid-stride (64-bit indices): the row hash is
// recomputed per element (two fmix32), cheaper than a second pass or shared memory.
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

__global__ void __launch_bounds__(kThreads)
attention_keep_kernel(bool* __restrict__ out, int64_t total, int64_t nr, int64_t cols,
                      int64_t n0, int64_t r0, int64_t L, uint32_t s1, uint32_t s2,
                      uint32_t threshold) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    const int64_t i = e / cols;  // the tile's row (n, r)
    const int64_t j = e - i * cols;
    const int64_t row = (n0 + i / nr) * L + (r0 + i % nr);
    out[e] = keep_of(keep_row_hash(row, s2), keep_col_hash(j, s1), threshold);
  }
}

}  // namespace

at::Tensor attention_keep_cuda(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols,
                               int64_t L, int64_t s1, int64_t s2, int64_t threshold,
                               c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  const int64_t nb = n1 - n0, nr = r1 - r0;
  at::Tensor out = at::empty({nb, nr, cols}, at::TensorOptions().dtype(at::kBool).device(device));
  const int64_t total = out.numel();
  if (total == 0) return out;
  attention_keep_kernel<<<grid_stride_blocks(total, kThreads), kThreads, 0,
                          c10::cuda::getCurrentCUDAStream()>>>(
      out.data_ptr<bool>(), total, nr, cols, n0, r0, L, static_cast<uint32_t>(s1),
      static_cast<uint32_t>(s2), static_cast<uint32_t>(threshold));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace actnn_zoo
