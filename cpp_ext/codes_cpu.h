// The codes of the quantization contract on the CPU, shared by the group quantizer
// (quant_cpu.cpp), DIVISION (division_cpu.cpp) and sparse codes (sparse_cpu.cpp): clamp_code,
// code_block and pack_block (group_meta is in bf16.h), written so that
// gcc vectorises them (reference.quantize_codes gives the same numbers).
#pragma once
#include "kernels.h"
#include "half_cpu.h"

#include <cmath>
#include <cstring>

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

// Packing codes (one byte each, < 2^B) into bytes, LSB first: output byte j gathers the 8/B
// consecutive code bytes of one machine word by shift-or folding, so the loop runs on plain
// integer lanes.
template <int B>
struct PackWord;
template <> struct PackWord<1> { using type = uint64_t; };
template <> struct PackWord<2> { using type = uint32_t; };
template <> struct PackWord<4> { using type = uint16_t; };
template <> struct PackWord<8> { using type = uint8_t; };

// nbytes output bytes from codes[0 .. nbytes * 8 / B).
template <int B>
AZ_INLINE void pack_block(const uint8_t* __restrict codes, int nbytes, uint8_t* __restrict out) {
  using W = typename PackWord<B>::type;
  constexpr int kPer = 8 / B;
#pragma omp simd
  for (int j = 0; j < nbytes; ++j) {
    W v;
    std::memcpy(&v, codes + j * kPer, sizeof(W));
    if constexpr (B == 1) {
      v |= v >> 7;
      v |= v >> 14;
      v |= v >> 28;
    } else if constexpr (B == 2) {
      v |= v >> 6;
      v |= v >> 12;
    } else if constexpr (B == 4) {
      v |= v >> 4;
    }
    out[j] = static_cast<uint8_t>(v);
  }
}

// 8 bytes of 0/1 (m[k] for element k) folded into one mask byte, element k at bit k.
AZ_INLINE uint8_t gather8(const uint8_t* m) {
  uint64_t v;
  std::memcpy(&v, m, 8);
  v |= v >> 7;
  v |= v >> 14;
  v |= v >> 28;
  return static_cast<uint8_t>(v);
}

}  // namespace actnn_zoo
