// DIVISION dual-precision compression of feature maps, CPU kernels and their Python bindings.
//
// The compiled twin of actnn_zoo/quant/division_reference.py (its docstring has the rules):
// per (sample, channel) map, in one task and with the map in cache, block means in float64 ->
// float32 -> bf16 (the low part), the residual x - low against the *stored* low part, its
// float32 min / max, the map's (lo float32, step bf16), then codes with the contract's counter
// hash, packed row by row (row n = sample n) at the row's width. Results are bit-identical to
// the reference (the low part up to the order of a float64 sum, see the reference).
//
// Parallel over (sample, 8 consecutive maps): 8 maps of any size at any width in {1, 2, 4, 8}
// end on a byte boundary, so no two tasks write the same byte.
#include "kernels.h"
#include "bf16.h"
#include "division_checks.h"
#include "codes_cpu.h"
#include "isa_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace actnn_zoo {

#ifdef ACTNN_ZOO_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> division_quantize_cuda(
    const at::Tensor& x5, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t block, bool has_low, int64_t seed, bool stochastic);
at::Tensor division_dequantize_cuda(const at::Tensor& data, const at::Tensor& low,
                                    const at::Tensor& lo, const at::Tensor& step,
                                    const at::Tensor& bits, const at::Tensor& offsets,
                                    int64_t block, bool has_low, at::Tensor& out);
#endif

namespace {

constexpr int64_t kMapsPerTask = 8;  // 8 maps end on a byte boundary at every width
constexpr int64_t kCodeChunk = int64_t{1} << 16;  // values per code_block call (its n is an int)

struct Geometry {
  int64_t n, c, d1, d2, d3, s;  // s = d1 * d2 * d3 values per map
  int64_t block, nb1, nb2, nb3, nblocks;
  Geometry(at::IntArrayRef sizes, int64_t b)
      : n(sizes[0]), c(sizes[1]), d1(sizes[2]), d2(sizes[3]), d3(sizes[4]),
        s(sizes[2] * sizes[3] * sizes[4]), block(b), nb1((sizes[2] + b - 1) / b),
        nb2((sizes[3] + b - 1) / b), nb3((sizes[4] + b - 1) / b), nblocks(nb1 * nb2 * nb3) {}
  int64_t count(int64_t k1, int64_t k2, int64_t k3) const {
    return std::min(block, d1 - k1 * block) * std::min(block, d2 - k2 * block) *
           std::min(block, d3 - k3 * block);
  }
};

// f(k, e0, e1) for each run of a map's values e0..e1 (memory order) inside one low-part block
// k: a row of the last dim split at block edges, so no value needs a division to find its block.
template <typename F>
inline void for_each_block_run(const Geometry& g, const F& f) {
  int64_t e = 0;
  for (int64_t i1 = 0; i1 < g.d1; ++i1) {
    for (int64_t i2 = 0; i2 < g.d2; ++i2) {
      const int64_t k0 = ((i1 / g.block) * g.nb2 + i2 / g.block) * g.nb3;
      for (int64_t k3 = 0, i3 = 0; k3 < g.nb3; ++k3) {
        const int64_t len = std::min(g.d3 - i3, g.block);
        f(k0 + k3, e, e + len);
        i3 += len;
        e += len;
      }
    }
  }
}

// low[blocks] (float values of the stored bf16) for one map; writes the bf16 bits to low_out.
template <typename T>
void low_part(const T* x, const Geometry& g, std::vector<double>& sums, float* low_f,
              uint16_t* low_out) {
  std::fill(sums.begin(), sums.end(), 0.0);
  for_each_block_run(g, [&](int64_t k, int64_t e0, int64_t e1) {
    double a = sums[k];  // each block's values are added in memory order
    for (int64_t e = e0; e < e1; ++e) a += static_cast<float>(x[e]);
    sums[k] = a;
  });
  for (int64_t k1 = 0, k = 0; k1 < g.nb1; ++k1)
    for (int64_t k2 = 0; k2 < g.nb2; ++k2)
      for (int64_t k3 = 0; k3 < g.nb3; ++k3, ++k) {
        const double mean = sums[k] / static_cast<double>(g.count(k1, k2, k3));
        const uint16_t b = bf16_from_float(static_cast<float>(mean));
        low_out[k] = b;
        low_f[k] = bf16_value(b);
      }
}

// r = x - low (or x) for one map into r; returns whether every value is finite, and min / max.
template <typename T>
bool residual(const T* x, const Geometry& g, bool has_low, const float* low_f, float* r,
              float& mn, float& mx) {
  if (!has_low) {
    for (int64_t e = 0; e < g.s; ++e) r[e] = static_cast<float>(x[e]);
  } else {
    for_each_block_run(g, [&](int64_t k, int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) r[e] = static_cast<float>(x[e]) - low_f[k];
    });
  }
  // min / max and a non-finite flag (v * 0 is NaN exactly for NaN / Inf), vectorised; as in
  // the quantizer, a map holding both +0.0 and -0.0 may pick either zero as its minimum
  float bad = 0.0f, lo_v = std::numeric_limits<float>::infinity(), hi_v = -lo_v;
#pragma omp simd reduction(min : lo_v) reduction(max : hi_v) reduction(+ : bad)
  for (int64_t e = 0; e < g.s; ++e) {
    const float rv = r[e];
    lo_v = rv < lo_v ? rv : lo_v;
    hi_v = rv > hi_v ? rv : hi_v;
    bad = bad + rv * 0.0f;
  }
  mn = lo_v;
  mx = hi_v;
  return !std::isnan(bad);
}

