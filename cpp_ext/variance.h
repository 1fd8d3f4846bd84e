// Per-value math of the sampled rounding variances (actnn_zoo/functional/_rounding_variance.py),
// host + device, shared by the CPU kernels (variance_cpu.cpp) and any GPU twin.
//
// Why: softmax's and the norms' input gradients are quadratic in the saved tensor, and the
// diagonal of that product is biased by -c_i Var(x_hat_i). Forward keeps every stride-th value's
// rounding variance step^2 f (1 - f) (1-bit, stochastic) and backward adds c_i * stride * v_hat_i
// there. Doing that with ~20 small torch ops cost ~300 us per call at tiny sizes; these helpers
// are the per-element arithmetic of one fused loop per direction, written as the torch twin
// computes it (every float32 operation rounded once: -ffp-contract=off on the host, the _rn
// intrinsics of bf16.h on the device), so kernel and twin agree bit for bit.
#pragma once
#include "bf16.h"

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace actnn_zoo {

// Finite (not Inf, not NaN), from the bits.
AZ_HD bool rv_finite(float t) { return (float_bits(t) & 0x7F800000u) != 0x7F800000u; }

AZ_HD float rv_floor(float t) {
#if defined(__CUDA_ARCH__)
  return floorf(t);
#else
  return std::floor(t);
#endif
}

// The stochastic-rounding variance of the value x on its group's grid: lo and step the stored
// bf16 metadata (as float32), levels = 2^bits - 1. t = (x - lo) * (1 / step), f = t - floor(t),
// step^2 * (f * (1 - f)); 0 where rounding is deterministic (t at or beyond a clamp, or not
// finite: a NaN group or a zero step).
AZ_HD float rounding_variance(float x, float lo, float step, float levels) {
  const float inv = fdiv(1.0f, step);
  const float t = fmul(fsub(x, lo), inv);
  if (!(t > 0.0f && t < levels && rv_finite(t))) return 0.0f;
  const float f = fsub(t, rv_floor(t));
  return fmul(fmul(step, step), fmul(f, fsub(1.0f, f)));
}

// The correction backward adds at a kept value: (g * c) * (v_hat * stride), v_hat the 1-bit
// code decoded as dequantize does (q * step + lo), c the caller's factor (1 for softmax,
// scale * weight / m for a norm over m values).
AZ_HD float variance_correction(float g, float c, uint32_t code, float lo, float step,
                                float stride) {
  const float v = fadd(fmul(static_cast<float>(code), step), lo);
  return fmul(fmul(g, c), fmul(v, stride));
}

}  // namespace actnn_zoo
