// The keep-mask of the attention Function's dropout (functional/attention.py, _Dropout), one
// tile at a time: element (n, r, j) of rows [n0, n1) x [r0, r1) and keys [0, cols) is kept when
//   row = n * L + r                                   (int64)
//   h   = fmix32(fmix32(lo32(row) ^ s2) ^ hi32(row))
//   c_j = fmix32(j ^ s1)
//   fmix32(h ^ c_j) < threshold                        (unsigned 32-bit)
// Bit-identical to the torch program it replaces on the CPU, where that program's ~15 small
// integer ops per tile cost more in dispatch than the hashing itself (tests/test_attention.py
// compares the two).

#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace actnn_zoo {

at::Tensor attention_keep_cpu(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols,
                              int64_t L, int64_t s1, int64_t s2, int64_t threshold) {
  TORCH_CHECK(0 <= n0 && n0 <= n1 && 0 <= r0 && r0 <= r1 && cols >= 0 && L >= 1,
              "attention_keep: bad tile [", n0, ", ", n1, ") x [", r0, ", ", r1, ") x ", cols,
              " with L = ", L);
  TORCH_CHECK(0 <= threshold && threshold <= 0xFFFFFFFFLL,
              "attention_keep: threshold must be in [0, 2^32), got ", threshold);
  const int64_t nb = n1 - n0, nr = r1 - r0;
  at::Tensor out = at::empty({nb, nr, cols}, at::TensorOptions().dtype(at::kBool));
  if (out.numel() == 0) return out;
  const uint32_t k1 = static_cast<uint32_t>(s1), k2 = static_cast<uint32_t>(s2);
  const uint32_t thr = static_cast<uint32_t>(threshold);
  std::vector<uint32_t> col(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) col[j] = fmix32(static_cast<uint32_t>(j) ^ k1);
  bool* dst = out.data_ptr<bool>();
  const uint32_t* c = col.data();
  at::parallel_for(0, nb * nr, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = (n0 + i / nr) * L + (r0 + i % nr);
      const uint32_t h = fmix32(fmix32(static_cast<uint32_t>(row) ^ k2) ^
                                static_cast<uint32_t>(static_cast<uint64_t>(row) >> 32));
      bool* o = dst + i * cols;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) o[j] = fmix32(h ^ c[j]) < thr;
    }
  });
  return out;
}

}  // namespace actnn_zoo

namespace actnn_zoo {


// softmax over the last dim of scores s (nb, rows, cols), in place, as _probs computes it after
// the scores and the mask: with causal >= 0 key j of row r is masked (-inf) when j > causal + r;
// m = the row's max (0 when every key is masked); p = exp(max(s - m, floor)) - exp(floor), which
// is exactly 0 for a masked key and moves any other by less than exp(floor); then p / max(sum,
// 1). floor = -87 (float32) or -708 (float64): exp still a normal number, where the CPU's exp
// is ~6x slower on results that are 0 or subnormal. One pass per row instead of ~10 torch ops.
template <typename T>
void attention_softmax_rows(T* s, int64_t rows_total, int64_t rows, int64_t cols,
                            int64_t causal, T floor) {
  const T inf = std::numeric_limits<T>::infinity();
  const T base = std::exp(floor);
  at::parallel_for(0, rows_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = s + i * cols;
      const int64_t keys = causal >= 0 ? std::min(cols, causal + i % rows + 1) : cols;
      for (int64_t j = keys; j < cols; ++j) row[j] = -inf;
      T m = -inf;
      for (int64_t j = 0; j < cols; ++j) m = row[j] > m ? row[j] : m;
      if (m == -inf) m = 0;
      T sum = 0;
      for (int64_t j = 0; j < cols; ++j) {
        T v = row[j] - m;
        v = std::exp(v < floor ? floor : v) - base;
        row[j] = v;
        sum += v;
      }
      const T div = sum < T(1) ? T(1) : sum;
      for (int64_t j = 0; j < cols; ++j) row[j] /= div;
    }
  });
}

at::Tensor attention_softmax_cpu(at::Tensor s, int64_t causal) {
  TORCH_CHECK(s.device().is_cpu() && s.dim() == 3 && s.is_contiguous(),
              "attention_softmax_: s must be a contiguous 3-d CPU tensor, got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble,
              "attention_softmax_: s must be float32 or float64, got ", s.scalar_type());
  const int64_t rows = s.size(1), cols = s.size(2);
  if (s.numel() == 0) return s;
  if (s.scalar_type() == at::kFloat) {
    attention_softmax_rows<float>(s.data_ptr<float>(), s.size(0) * rows, rows, cols, causal,
                                  -87.0f);
  } else {
    attention_softmax_rows<double>(s.data_ptr<double>(), s.size(0) * rows, rows, cols, causal,
                                   -708.0);
  }
  return s;
}

void register_attention_dropout(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("attention_keep", &attention_keep_cpu, py::call_guard<py::gil_scoped_release>(),
        py::arg("n0"), py::arg("n1"), py::arg("r0"), py::arg("r1"), py::arg("cols"),
        py::arg("L"), py::arg("s1"), py::arg("s2"), py::arg("threshold"),
        "CPU only: bool (n1 - n0, r1 - r0, cols), the attention dropout keep-mask of one tile "
        "(functional.attention._Dropout.keep).");
  m.def("attention_softmax_", &attention_softmax_cpu, py::call_guard<py::gil_scoped_release>(),
        py::arg("s"), py::arg("causal"),
        "CPU only: in place, the attention Function's softmax of contiguous float32/float64 "
        "scores (nb, rows, cols), keys after row r + causal masked when causal >= 0 "
        "(functional.attention._probs).");
}

}  // namespace actnn_zoo