// ORs the b-bit codes q[0..s) into `row` from bit `bit0` on (element e at bit bit0 + e * b,
// little-endian within bytes). A map starting on a byte boundary (every map of 8 values or a
// multiple of 8) packs whole bytes; another goes code by code.
inline void pack_map(const int32_t* q, int64_t s, int b, int64_t bit0, uint8_t* row) {
  int64_t e = 0;
  if ((bit0 & 7) == 0) {
    const int per = 8 / b;
    uint8_t* out = row + (bit0 >> 3);
    for (; e + per <= s; e += per) {
      uint32_t byte = 0;
      for (int k = 0; k < per; ++k) byte |= static_cast<uint32_t>(q[e + k]) << (k * b);
      *out++ |= static_cast<uint8_t>(byte);
    }
  }
  for (; e < s; ++e) {
    const int64_t pos = bit0 + e * b;
    row[pos >> 3] |= static_cast<uint8_t>(q[e] << (pos & 7));
  }
}

// division_reference.map_metadata for one map: lo is the float32 minimum itself (no bf16
// rounding), the step covers [lo, mx] (covering_step, bf16.h).
inline void map_meta(bool finite, float mn, float mx, float levels, float& lo, uint16_t& step) {
  step = finite ? covering_step(mn, mx, levels) : kBf16NaN;
  lo = step == kBf16NaN ? std::numeric_limits<float>::quiet_NaN() : mn;
}

template <typename T>
void quantize_impl(const T* x, const Geometry& g, const uint8_t* bits, const int64_t* offsets,
                   bool has_low, uint32_t key, bool stochastic, uint8_t* data, uint16_t* low,
                   float* lo, uint16_t* step) {
  const int64_t chunks = (g.c + kMapsPerTask - 1) / kMapsPerTask;
  const int64_t d = g.c * g.s;
  at::parallel_for(0, g.n * chunks, 1, [&](int64_t begin, int64_t end) { run_fast([&] {
    std::vector<double> sums(has_low ? g.nblocks : 0);
    std::vector<float> low_f(has_low ? g.nblocks : 0);
    std::vector<float> r(g.s);
    std::vector<int32_t> q(g.s);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks;
      const int64_t c0 = (task % chunks) * kMapsPerTask;
      const int64_t c1 = std::min(g.c, c0 + kMapsPerTask);
      const int b = bits[n];
      const float levels = static_cast<float>((1 << b) - 1);
      uint8_t* row = data + offsets[n];
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t map = n * g.c + ch;
        const T* xm = x + map * g.s;
        if (has_low) low_part(xm, g, sums, low_f.data(), low + map * g.nblocks);
        float mn, mx;
        const bool finite = residual(xm, g, has_low, low_f.data(), r.data(), mn, mx);
        float l;
        uint16_t st;
        map_meta(finite, mn, mx, levels, l, st);
        lo[map] = l;
        step[map] = st;
        const float stf = bf16_value(st);
        const float inv = stf > 0.0f ? 1.0f / stf : 0.0f;
        const uint64_t base = static_cast<uint64_t>(n) * d + ch * g.s;
        const int64_t bit0 = ch * g.s * b;
        // the codes first (codes_cpu.h, vectorised), then packed
        for (int64_t e = 0; e < g.s; e += kCodeChunk) {
          const int n = static_cast<int>(std::min(kCodeChunk, g.s - e));
          if (stochastic) {
            code_block<true>(r.data() + e, n, l, inv, levels, base + e, key, q.data() + e);
          } else {
            code_block<false>(r.data() + e, n, l, inv, levels, base + e, key, q.data() + e);
          }
        }
        pack_map(q.data(), g.s, b, bit0, row);
      }
    }
  }); });
}

