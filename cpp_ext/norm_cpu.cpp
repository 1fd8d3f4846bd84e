// Batch, layer and group norm's backward read from the codes of their saved x_hat (CPU).
//
// QBatchNorm saves x_hat = (x - mean) * invstd quantized. Decoding it into a float map, turning
// that back into x and calling aten's native_batch_norm_backward held three full maps next to
// grad_out (the decoded copy, grad_in and a temporary of aten's) and made five passes over
// them. Here the codes are decoded a group at a time into a buffer on the stack and used at
// once, in the formula written in x_hat (per channel c, m values):
//   gb = sum g,   gw = sum g * x_hat,   gi = (g - gb / m - x_hat * gw / m) * invstd * w
// (reference.batch_norm_backward_codes): two passes over grad and the codes, one write.
//
// Sums: each (sample, channel) plane is summed in 16 float lanes (lane k takes the values k,
// k + 16, ...; a fixed order whatever the vector width, so the AVX2 and the portable builds
// agree bit for bit), the lanes added in double, the planes of a channel added in double in
// sample order. gi is elementwise.
//
// Layer norm, per row r of f features: gb = sum_r g, gw = sum_r g * x_hat, and
//   gi = (wg - mean(wg) - x_hat * mean(wg * x_hat)) * rstd,   wg = g * w
// (reference.layer_norm_backward_codes); the row means in 16 float lanes added in float64.
//
// Group norm is that formula over the (sample, group) rows with w per channel: batch norm's
// plane sums give gb and gw (summed over samples) and, weighted by w, each row's two means;
// gi then takes batch norm's elementwise pass with per-(sample, group) factors
// (reference.group_norm_backward_codes).
#include "kernels.h"
#include "decode_cpu.h"
#include "isa_cpu.h"
#include "tasks_cpu.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace actnn_zoo {
namespace {

constexpr int kLanes = 16;

// Values of the groups of row n covering [start, start + len) decoded into out (the range
// starts at a group boundary).
AZ_INLINE void decode_groups(const uint8_t* row, int b, const uint16_t* lo, const uint16_t* step,
                             int64_t first_group, int64_t start, int64_t len, int64_t group_size,
                             float* out) {
  for (int64_t e = 0; e < len; e += group_size) {
    const int64_t g = first_group + e / group_size;
    const int64_t n = std::min(group_size, len - e);
    dequantize_group_any<float>(b, row + (start + e) * b / 8, n, bf16_value(lo[g]), step[g],
                                out + e);
  }
}

// Per lane sums of g and g * x over n values, added to s[0..15] and sx[0..15].
AZ_INLINE void lane_sums(const float* __restrict g, const float* __restrict x, int64_t n,
                         float* __restrict s, float* __restrict sx) {
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) {
      s[k] += g[e + k];
      sx[k] += g[e + k] * x[e + k];
    }
  }
  for (int k = 0; e + k < n; ++k) {
    s[k] += g[e + k];
    sx[k] += g[e + k] * x[e + k];
  }
}

// Pass 1: sum g and sum g * x_hat of every (sample, channel) plane, in double, into part.
// Rows are split over tasks; a row's groups are decoded in blocks of whole groups.
void plane_sums(const float* grad, const uint8_t* data, const uint16_t* lo, const uint16_t* step,
                const uint8_t* bits, const int64_t* offsets, int64_t n_rows, int64_t c,
                int64_t s, int64_t group_size, double* part) {
  const int64_t d = c * s;
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  const int64_t block = std::max<int64_t>(1, 4096 / group_size) * group_size;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(d, 1));
  parallel_tasks(n_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(std::min(block, d)));
    for (int64_t n = begin; n < end; ++n) {
      const float* gr = grad + n * d;
      double* p = part + 2 * n * c;
      std::fill(p, p + 2 * c, 0.0);
      alignas(64) float acc[kLanes], accx[kLanes];
      std::fill(acc, acc + kLanes, 0.0f);
      std::fill(accx, accx + kLanes, 0.0f);
      int64_t ch = 0;  // channel of the next value
      int64_t ch_end = s;  // where that channel's plane ends
      for (int64_t start = 0; start < d; start += block) {
        const int64_t len = std::min(block, d - start);
        decode_groups(data + offsets[n], bits[n], lo + n * g_per_row, step + n * g_per_row,
                      start / group_size, start, len, group_size, buf.data());
        int64_t pos = start;
        while (pos < start + len) {
          const int64_t stop = std::min(start + len, ch_end);
          lane_sums(gr + pos, buf.data() + (pos - start), stop - pos, acc, accx);
          pos = stop;
          if (pos == ch_end) {  // the plane is complete: its lanes, in order, in double
            double t = 0.0, tx = 0.0;
            for (int k = 0; k < kLanes; ++k) {
              t += acc[k];
              tx += accx[k];
            }
            p[2 * ch] = t;
            p[2 * ch + 1] = tx;
            std::fill(acc, acc + kLanes, 0.0f);
            std::fill(accx, accx + kLanes, 0.0f);
            ++ch;
            ch_end += s;
          }
        }
      }
    }
  });
}

