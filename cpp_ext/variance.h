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

// Memory offset of a flat logical (row-major) index of a tensor of any strides, at most
// kVarMaxDims dims (a gradient of sum() is an expanded scalar, an aten norm backward may return
// channels-last: both directions read and write through strides, no contiguous copies).
constexpr int kVarMaxDims = 16;
struct Strided {
  int nd = 0;
  bool flat = true;  // contiguous: the offset is the index
  int64_t size[kVarMaxDims] = {};
  int64_t stride[kVarMaxDims] = {};

  AZ_HD int64_t at(int64_t i) const {
    if (flat) return i;
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t s = size[d];
      const int64_t q = i / s;
      off += (i - q * s) * stride[d];
      i = q;
    }
    return off;
  }
};

// Which statistic (or weight) a flat logical index reads: (i / block) % period, period <= 0
// meaning no wrap (_rounding_variance.Stat).
AZ_HD int64_t stat_index(int64_t i, int64_t block, int64_t period) {
  const int64_t s = i / block;
  return period > 0 ? s % period : s;
}

// The metadata of the coded tensor the variances describe: lo / step (N, G) bf16 patterns, the
// width of each row (row_bits, null for one width `levels` = 2^bits - 1), rows of d values in
// groups of group_size.
struct VarPayload {
  const uint16_t* lo;
  const uint16_t* step;
  const uint8_t* row_bits;
  float levels;
  int64_t d, groups, group_size;
};

// The rounding variance of the value x at flat index i of the payload p: its group's lo, step
// and width looked up, then rounding_variance. A row width outside {1, 2, 4, 8} (which the CPU
// entry rejects; a GPU cannot check without a read-back) counts as deterministic: 0.
AZ_HD float payload_variance_at(const VarPayload& p, int64_t row, int64_t g, float x) {
  const float lo = bf16_value(p.lo[row * p.groups + g]);
  const float step = bf16_value(p.step[row * p.groups + g]);
  float levels = p.levels;
  if (p.row_bits != nullptr) {
    const uint32_t b = p.row_bits[row];
    if (b != 1 && b != 2 && b != 4 && b != 8) return 0.0f;
    levels = static_cast<float>((1u << b) - 1u);
  }
  return rounding_variance(x, lo, step, levels);
}

// payload_variance_at with the row and group of flat index i divided out.
AZ_HD float payload_variance(const VarPayload& p, int64_t i, float x) {
  const int64_t row = i / p.d;
  return payload_variance_at(p, row, (i - row * p.d) / p.group_size, x);
}

// Where the values come from: x (any strides), as themselves, or normalized on the way as a
// norm's quantizer saw them, (x - shift[s]) * scale[s] with s = stat_index(i, block, period),
// computed in W (float32, or float64 for a float64 input), rounded once to float32.
struct VarSource {
  const void* x;
  Strided at;
  const void* shift;  // null: the values themselves
  const void* scale;
  int64_t block, period;
};

template <typename W>
AZ_HD float normalized_value_at(W x, const VarSource& s, int64_t j) {
  const W m = static_cast<const W*>(s.shift)[j];
  const W c = static_cast<const W*>(s.scale)[j];
  return static_cast<float>((x - m) * c);
}

// normalized_value_at of the statistic that flat index i reads.
template <typename W>
AZ_HD float normalized_value(W x, const VarSource& s, int64_t i) {
  return normalized_value_at<W>(x, s, stat_index(i, s.block, s.period));
}

// What backward adds at the k-th kept index i: (g_i * c_i) * (stride * v_hat_k), with c_i =
// scale[s] * weight[w] / divisor (each factor optional) and v_hat_k decoded from the 1-bit
// buffer [lo (G bf16) | step (G bf16) | bits] (G = ceil(slots / group)).
struct VarCorrection {
  const uint16_t* vlo;
  const uint16_t* vstep;
  const uint8_t* bits;
  const float* scale;   // null: no factor
  const float* weight;  // null: no factor
  int64_t stat_block, stat_period, weight_block, weight_period, group;
  float divisor, stride;
};

// With the statistic and weight indices (s, w) and the 1-bit group vg of slot k given.
AZ_HD float correction_term_at(const VarCorrection& c, int64_t k, int64_t s, int64_t w,
                               int64_t vg, float g) {
  float f = c.scale != nullptr ? c.scale[s] : 1.0f;
  if (c.weight != nullptr) f = fmul(f, c.weight[w]);
  f = fdiv(f, c.divisor);
  const uint32_t code = (c.bits[k >> 3] >> (k & 7)) & 1u;
  return variance_correction(g, f, code, bf16_value(c.vlo[vg]), bf16_value(c.vstep[vg]),
                             c.stride);
}

// (A factor's block is only valid, and so only divided by, when the factor is given.)
AZ_HD float correction_term(const VarCorrection& c, int64_t k, int64_t i, float g) {
  const int64_t s = c.scale != nullptr ? stat_index(i, c.stat_block, c.stat_period) : 0;
  const int64_t w = c.weight != nullptr ? stat_index(i, c.weight_block, c.weight_period) : 0;
  return correction_term_at(c, k, s, w, k / c.group, g);
}

}  // namespace actnn_zoo
