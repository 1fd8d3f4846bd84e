// float16 <-> float32 conversions on the CPU, branch-free so that `#pragma omp simd` loops
// vectorise them (quant_cpu.cpp, decode_cpu.h, sparse_cpu.cpp). The bf16 helpers they sit beside
// (bits_float, float_bits, ...) live in bf16.h, shared with the CUDA kernels.
#pragma once
#include "bf16.h"

#include <cmath>
#include <cstdint>

namespace actnn_zoo {

// float16 bits -> float32, exact and branch-free (both candidates computed, then a select on
// bits), so `#pragma omp simd` loops vectorise it; the same algorithm as c10's
// fp16_ieee_to_fp32_value, which static_cast<float>(c10::Half) runs without F16C. Why: the
// portable build has no F16C (run_fast's AVX2 copy cannot use intrinsics the build did not
// enable), and the scalar conversion made float16 quantize ~9x slower than float32.
inline float half_value(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
  const float subnormal = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t pick = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // a mask, not a branch
  return bits_float(sign | (float_bits(subnormal) & pick) | (float_bits(normal) & ~pick));
}

// float32 -> float16 bits, round to nearest even, branch-free (integer selects) so that it
// vectorises: c10's fp16_ieee_from_fp32_value, what c10::Half(float) runs without F16C (NaN ->
// 0x7E00, overflow -> inf). The portable build's float16 outputs went through that scalar call.
inline uint16_t half_from_float(float f) {
  const float base0 = (std::fabs(f) * 0x1p+112f) * 0x1p-110f;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const uint32_t bits = float_bits(bits_float((bias >> 1) + 0x07800000u) + base0);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);  // a mask, not a branch
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
}

}  // namespace actnn_zoo