// Pass 2: gi = (g * w[c] - mg[i] - x_hat * kx[i]) * sc[i], a group at a time (no product when
// w == nullptr). Factors i: per channel (batch norm, groups == 0) or per (sample, group of
// c / groups channels) (group norm).
void input_grad(const float* grad, const uint8_t* data, const uint16_t* lo, const uint16_t* step,
                const uint8_t* bits, const int64_t* offsets, int64_t n_rows, int64_t c,
                int64_t s, int64_t group_size, const float* mg, const float* kx,
                const float* sc, float* gi, const float* w = nullptr, int64_t groups = 0) {
  const int64_t cg = groups > 0 ? c / groups : 1;
  const int64_t d = c * s;
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / group_size);
  parallel_tasks(n_rows * g_per_row, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(std::min(group_size, d)));
    for (int64_t id = begin; id < end; ++id) {
      const int64_t n = id / g_per_row;
      const int64_t start = (id - n * g_per_row) * group_size;
      const int64_t len = std::min(group_size, d - start);
      decode_groups(data + offsets[n], bits[n], lo + n * g_per_row, step + n * g_per_row,
                    start / group_size, start, len, group_size, buf.data());
      const float* gr = grad + n * d + start;
      float* out = gi + n * d + start;
      int64_t pos = 0;
      while (pos < len) {
        const int64_t ch = (start + pos) / s;
        const int64_t stop = std::min(len, (ch + 1) * s - start);
        const int64_t i = groups > 0 ? n * groups + ch / cg : ch;
        const float m = mg[i], k = kx[i], f = sc[i];
        const float* x = buf.data();
        if (w != nullptr) {
          const float wc = w[ch];
#pragma omp simd
          for (int64_t e = pos; e < stop; ++e) {
            const float t = gr[e] * wc - m;
            const float u = x[e] * k;
            out[e] = (t - u) * f;
          }
        } else {
#pragma omp simd
          for (int64_t e = pos; e < stop; ++e) {
            const float t = gr[e] - m;
            const float u = x[e] * k;
            out[e] = (t - u) * f;
          }
        }
        pos = stop;
      }
    }
  });
}

// Layer norm: LN row r (of f values) is row t = r % rows_per_sample of sample n = r / that,
// positions [t * f, (t + 1) * f) of the sample's codes. Each task takes a range of LN rows,
// decodes the groups covering one row into buf (a group shared by two rows is decoded for
// each); every `grain` rows keep their own float partial sums of gw and gb, added in float64
// in order afterwards (fixed by the grain, not by the thread count).
void layer_norm_rows(const float* grad, const uint8_t* data, const uint16_t* lo,
                     const uint16_t* step, const uint8_t* bits, const int64_t* offsets,
                     int64_t rows, int64_t per_sample, int64_t f, int64_t group_size,
                     const float* rstd, const float* w, float* gi, float* part, int64_t grain) {
  const int64_t d = per_sample * f;
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  parallel_tasks(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(f + 2 * group_size));
    std::vector<float> wg(static_cast<size_t>(f));
    // A call may cover several tasks (at::parallel_for on one thread runs them in one call):
    // each task of `grain` rows keeps its own partial sums, whoever runs it.
    float* pw = nullptr;
    float* pb = nullptr;
    for (int64_t r = begin; r < end; ++r) {
      if (pw == nullptr || r % grain == 0) {
        pw = part + (r / grain) * 2 * f;
        pb = pw + f;
        std::fill(pw, pw + 2 * f, 0.0f);
      }
      const int64_t n = r / per_sample;
      const int64_t p0 = (r - n * per_sample) * f;
      const int64_t g0 = p0 / group_size;
      const int64_t g1 = std::min(g_per_row, (p0 + f + group_size - 1) / group_size);
      decode_groups(data + offsets[n], bits[n], lo + n * g_per_row, step + n * g_per_row, g0,
                    g0 * group_size, std::min(d, g1 * group_size) - g0 * group_size,
                    group_size, buf.data());
      const float* x = buf.data() + (p0 - g0 * group_size);
      const float* g = grad + r * f;
      alignas(64) float acc[kLanes], accx[kLanes];
      std::fill(acc, acc + kLanes, 0.0f);
      std::fill(accx, accx + kLanes, 0.0f);
      if (w != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) wg[j] = g[j] * w[j];
        lane_sums(wg.data(), x, f, acc, accx);
      } else {
        lane_sums(g, x, f, acc, accx);
      }
      double a = 0.0, b = 0.0;
      for (int k = 0; k < kLanes; ++k) {
        a += acc[k];
        b += accx[k];
      }
      const float k1 = static_cast<float>(a / static_cast<double>(f));
      const float k2 = static_cast<float>(b / static_cast<double>(f));
      const float s = rstd[r];
      const float* v = w != nullptr ? wg.data() : g;
      if (gi != nullptr) {
        float* out = gi + r * f;
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) {
          const float t = v[j] - k1;
          const float u = x[j] * k2;
          out[j] = (t - u) * s;
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        pw[j] += g[j] * x[j];
        pb[j] += g[j];
      }
    }
  });
}