template <typename T>
void dequantize_impl(const uint8_t* data, const Geometry& g, const uint8_t* bits,
                     const int64_t* offsets, bool has_low, const uint16_t* low, const float* lo,
                     const uint16_t* step, T* out) {
  const int64_t chunks = (g.c + kMapsPerTask - 1) / kMapsPerTask;
  at::parallel_for(0, g.n * chunks, 1, [&](int64_t begin, int64_t end) { run_fast([&] {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks;
      const int64_t c0 = (task % chunks) * kMapsPerTask;
      const int64_t c1 = std::min(g.c, c0 + kMapsPerTask);
      const int b = bits[n];
      const uint32_t mask = (1u << b) - 1u;
      const uint8_t* row = data + offsets[n];
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t map = n * g.c + ch;
        const float l = lo[map];
        const float st = bf16_value(step[map]);
        const uint16_t* lw = has_low ? low + map * g.nblocks : nullptr;
        T* o = out + map * g.s;
        const int64_t bit0 = ch * g.s * b;
        if (!has_low) {
          for (int64_t e = 0; e < g.s; ++e) {
            const int64_t pos = bit0 + e * b;
            const float q = static_cast<float>((row[pos >> 3] >> (pos & 7)) & mask);
            o[e] = static_cast<T>(q * st + l);
          }
          continue;
        }
        for_each_block_run(g, [&](int64_t k, int64_t e0, int64_t e1) {
          const float lv = bf16_value(lw[k]);
          for (int64_t e = e0; e < e1; ++e) {
            const int64_t pos = bit0 + e * b;
            const float q = static_cast<float>((row[pos >> 3] >> (pos & 7)) & mask);
            o[e] = static_cast<T>(lv + (q * st + l));
          }
        });
      }
    }
  }); });
}

// The rows' layout (division_checks.h) and, on the host, their values: each width valid, each
// row inside the buffer and after the previous one.
void check_rows(const at::Tensor& bits, const at::Tensor& offsets, int64_t n, int64_t d,
                int64_t nbytes) {
  division_checks::check_row_layout(bits, offsets, n);
  const uint8_t* b = bits.data_ptr<uint8_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(b[i] == 1 || b[i] == 2 || b[i] == 4 || b[i] == 8, "bits[", i,
                      "] must be 1, 2, 4 or 8, got ", int(b[i]));
    TORCH_CHECK_VALUE(off[i] >= 0 && off[i] + (d * b[i] + 7) / 8 <= off[i + 1],
                      "offsets do not fit the row widths at row ", i);
  }
  TORCH_CHECK_VALUE(off[n] <= nbytes, "offsets[N] (", off[n], ") exceeds the buffer (", nbytes,
                    " bytes)");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> division_quantize_cpu(
    const at::Tensor& x5, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t block, bool has_low, int64_t seed, bool stochastic) {
  TORCH_CHECK(x5.device().is_cpu(), "x5 must be a CPU tensor");
  division_checks::check_x5(x5, "x5");
  division_checks::check_block_total(block, total);
  const Geometry g(x5.sizes(), block);
  check_rows(bits, offsets, g.n, g.c * g.s, total);
  auto opts = x5.options();
  at::Tensor data = at::zeros({total}, opts.dtype(at::kByte));
  at::Tensor low = has_low ? at::empty({g.n, g.c, g.nb1, g.nb2, g.nb3}, opts.dtype(at::kBFloat16))
                           : at::empty({0}, opts.dtype(at::kBFloat16));
  at::Tensor lo = at::empty({g.n, g.c}, opts.dtype(at::kFloat));
  at::Tensor step = at::empty({g.n, g.c}, opts.dtype(at::kBFloat16));
  if (x5.numel() == 0) return {data, low, lo, step};
  const uint32_t key = seed_key(static_cast<uint32_t>(seed));
  uint16_t* low_p = has_low ? reinterpret_cast<uint16_t*>(low.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* step_p = reinterpret_cast<uint16_t*>(step.data_ptr<at::BFloat16>());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    quantize_impl<T>(x5.data_ptr<T>(), g, bits.data_ptr<uint8_t>(), offsets.data_ptr<int64_t>(),
                     has_low, key, stochastic, data.data_ptr<uint8_t>(), low_p,
                     lo.data_ptr<float>(), step_p);
  };
  switch (x5.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: run(c10::BFloat16{}); break;
  }
  return {data, low, lo, step};
}

