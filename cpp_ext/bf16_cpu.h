// bfloat16 bit patterns on the CPU, shared by the quantizer (quant_cpu.cpp) and DIVISION
// (division_cpu.cpp): exact conversions and the directed roundings of the contract
// (reference.round_down_bf16 / round_up_bf16 / _bf16_step).
#pragma once
#include <cstdint>
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