void check_stat(const at::Tensor& t, const char* name, int64_t c) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == c && t.is_contiguous(), name,
              " must be a contiguous (", c, ",) tensor, got shape ", t.sizes());
}

// The codes of n_rows rows of d values: data uint8, lo/step bfloat16 (n_rows, groups), widths
// and offsets as the dequantizer checks them.
void check_codes(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                 const at::Tensor& bits, const at::Tensor& offsets, int64_t n_rows, int64_t d,
                 int64_t group_size) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 1 &&
              data.is_contiguous(), "data must be a contiguous 1-d uint8 CPU tensor");
  check_group_size(group_size);
  const int64_t g_per_row = (d + group_size - 1) / group_size;
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 2 &&
                t->size(0) == n_rows && t->size(1) == g_per_row && t->is_contiguous(), name,
                " must be a contiguous bfloat16 CPU tensor of shape (", n_rows, ", ", g_per_row,
                "), got ", t->scalar_type(), " ", t->sizes());
  }
  check_rows(bits, offsets, n_rows, d, data.numel(), "data", false);
}

// A contiguous float32 CPU gradient of `dims` dimensions, laid out as `layout` says.
void check_grad(const at::Tensor& grad, int64_t dims, const char* layout) {
  TORCH_CHECK(grad.device().is_cpu(), "grad must be a CPU tensor, got one on ", grad.device());
  TORCH_CHECK(grad.scalar_type() == at::kFloat, "grad must be float32, got ",
              grad.scalar_type());
  TORCH_CHECK(grad.dim() == dims && grad.is_contiguous(), "grad must be a contiguous ", layout,
              " tensor, got shape ", grad.sizes());
}

// n zeros of grad's float32 options: an allocation and a memset here, where at::zeros is a
// fill operator call besides (norm backwards make two a call, one per norm layer per step)
at::Tensor zeros_f32(int64_t n, const at::Tensor& grad) {
  at::Tensor t = at::empty({n}, grad.options());
  if (n > 0) std::memset(t.data_ptr<float>(), 0, static_cast<size_t>(n) * sizeof(float));
  return t;
}

// (gi: uninitialised unless empty, None unless need_input; gw, gb: c zeros), what the kernels
// fill and return.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_grads(const at::Tensor& grad, int64_t c,
                                                          bool need_input, bool empty) {
  at::Tensor gi = need_input ? (empty ? at::zeros_like(grad) : at::empty_like(grad))
                             : at::Tensor();
  return {gi, zeros_f32(c, grad), zeros_f32(c, grad)};
}

// The codes' tensors as the passes read them.
struct Codes {
  const uint8_t* data;
  const uint16_t* lo;
  const uint16_t* step;
  const uint8_t* bits;
  const int64_t* offsets;
  int64_t group_size;
};

Codes codes_of(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
               const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size) {
  return {data.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(lo.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>()),
          bits.data_ptr<uint8_t>(), offsets.data_ptr<int64_t>(), group_size};
}