at::Tensor division_dequantize_cpu(const at::Tensor& data, const at::Tensor& low,
                                   const at::Tensor& lo, const at::Tensor& step,
                                   const at::Tensor& bits, const at::Tensor& offsets,
                                   int64_t block, bool has_low, at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu(), "out must be a CPU tensor");
  division_checks::check_x5(out, "out");
  division_checks::check_block_total(block, 0);
  const Geometry g(out.sizes(), block);
  division_checks::check_payload(data, low, lo, step, has_low, g.n * g.c, g.nblocks);
  check_rows(bits, offsets, g.n, g.c * g.s, data.numel());
  if (out.numel() == 0) return out;
  const uint16_t* low_p =
      has_low ? reinterpret_cast<const uint16_t*>(low.data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* step_p = reinterpret_cast<const uint16_t*>(step.data_ptr<at::BFloat16>());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    dequantize_impl<T>(data.data_ptr<uint8_t>(), g, bits.data_ptr<uint8_t>(),
                       offsets.data_ptr<int64_t>(), has_low, low_p, lo.data_ptr<float>(),
                       step_p, out.data_ptr<T>());
  };
  switch (out.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: run(c10::BFloat16{}); break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Bindings (called from bindings.cpp's module init, so that file needs one line for them)
// ---------------------------------------------------------------------------------------------
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> division_quantize(
    const at::Tensor& x5, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t block, bool has_low, int64_t seed, bool stochastic) {
  RECORD_USER_SCOPE("actnn_zoo::division_quantize");
  TORCH_CHECK(bits.device() == x5.device() && offsets.device() == x5.device(),
              "x5, bits and offsets must be on one device");
  if (x5.device().is_cpu()) {
    return division_quantize_cpu(x5, bits, offsets, total, block, has_low, seed, stochastic);
  }
#ifdef ACTNN_ZOO_CUDA
  if (x5.is_cuda()) {
    // checked here, by the host compiler, before any nvcc-compiled code runs (see
    // check_cuda_rows in bindings.cpp): the CUDA entry repeats them
    division_checks::check_x5(x5, "x5");
    division_checks::check_block_total(block, total);
    division_checks::check_row_layout(bits, offsets, x5.size(0));
    const c10::DeviceGuard guard(x5.device());
    return division_quantize_cuda(x5, bits, offsets, total, block, has_low, seed, stochastic);
  }
#endif
  TORCH_CHECK(false, "actnn_zoo._C.division_quantize: no kernel for tensors on ", x5.device());
}

at::Tensor division_dequantize(const at::Tensor& data, const at::Tensor& low,
                               const at::Tensor& lo, const at::Tensor& step,
                               const at::Tensor& bits, const at::Tensor& offsets, int64_t block,
                               bool has_low, at::Tensor out) {
  RECORD_USER_SCOPE("actnn_zoo::division_dequantize");
  for (const at::Tensor* t : {&data, &lo, &step, &bits, &offsets}) {
    TORCH_CHECK(t->device() == out.device(), "all tensors of one call must be on ",
                out.device());
  }
  TORCH_CHECK(!has_low || low.device() == out.device(), "all tensors of one call must be on ",
              out.device());
  if (out.device().is_cpu()) {
    return division_dequantize_cpu(data, low, lo, step, bits, offsets, block, has_low, out);
  }
#ifdef ACTNN_ZOO_CUDA
  if (out.is_cuda()) {
    division_checks::check_x5(out, "out");  // as in division_quantize
    division_checks::check_block_total(block, 0);
    division_checks::check_row_layout(bits, offsets, out.size(0));
    const c10::DeviceGuard guard(out.device());
    return division_dequantize_cuda(data, low, lo, step, bits, offsets, block, has_low, out);
  }
#endif
  TORCH_CHECK(false, "actnn_zoo._C.division_dequantize: no kernel for tensors on ",
              out.device());
}

}  // namespace

void register_division(pybind11::module_& m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("division_quantize", &division_quantize, nogil, py::arg("x5"), py::arg("bits"),
        py::arg("offsets"), py::arg("total"), py::arg("block"), py::arg("has_low"),
        py::arg("seed"), py::arg("stochastic"),
        "DIVISION: (N, C, D1, D2, D3) contiguous float -> (codes uint8 [total], low bf16 "
        "(N, C, nb1, nb2, nb3) or empty, lo float32 (N, C), step bf16 (N, C)).");
  m.def("division_dequantize", &division_dequantize, nogil, py::arg("data"), py::arg("low"),
        py::arg("lo"), py::arg("step"), py::arg("bits"), py::arg("offsets"), py::arg("block"),
        py::arg("has_low"), py::arg("out"),
        "Writes low + (lo + q * step) (float32 arithmetic) into out (N, C, D1, D2, D3).");
}

}  // namespace actnn_zoo
