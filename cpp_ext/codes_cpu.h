// The codes of the quantization contract on the CPU, shared by the group quantizer
// (quant_cpu.cpp) and DIVISION (division_cpu.cpp): clamp_code and code_block, written so that
// gcc vectorises them (reference.quantize_codes gives the same numbers).
#pragma once
#include "kernels.h"

#include <cstdint>

#if defined(__GNUC__)
#define AZ_INLINE inline __attribute__((always_inline))
#else
#define AZ_INLINE inline
#endif

namespace actnn_zoo {

constexpr uint32_t kHashC1 = 0x85EBCA6Bu;

// floor(t) clamped to [0, L], NaN -> 0, computed as: clamp t to [0, L], then truncate. Equal
// for every t (truncation is floor for t >= 0), and vectorisable: gcc does not vectorise floorf
// under the default -ftrapping-math, and `t > 0 ? t : 0` / `q < L ? q : L` are exactly the
// x86 max/min instructions (NaN -> the second operand, 0).
AZ_INLINE int32_t clamp_code(float t, float levels) {
  float q = t > 0.0f ? t : 0.0f;
  q = q < levels ? q : levels;
  return static_cast<int32_t>(q);
}

// Codes of n values (reference.quantize_codes), element k having index i0 + k. Codes are
// int32 so that with n a multiple of 16 the vector loop (16 lanes) covers all of it: with uint8
// codes gcc would pick 64 lanes and leave short groups to a branchy scalar tail.
template <bool kStochastic>
AZ_INLINE void code_block(const float* __restrict x, int n, float lo, float inv, float levels,
                          uint64_t i0, uint32_t key, int32_t* __restrict codes) {
  const uint32_t lo32 = static_cast<uint32_t>(i0);
  if (kStochastic && lo32 > 0xFFFFFFFFu - static_cast<uint32_t>(n - 1)) {
    // The low 32 bits of the index wrap inside this block (tensors over 2^32 elements only).
    for (int e = 0; e < n; ++e) {
      float t = (x[e] - lo) * inv;
      t = t + uniform_from_index(i0 + e, key);
      codes[e] = clamp_code(t, levels);
    }
    return;
  }
  // fmix32(lo32(i) ^ key ^ hi32(i) * C1): the high half is constant over the block.
  const uint32_t hkey = key ^ (static_cast<uint32_t>(i0 >> 32) * kHashC1);
#pragma omp simd
  for (int e = 0; e < n; ++e) {
    float t = (x[e] - lo) * inv;
    float u;
    if (kStochastic) {
      const uint32_t h = fmix32((lo32 + static_cast<uint32_t>(e)) ^ hkey);
      u = static_cast<float>(static_cast<int32_t>(h >> 8)) * (1.0f / 16777216.0f);
    } else {
      u = 0.5f;
    }
    t = t + u;
    codes[e] = clamp_code(t, levels);
  }
}

}  // namespace actnn_zoo