// Pass 1 of batch and group norm on grad (N, C, S): the (sample, channel) sums of g and
// g * x_hat, (N, C, 2) float64, and their channel totals in sample order (deterministic):
// in float32 in gb and gw, and in float64 in tot (sum g, sum g * x_hat per channel) when given.
at::Tensor channel_sums(const at::Tensor& grad, const Codes& k, at::Tensor& gw, at::Tensor& gb,
                        double* tot = nullptr) {
  const int64_t n_rows = grad.size(0), c = grad.size(1), s = grad.size(2);
  at::Tensor part = at::empty({n_rows, c, 2}, grad.options().dtype(at::kDouble));
  const double* p = part.data_ptr<double>();
  plane_sums(grad.data_ptr<float>(), k.data, k.lo, k.step, k.bits, k.offsets, n_rows, c, s,
             k.group_size, part.data_ptr<double>());
  float* gw_p = gw.data_ptr<float>();
  float* gb_p = gb.data_ptr<float>();
  for (int64_t ch = 0; ch < c; ++ch) {
    double t = 0.0, tx = 0.0;
    for (int64_t n = 0; n < n_rows; ++n) {
      t += p[2 * (n * c + ch)];
      tx += p[2 * (n * c + ch) + 1];
    }
    if (tot != nullptr) {
      tot[2 * ch] = t;
      tot[2 * ch + 1] = tx;
    }
    gb_p[ch] = static_cast<float>(t);
    gw_p[ch] = static_cast<float>(tx);
  }
  return part;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_codes_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
    const at::Tensor& invstd, const std::optional<at::Tensor>& weight, bool need_input) {
  RECORD_USER_SCOPE("actnn_zoo::batch_norm_backward_codes");
  check_grad(grad, 3, "(N, C, S)");
  const int64_t n_rows = grad.size(0), c = grad.size(1), s = grad.size(2);
  const int64_t d = c * s;
  check_codes(data, lo, step, bits, offsets, n_rows, d, group_size);
  check_stat(invstd, "invstd", c);
  if (weight.has_value()) check_stat(*weight, "weight", c);

  auto [gi, gw, gb] = norm_grads(grad, c, need_input, n_rows == 0 || d == 0);
  if (n_rows == 0 || d == 0) return {gi, gw, gb};
  const Codes k = codes_of(data, lo, step, bits, offsets, group_size);
  std::vector<double> tot(2 * c);
  channel_sums(grad, k, gw, gb, tot.data());
  if (need_input) {  // the per-channel factors of gi
    std::vector<float> mg(c), kx(c), sc(c);
    const float* inv = invstd.data_ptr<float>();
    const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
    const double count = static_cast<double>(n_rows) * static_cast<double>(s);
    for (int64_t ch = 0; ch < c; ++ch) {
      mg[ch] = static_cast<float>(tot[2 * ch] / count);
      kx[ch] = static_cast<float>(tot[2 * ch + 1] / count);
      sc[ch] = w != nullptr ? inv[ch] * w[ch] : inv[ch];
    }
    input_grad(grad.data_ptr<float>(), k.data, k.lo, k.step, k.bits, k.offsets, n_rows, c, s,
               group_size, mg.data(), kx.data(), sc.data(), gi.data_ptr<float>());
  }
  return {gi, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_codes_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight, bool need_input) {
  RECORD_USER_SCOPE("actnn_zoo::layer_norm_backward_codes");
  check_grad(grad, 2, "(rows, features)");
  const int64_t rows = grad.size(0), f = grad.size(1);
  const int64_t n_rows = bits.dim() == 1 ? bits.size(0) : -1;
  TORCH_CHECK_VALUE(n_rows > 0 ? rows % n_rows == 0 : rows == 0, "the ", rows,
                    " rows of grad are not whole samples of the ", n_rows, " coded rows");
  const int64_t per_sample = n_rows > 0 ? rows / n_rows : 0;
  const int64_t d = per_sample * f;
  check_codes(data, lo, step, bits, offsets, std::max<int64_t>(n_rows, 0), d, group_size);
  check_stat(rstd, "rstd", rows);
  if (weight.has_value()) check_stat(*weight, "weight", f);

  at::Tensor gw = zeros_f32(f, grad);
  at::Tensor gb = zeros_f32(f, grad);
  at::Tensor gi = need_input ? at::empty_like(grad) : at::Tensor();
  if (rows == 0 || f == 0) {
    if (need_input) gi.zero_();
    return {gi, gw, gb};
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / f);
  const int64_t tasks = (rows + grain - 1) / grain;
  at::Tensor part = at::empty({tasks, 2, f}, grad.options());
  layer_norm_rows(grad.data_ptr<float>(), data.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(lo.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>()),
                  bits.data_ptr<uint8_t>(), offsets.data_ptr<int64_t>(), rows, per_sample, f,
                  group_size, rstd.data_ptr<float>(),
                  weight.has_value() ? weight->data_ptr<float>() : nullptr,
                  need_input ? gi.data_ptr<float>() : nullptr, part.data_ptr<float>(), grain);
  const float* p = part.data_ptr<float>();
  float* gw_p = gw.data_ptr<float>();
  float* gb_p = gb.data_ptr<float>();
  for (int64_t j = 0; j < f; ++j) {
    double tw = 0.0, tb = 0.0;
    for (int64_t k = 0; k < tasks; ++k) {
      tw += p[(2 * k) * f + j];
      tb += p[(2 * k + 1) * f + j];
    }
    gw_p[j] = static_cast<float>(tw);
    gb_p[j] = static_cast<float>(tb);
  }
  return {gi, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_codes_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight, bool need_input,
    int64_t groups) {
  RECORD_USER_SCOPE("actnn_zoo::group_norm_backward_codes");
  check_grad(grad, 3, "(N, C, S)");
  const int64_t n_rows = grad.size(0), c = grad.size(1), s = grad.size(2);
  TORCH_CHECK_VALUE(groups > 0 && c % groups == 0, c, " channels do not split into ", groups,
                    " groups");
  const int64_t d = c * s;
  check_codes(data, lo, step, bits, offsets, n_rows, d, group_size);
  check_stat(rstd, "rstd", n_rows * groups);
  if (weight.has_value()) check_stat(*weight, "weight", c);

  auto [gi, gw, gb] = norm_grads(grad, c, need_input, n_rows == 0 || d == 0);
  if (n_rows == 0 || d == 0) return {gi, gw, gb};
  const Codes k = codes_of(data, lo, step, bits, offsets, group_size);
  const at::Tensor part = channel_sums(grad, k, gw, gb);
  const double* p = part.data_ptr<double>();
  if (need_input) {
    // Per (sample, group) row of m values: mean(wg) and mean(wg * x_hat) from the plane sums,
    // each channel's weighted by its w, and the row's rstd.
    const int64_t cg = c / groups;
    const double m = static_cast<double>(cg) * static_cast<double>(s);
    const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
    std::vector<float> mg(n_rows * groups), kx(n_rows * groups);
    for (int64_t n = 0; n < n_rows; ++n) {
      for (int64_t gr = 0; gr < groups; ++gr) {
        double t = 0.0, tx = 0.0;
        for (int64_t ch = gr * cg; ch < (gr + 1) * cg; ++ch) {
          const double wc = w != nullptr ? static_cast<double>(w[ch]) : 1.0;
          t += wc * p[2 * (n * c + ch)];
          tx += wc * p[2 * (n * c + ch) + 1];
        }
        mg[n * groups + gr] = static_cast<float>(t / m);
        kx[n * groups + gr] = static_cast<float>(tx / m);
      }
    }
    input_grad(grad.data_ptr<float>(), k.data, k.lo, k.step, k.bits, k.offsets, n_rows, c, s,
               group_size, mg.data(), kx.data(), rstd.data_ptr<float>(), gi.data_ptr<float>(),
               w, groups);
  }
  return {gi, gw, gb};
}

// -- One call each way for a norm's forward with its save and for its backward -------------
// What functional/norm.py's Functions did through ~40 Python calls each way, with the same
// kernels in the same order and the same random draws, so equal to that path bit for bit:
// torch's native_*_norm (batch norm: running statistics updated in place), the codes of
// x_hat = (x - mean) * stat at one width (quantize_affine_uniform_cpu over x's rows, the
// statistic of position p of row n at n * row_stride + p / block) and, for var_stride > 0, the
// 1-bit codes of the rounding variances sampled at offset + k * var_stride
// (rounding_variance_codes_cpu; offset and seed drawn after the codes' seed, as
// _rounding_variance.draw_sample draws them). Backward: the *_backward_codes kernel above on
// one width's codes, then the input gradient's rounding-variance correction
// (rounding_variance_correct_cpu). CPU, contiguous non-empty float32 x.
namespace {

// (out, mean, stat, data, lo, step, variance codes or undefined, variance offset)
using NormSave = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, int64_t>;

void check_norm_input(const at::Tensor& x, int64_t min_dims, int64_t var_stride,
                      const char* name) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                        x.dim() >= min_dims && x.is_contiguous() && x.numel() > 0,
                    name, ": x must be a non-empty contiguous float32 CPU tensor of at least ",
                    min_dims, " dims, got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK_VALUE(var_stride >= 0, "var_stride must be >= 0, got ", var_stride);
}

void check_norm_grad(const at::Tensor& grad, const char* name) {  // any strides
  TORCH_CHECK_VALUE(grad.dim() >= 2 && grad.numel() > 0, name,
                    ": grad must be a non-empty tensor of at least 2 dims, got shape ",
                    grad.sizes());
}

// The codes of x_hat and the sampled variances of a norm's output `out` and statistics;
// (stat_block, stat_period): which statistic a flat index reads, for the variances.
NormSave save_normalized(const at::Tensor& x, at::Tensor out, at::Tensor mean, at::Tensor stat,
                         int64_t row_stride, int64_t block, int64_t stat_block,
                         int64_t stat_period, int64_t bits, int64_t group_size, int64_t seed,
                         bool stochastic, int64_t var_stride) {
  const int64_t n = x.size(0), d = x.numel() / n;
  auto [data, lo, step] = quantize_affine_uniform_cpu(
      x.view({n, d}), mean.reshape(-1), stat.reshape(-1), row_stride, block, bits, group_size,
      seed & 0xFFFFFFFF, stochastic);
  at::Tensor var;
  int64_t offset = 0;
  if (var_stride > 0) {
    const auto [off, var_seed] = draw_sample_cpu(var_stride);
    offset = off;
    var = rounding_variance_codes_cpu(lo, step, std::nullopt, bits, group_size, x, mean, stat,
                                      stat_block, stat_period, offset, var_stride, var_seed);
  }
  return {std::move(out), std::move(mean), std::move(stat), data, lo, step, var, offset};
}

// The rows layout of codes at one width (rows back to back), as the kernels above read it.
// Both filled by a loop (CPU tensors): at::full would be two more dispatches.
std::pair<at::Tensor, at::Tensor> one_width_rows(int64_t n, int64_t d, int64_t bits,
                                                 const at::TensorOptions& opts) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8,
                    "bits must be 1, 2, 4 or 8, got ", bits);
  const int64_t row = (d * bits + 7) / 8;
  at::Tensor row_bits = at::empty({n}, opts.dtype(at::kByte));
  std::fill_n(row_bits.data_ptr<uint8_t>(), n, static_cast<uint8_t>(bits));
  at::Tensor offsets = at::empty({n + 1}, opts.dtype(at::kLong));
  int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i <= n; ++i) o[i] = i * row;
  return {row_bits, offsets};
}

