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

void register_attention_dropout(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("attention_keep", &attention_keep_cpu, py::call_guard<py::gil_scoped_release>(),
        py::arg("n0"), py::arg("n1"), py::arg("r0"), py::arg("r1"), py::arg("cols"),
        py::arg("L"), py::arg("s1"), py::arg("s2"), py::arg("threshold"),
        "CPU only: bool (n1 - n0, r1 - r0, cols), the attention dropout keep-mask of one tile "
        "(functional.attention._Dropout.keep).");
}

}  // namespace actnn_zoo
