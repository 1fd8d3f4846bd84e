// bfloat16 bit patterns on the CPU, shared by the quantizer (quant_cpu.cpp) and DIVISION
// (division_cpu.cpp): exact conversions and the directed roundings of the contract
// (reference.round_down_bf16 / round_up_bf16 / _bf16_step).
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

namespace actnn_zoo {

constexpr uint16_t kBf16NaN = 0x7FC0;     // what torch.tensor(nan, dtype=bfloat16) holds
constexpr float kMinStep = 0x1p-126f;     // reference.MIN_STEP
constexpr uint16_t kMinStepBf16 = 0x0080;  // the same value in bf16

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float bf16_value(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

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

// Directed rounding to bf16 by truncating the low 16 bits: truncation goes toward zero, which
// is the wanted direction for one sign; for the other sign a dropped nonzero tail means one
// more ulp of magnitude. Same result as the reference's round-to-nearest-then-correct,
// including overflow to -inf (round down) and +inf (round up).
inline uint16_t bf16_round_down(float v) {
  const uint32_t u = float_bits(v);
  const uint16_t hi = static_cast<uint16_t>(u >> 16);
  return ((u & 0xFFFFu) != 0 && (u >> 31) != 0) ? static_cast<uint16_t>(hi + 1) : hi;
}
inline uint16_t bf16_round_up(float v) {
  const uint32_t u = float_bits(v);
  const uint16_t hi = static_cast<uint16_t>(u >> 16);
  return ((u & 0xFFFFu) != 0 && (u >> 31) == 0) ? static_cast<uint16_t>(hi + 1) : hi;
}
// The reference's _bf16_step(b, toward_larger=True): one ulp up through the bit pattern.
inline uint16_t bf16_next_up(uint16_t b) {
  return (b & 0x8000u) ? static_cast<uint16_t>(b - 1) : static_cast<uint16_t>(b + 1);
}

// Round-to-nearest-even float -> bf16, as c10::BFloat16 does (NaN -> 0x7FC0), branch-free.
inline uint16_t bf16_from_float(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (v != v) ? kBf16NaN : static_cast<uint16_t>(r);
}

}  // namespace actnn_zoo