// The backward's input gradient `gi` (of `g`'s values, any shape) corrected in place when
// variance codes were saved, then shaped as `sizes`: + stat * w * g * Var_hat / divisor.
at::Tensor corrected(at::Tensor gi, const at::Tensor& g, const std::optional<at::Tensor>& var,
                     int64_t offset, int64_t stride, const at::Tensor& stat, int64_t stat_block,
                     int64_t stat_period, const std::optional<at::Tensor>& weight,
                     int64_t w_block, int64_t w_period, int64_t divisor, at::IntArrayRef sizes) {
  if (var.has_value() && var->defined()) {
    rounding_variance_correct_cpu(gi, g, *var, offset, stride, stat, stat_block, stat_period,
                                  weight, w_block, w_period, static_cast<double>(divisor));
  }
  return gi.sizes() == sizes ? gi : gi.view(sizes);  // (a view is a dispatch more)
}

}  // namespace

// Batch norm over (N, C, *): statistics per channel.
NormSave batch_norm_forward_codes_cpu(const at::Tensor& x,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& running_mean,
                                      const std::optional<at::Tensor>& running_var,
                                      double momentum, double eps, int64_t bits,
                                      int64_t group_size, int64_t seed, bool stochastic,
                                      int64_t var_stride) {
  RECORD_USER_SCOPE("actnn_zoo::batch_norm_forward_codes");
  const at::NoGradGuard no_grad;  // also when called outside a Function (_norm_node)
  check_norm_input(x, 2, var_stride, "batch_norm_forward_codes");
  auto [out, mean, invstd] = at::native_batch_norm(x, weight, bias, running_mean, running_var,
                                                   true, momentum, eps);
  const int64_t c = x.size(1), s = x.numel() / x.size(0) / c;
  return save_normalized(x, out, mean, invstd, 0, s, s, c, bits, group_size, seed, stochastic,
                         var_stride);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, bool need_input) {
  check_norm_grad(grad, "batch_norm_backward_fused");
  const int64_t n = grad.size(0), c = grad.size(1);
  const at::Tensor g3 = grad.contiguous().view({n, c, -1});
  const int64_t s = g3.size(2);
  const auto [row_bits, offsets] = one_width_rows(n, c * s, bits, grad.options());
  auto [gi, gw, gb] = batch_norm_backward_codes_cpu(g3, data, lo, step, row_bits, offsets,
                                                    group_size, invstd, weight, need_input);
  if (need_input) {
    gi = corrected(gi, g3, var, var_offset, var_stride, invstd, s, c, weight, s, c, n * s,
                   grad.sizes());
  }
  return {gi, gw, gb};
}

