// Decoding the codes of the quantization contract on the CPU (reference.dequantize), shared by
// the dequantizer (quant_cpu.cpp) and the kernels that read codes without making the decoded
// tensor (norm_cpu.cpp). Header-only and always inlined, so that a caller running under
// run_fast (isa_cpu.h) gets these loops compiled for its instruction set.
#pragma once
#include "codes_cpu.h"
#include "half_cpu.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace actnn_zoo {

constexpr int kChunk = 64;  // values per dequantization chunk (then units of 16)

inline int64_t row_bytes(int64_t d, int b) { return (d * b + 7) / 8; }

// Argument checks of a payload's codes (quant_cpu.cpp): group_size a positive multiple of 8;
// bits (N,) uint8 in {1,2,4,8} and offsets (N + 1,) int64 placing every row of d values inside
// the first `limit` bytes (with `ordered`, in order and not overlapping). Returns whether the
// rows lie back to back from byte 0.
void check_group_size(int64_t group_size);
bool check_rows(const at::Tensor& bits, const at::Tensor& offsets, int64_t n_rows, int64_t d,
                int64_t limit, const char* limit_name, bool ordered);

// ---------------------------------------------------------------------------------------------
// Storing float32 results in the output dtype (round to nearest even, like .to())
// ---------------------------------------------------------------------------------------------
AZ_INLINE void store_block(const float* v, int n, float* dst) {
  std::memcpy(dst, v, n * sizeof(float));
}
AZ_INLINE void store_block(const float* __restrict v, int n, c10::BFloat16* dst) {
  uint16_t* __restrict d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int e = 0; e < n; ++e) d[e] = bf16_from_float(v[e]);
}
AZ_INLINE void store_block(const float* v, int n, c10::Half* dst) {
  int e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(v + e), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e), h);
  }
#elif defined(__F16C__)
  for (; e + 8 <= n; e += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(v + e), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), h);
  }
#endif
  uint16_t* __restrict d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int i = e; i < n; ++i) d[i] = half_from_float(v[i]);  // same rounding as the instruction
}

// ---------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------
// 16 codes at `in` (2 * B bytes) -> lo + q * step in float32. For B < 8 each lane shifts a
// broadcast word by its own constant amount: one vector of variable shifts, no shuffles.
template <int B>
AZ_INLINE void dequantize_unit(const uint8_t* __restrict in, float lo, float step,
                               float* __restrict out) {
  if constexpr (B == 8) {
#pragma omp simd
    for (int k = 0; k < 16; ++k) {
      const float s = static_cast<float>(in[k]) * step;
      out[k] = s + lo;
    }
  } else if constexpr (B == 4) {
    uint32_t w[2];
    std::memcpy(w, in, 8);
    for (int half = 0; half < 2; ++half) {
      const uint32_t v = w[half];
#pragma omp simd
      for (int k = 0; k < 8; ++k) {
        const float s = static_cast<float>(static_cast<int32_t>((v >> (4 * k)) & 15u)) * step;
        out[8 * half + k] = s + lo;
      }
    }
  } else {
    uint32_t v = 0;
    std::memcpy(&v, in, 2 * B);
#pragma omp simd
    for (int k = 0; k < 16; ++k) {
      const uint32_t q = (v >> (B * k)) & ((1u << B) - 1u);
      const float s = static_cast<float>(static_cast<int32_t>(q)) * step;
      out[k] = s + lo;
    }
  }
}

// kChunk codes from kChunk * B / 8 bytes -> float32.
template <int B>
AZ_INLINE void dequantize_chunk(const uint8_t* __restrict in, float lo, float step,
                                float* __restrict out) {
  if constexpr (B == 8) {
#pragma omp simd
    for (int k = 0; k < kChunk; ++k) {
      const float s = static_cast<float>(in[k]) * step;
      out[k] = s + lo;
    }
  } else {
    for (int c = 0; c < kChunk; c += 16) dequantize_unit<B>(in + c * B / 8, lo, step, out + c);
  }
}

template <int B, typename TO>
void dequantize_group(const uint8_t* in, int64_t len, float lo, float step, TO* out) {
  alignas(64) float v[kChunk];
  int64_t e = 0;
  for (; e + kChunk <= len; e += kChunk) {
    if constexpr (std::is_same<TO, float>::value) {
      dequantize_chunk<B>(in + e * B / 8, lo, step, out + e);
    } else {
      dequantize_chunk<B>(in + e * B / 8, lo, step, v);
      store_block(v, kChunk, out + e);
    }
  }
  for (; e + 16 <= len; e += 16) {
    dequantize_unit<B>(in + e * B / 8, lo, step, v);
    store_block(v, 16, out + e);
  }
  const int rest = static_cast<int>(len - e);
  if (rest > 0) {
    alignas(16) uint8_t packed[16] = {0};
    std::memcpy(packed, in + e * B / 8, static_cast<size_t>(row_bytes(rest, B)));
    dequantize_unit<B>(packed, lo, step, v);
    store_block(v, rest, out + e);
  }
}

// One group of codes at width b (1, 2, 4 or 8) -> lo + q * step in TO; step as its bf16 bits.
template <typename TO>
void dequantize_group_any(int b, const uint8_t* in, int64_t len, float lo, uint16_t step_bits,
                          TO* out) {
  const float step = bf16_value(step_bits);
  switch (b) {
    case 1: dequantize_group<1, TO>(in, len, lo, step, out); break;
    case 2: dequantize_group<2, TO>(in, len, lo, step, out); break;
    case 4: dequantize_group<4, TO>(in, len, lo, step, out); break;
    default: dequantize_group<8, TO>(in, len, lo, step, out); break;
  }
}

}  // namespace actnn_zoo
