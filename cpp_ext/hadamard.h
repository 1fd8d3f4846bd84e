// Randomized Walsh-Hadamard transform per quantization group (hadamard_cpu.cpp, hadamard_cuda.cu;
// the executable specification is actnn_zoo/quant/hadamard.py, which these match bit for bit).
//
// Why: a group that mixes values of very different scale (an outlier feature among small ones,
// channels of different scale sharing one group) gets one step sized for the largest value, so
// the small values are quantized to almost nothing. An orthogonal rotation spreads every value
// over the whole group before quantizing; after dequantize the inverse rotation brings the
// values back, and because it is linear the stochastic rounding stays unbiased.
//
// For each row of a contiguous float32 (N, D) tensor and each *full* group of g = group_size
// columns (g a power of two in [32, 8192]; the last D % g columns of a row are left as they are):
//   forward:  y = H (s * x) / sqrt(g)      inverse:  x = s * (H y) / sqrt(g)
// H is the g x g Sylvester Hadamard matrix (applied as log2(g) butterfly stages, stage h pairing
// columns k and k + h: a, b -> a + b, a - b) and s_j = +-1 a hash of (seed, column j of the row):
//   key = fmix32(seed + 0x632BE5AB); s_j = -1 if fmix32(lo32(j) ^ key ^ hi32(j) * 0x85EBCA6B)
//   has its top bit set, else +1.
// H H = g I, so inverse(forward(x)) = x up to float rounding (log2(g) additions per value).
#pragma once
#include <torch/extension.h>

#include <cstdint>

#include "kernels.h"

namespace actnn_zoo {

constexpr int64_t kHadamardMinGroup = 32;
constexpr int64_t kHadamardMaxGroup = 8192;  // the CUDA kernel keeps one group in shared memory
constexpr uint32_t kHadamardSalt = 0x632BE5ABu;  // a key apart from the rounding's

AZ_HD uint32_t hadamard_key(uint32_t seed) { return fmix32(seed + kHadamardSalt); }
AZ_HD float hadamard_sign(uint64_t j, uint32_t key) {
  const uint32_t h = fmix32(static_cast<uint32_t>(j) ^ key ^
                            (static_cast<uint32_t>(j >> 32) * 0x85EBCA6Bu));
  return (h >> 31) ? -1.0f : 1.0f;
}

// In place on x2d (N, D) contiguous float32; returns x2d.
at::Tensor hadamard_cpu(at::Tensor& x2d, int64_t group_size, int64_t seed, bool inverse);
#ifdef ACTNN_ZOO_CUDA
at::Tensor hadamard_cuda(at::Tensor& x2d, int64_t group_size, int64_t seed, bool inverse);
#endif
// Checks shared by both devices (named arguments in the messages).
void check_hadamard_args(const at::Tensor& x2d, int64_t group_size);
// Adds hadamard_ to the extension module (called once from bindings.cpp).
void register_hadamard(pybind11::module_& m);

}  // namespace actnn_zoo