// Layer norm over the last dims (`normalized_shape`, fewer dims than x): statistics per row.
NormSave layer_norm_forward_codes_cpu(const at::Tensor& x, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps,
                                      int64_t bits, int64_t group_size, int64_t seed,
                                      bool stochastic, int64_t var_stride) {
  RECORD_USER_SCOPE("actnn_zoo::layer_norm_forward_codes");
  const at::NoGradGuard no_grad;  // also when called outside a Function (_norm_node)
  check_norm_input(x, static_cast<int64_t>(normalized_shape.size()) + 1, var_stride,
                   "layer_norm_forward_codes");
  auto [out, mean, rstd] = at::native_layer_norm(x, normalized_shape, weight, bias, eps);
  const int64_t d = x.numel() / x.size(0), f = c10::multiply_integers(normalized_shape);
  return save_normalized(x, out, mean, rstd, d / f, f, f, 0, bits, group_size, seed,
                         stochastic, var_stride);
}

// grad_weight and grad_bias come back flat, (f,).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, int64_t normalized_numel, bool need_input) {
  const int64_t f = normalized_numel;
  check_norm_grad(grad, "layer_norm_backward_fused");
  TORCH_CHECK_VALUE(f > 0 && (grad.numel() / grad.size(0)) % f == 0,
                    "layer_norm_backward_fused: rows of ", f, " values do not tile the samples "
                    "of a gradient of shape ", grad.sizes());
  const int64_t n = grad.size(0), d = grad.numel() / n;
  // (rows, f) and the flat weight, views only where the shapes differ (a dispatch each)
  const at::Tensor gc = grad.contiguous();
  const at::Tensor g2 = gc.dim() == 2 && gc.size(1) == f ? gc : gc.view({-1, f});
  const auto [row_bits, offsets] = one_width_rows(n, d, bits, grad.options());
  std::optional<at::Tensor> w;
  if (weight.has_value()) w = weight->dim() == 1 ? *weight : weight->reshape(-1);
  auto [gi, gw, gb] = layer_norm_backward_codes_cpu(g2, data, lo, step, row_bits, offsets,
                                                    group_size, rstd.reshape(-1), w, need_input);
  if (need_input) {
    gi = corrected(gi, g2, var, var_offset, var_stride, rstd, f, 0, w, 1, f, f, grad.sizes());
  }
  return {gi, gw, gb};
}

