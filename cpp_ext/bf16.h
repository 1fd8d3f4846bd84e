// bfloat16 bit patterns and the per-group metadata of the quantization contract, one copy for
// the CPU kernels (quant_cpu.cpp, division_cpu.cpp, sparse_cpu.cpp, norm_cpu.cpp) and the CUDA
// kernels (quant_cuda.cu, division_cuda.cu).
//
// Why one header: lo and step are stored in bf16 and every backend must give the reference's
// bits (reference.round_down_bf16 / round_up_bf16 / _bf16_step / group_metadata,
// division_reference.map_metadata). Three hand-kept copies of the rounding had drifted into
// different algorithms (truncation here, round-to-nearest-then-correct in quant_cuda.cu); they
// agree on every non-NaN float32 (checked exhaustively when they were merged), and now there is
// one to keep right.
//
// Every function is host + device (`AZ_HD`) and plain integer / float32 arithmetic. The float
// operations of the metadata go through fsub/fmul/fdiv/fadd: on the device the explicit
// round-to-nearest intrinsics (never contracted into an FMA, whatever --fmad says), on the host
// plain operators (the CPU build uses -ffp-contract=off), so both round each step once, as the
// reference does.
#pragma once
#include <cstdint>
#include <cstring>

#ifndef AZ_HD
#if defined(__CUDACC__)
#define AZ_HD __host__ __device__ __forceinline__
#else
#define AZ_HD inline
#endif
#endif

namespace actnn_zoo {

constexpr uint16_t kBf16NaN = 0x7FC0;      // what torch.tensor(nan, dtype=bfloat16) holds
constexpr float kMinStep = 0x1p-126f;      // reference.MIN_STEP
constexpr uint16_t kMinStepBf16 = 0x0080;  // the same value in bf16

AZ_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
AZ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
AZ_HD float bf16_value(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
// Inf or NaN, from the bits (no <cmath>, the same on host and device).
AZ_HD bool bf16_nonfinite(uint16_t b) { return (b & 0x7F80u) == 0x7F80u; }

// Directed rounding to bf16 by truncating the low 16 bits: truncation goes toward zero, which
// is the wanted direction for one sign; for the other sign a dropped nonzero tail means one
// more ulp of magnitude. Same result as the reference's round-to-nearest-then-correct for every
// non-NaN input, including overflow to -inf (round down) and +inf (round up).
AZ_HD uint16_t bf16_round_down(float v) {
  const uint32_t u = float_bits(v);
  const uint16_t hi = static_cast<uint16_t>(u >> 16);
  return ((u & 0xFFFFu) != 0 && (u >> 31) != 0) ? static_cast<uint16_t>(hi + 1) : hi;
}
AZ_HD uint16_t bf16_round_up(float v) {
  const uint32_t u = float_bits(v);
  const uint16_t hi = static_cast<uint16_t>(u >> 16);
  return ((u & 0xFFFFu) != 0 && (u >> 31) == 0) ? static_cast<uint16_t>(hi + 1) : hi;
}
// The reference's _bf16_step(b, toward_larger=True): one ulp up through the bit pattern.
AZ_HD uint16_t bf16_next_up(uint16_t b) {
  return (b & 0x8000u) ? static_cast<uint16_t>(b - 1) : static_cast<uint16_t>(b + 1);
}

// Round-to-nearest-even float -> bf16, as c10::BFloat16 does (NaN -> 0x7FC0), branch-free so
// that CPU loops vectorise it. No overflow of the sum: the largest non-NaN pattern is 0xFF800000.
AZ_HD uint16_t bf16_from_float(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (v != v) ? kBf16NaN : static_cast<uint16_t>(r);
}

// Single-rounding float32 arithmetic (see the top of this file).
AZ_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
AZ_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
AZ_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
AZ_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---------------------------------------------------------------------------------------------
// Group metadata: the levels lo + q * step, q in [0, levels], must cover [lo, mx]
// ---------------------------------------------------------------------------------------------
// The bf16 step of a group whose lowest level is `lo` (a float32 value, already final) and
// whose largest value is `mx`: (mx - lo) / levels rounded up to bf16, then raised by one ulp
// (at most twice) while lo + levels * step, rounded in float32, still falls below mx; a
// positive denormal step is raised to 2^-126 so that 1 / step stays finite. kBf16NaN when the
// step is not finite (the caller then marks the group bad).
// reference.group_metadata (lo = round_down_bf16(min)) and division_reference.map_metadata
// (lo = the float32 min) share this rule.
AZ_HD uint16_t covering_step(float lo, float mx, float levels) {
  uint16_t step = bf16_round_up(fdiv(fsub(mx, lo), levels));
  for (int k = 0; k < 2; ++k) {
    if (fadd(lo, fmul(levels, bf16_value(step))) < mx) step = bf16_next_up(step);
  }
  const float step_f = bf16_value(step);
  if (step_f > 0.0f && step_f < kMinStep) step = kMinStepBf16;
  return bf16_nonfinite(step) ? kBf16NaN : step;
}

struct GroupMeta {
  uint16_t lo, step;  // bf16 bit patterns
  bool bad;           // lo = step = NaN, codes 0
};

// reference.group_metadata for one group, from its float32 min and max (`finite`: no Inf or
// NaN among its values): lo = min rounded down to bf16, step = covering_step.
AZ_HD GroupMeta group_meta(float mn, float mx, bool finite, float levels) {
  if (!finite) return {kBf16NaN, kBf16NaN, true};
  const uint16_t lo = bf16_round_down(mn);
  const uint16_t step = covering_step(bf16_value(lo), mx, levels);
  if (step == kBf16NaN) return {kBf16NaN, kBf16NaN, true};
  return {lo, step, false};
}

}  // namespace actnn_zoo