// Group norm over (N, C, *) in `groups` groups: statistics per (sample, group), position p of
// row n reading n * groups + p / (C / groups * S).
NormSave group_norm_forward_codes_cpu(const at::Tensor& x, int64_t groups,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps,
                                      int64_t bits, int64_t group_size, int64_t seed,
                                      bool stochastic, int64_t var_stride) {
  RECORD_USER_SCOPE("actnn_zoo::group_norm_forward_codes");
  const at::NoGradGuard no_grad;  // also when called outside a Function (_norm_node)
  check_norm_input(x, 2, var_stride, "group_norm_forward_codes");
  TORCH_CHECK_VALUE(groups > 0 && x.size(1) % groups == 0, x.size(1),
                    " channels do not split into ", groups, " groups");
  const int64_t n = x.size(0), c = x.size(1), s = x.numel() / n / c;
  auto [out, mean, rstd] = at::native_group_norm(x, weight, bias, n, c, s, groups, eps);
  const int64_t m = (c / groups) * s;  // values per (sample, group)
  return save_normalized(x, out, mean, rstd, groups, m, m, 0, bits, group_size, seed,
                         stochastic, var_stride);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_fused_cpu(
    const at::Tensor& grad, const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
    int64_t bits, int64_t group_size, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& var,
    int64_t var_offset, int64_t var_stride, int64_t groups, bool need_input) {
  check_norm_grad(grad, "group_norm_backward_fused");
  const int64_t n = grad.size(0), c = grad.size(1);
  TORCH_CHECK_VALUE(groups > 0 && c % groups == 0, c, " channels do not split into ", groups,
                    " groups");
  const at::Tensor g3 = grad.contiguous().view({n, c, -1});
  const int64_t s = g3.size(2), m = (c / groups) * s;
  const auto [row_bits, offsets] = one_width_rows(n, c * s, bits, grad.options());
  auto [gi, gw, gb] = group_norm_backward_codes_cpu(g3, data, lo, step, row_bits, offsets,
                                                    group_size, rstd.reshape(-1), weight,
                                                    need_input, groups);
  if (need_input) {
    gi = corrected(gi, g3, var, var_offset, var_stride, rstd, m, 0, weight, s, c, m,
                   grad.sizes());
  }
  return {gi, gw, gb};
}

using NormCodes = std::tuple<at::Tensor, at::Tensor, at::Tensor> (*)(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
    const std::optional<at::Tensor>&, bool);

void def_norm(pybind11::module_& m, const char* name, NormCodes fn, const char* stat,
              const char* doc) {
  namespace py = pybind11;
  m.def(name, fn, py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("data"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("offsets"),
        py::arg("group_size"), py::arg(stat), py::arg("weight"), py::arg("need_input"), doc);
}

void register_norm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("batch_norm_forward_codes", &batch_norm_forward_codes_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("running_mean"), py::arg("running_var"), py::arg("momentum"),
        py::arg("eps"), py::arg("bits"), py::arg("group_size"), py::arg("seed"),
        py::arg("stochastic"), py::arg("var_stride"),
        "Training batch norm's forward with its save: (out, mean, invstd, data, lo, step, "
        "variance codes or None, variance offset) for contiguous float32 x (N, C, *); codes of "
        "x_hat at one width, variances sampled when var_stride > 0. CPU only.");
  m.def("batch_norm_backward_fused", &batch_norm_backward_fused_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("data"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("group_size"),
        py::arg("invstd"), py::arg("weight"), py::arg("var"), py::arg("var_offset"),
        py::arg("var_stride"), py::arg("need_input"),
        "batch_norm_backward_codes of one width's codes plus the rounding-variance correction "
        "of the input gradient: (grad_input or None, grad_weight, grad_bias). CPU only.");
  m.def("layer_norm_forward_codes", &layer_norm_forward_codes_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("normalized_shape"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("bits"),
        py::arg("group_size"), py::arg("seed"), py::arg("stochastic"), py::arg("var_stride"),
        "Layer norm's forward with its save: (out, mean, rstd, data, lo, step, variance codes "
        "or None, variance offset) for contiguous float32 x; as batch_norm_forward_codes. "
        "CPU only.");
  m.def("layer_norm_backward_fused", &layer_norm_backward_fused_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("data"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("group_size"),
        py::arg("rstd"), py::arg("weight"), py::arg("var"), py::arg("var_offset"),
        py::arg("var_stride"), py::arg("normalized_numel"), py::arg("need_input"),
        "layer_norm_backward_codes of one width's codes plus the rounding-variance correction "
        "of the input gradient: (grad_input or None, grad_weight (f,), grad_bias (f,)). CPU "
        "only.");
  m.def("group_norm_forward_codes", &group_norm_forward_codes_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("groups"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("bits"),
        py::arg("group_size"), py::arg("seed"), py::arg("stochastic"), py::arg("var_stride"),
        "Group norm's forward with its save: (out, mean, rstd, data, lo, step, variance codes "
        "or None, variance offset) for contiguous float32 x (N, C, *); as "
        "batch_norm_forward_codes. CPU only.");
  m.def("group_norm_backward_fused", &group_norm_backward_fused_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("data"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("group_size"),
        py::arg("rstd"), py::arg("weight"), py::arg("var"), py::arg("var_offset"),
        py::arg("var_stride"), py::arg("groups"), py::arg("need_input"),
        "group_norm_backward_codes of one width's codes plus the rounding-variance correction "
        "of the input gradient: (grad_input or None, grad_weight (C,), grad_bias (C,)). CPU "
        "only.");
  def_norm(m, "batch_norm_backward_codes", &batch_norm_backward_codes_cpu, "invstd",
           "Training batch norm's backward from the codes of its saved x_hat: grad (N, C, S) "
           "float32 -> (grad_input or None, grad_weight, grad_bias), float32 "
           "(reference.batch_norm_backward_codes). CPU only.");
  def_norm(m, "layer_norm_backward_codes", &layer_norm_backward_codes_cpu, "rstd",
           "Layer norm's backward from the codes of its saved x_hat: grad (rows, features) "
           "float32, rows a multiple of the coded samples -> (grad_input or None, "
           "grad_weight, grad_bias), float32 (reference.layer_norm_backward_codes). CPU only.");
  m.def("group_norm_backward_codes", &group_norm_backward_codes_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("data"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("offsets"),
        py::arg("group_size"), py::arg("rstd"), py::arg("weight"), py::arg("need_input"),
        py::arg("groups"),
        "Group norm's backward from the codes of its saved x_hat: grad (N, C, S) float32, "
        "rstd (N * groups,) -> (grad_input or None, grad_weight, grad_bias), float32 "
        "(reference.group_norm_backward_codes). CPU only.");
}

}  // namespace actnn_zoo
