// The keep-mask of the attention Function's dropout (functional/attention.py, _Dropout), one
// tile at a time: element (n, r, j) of rows [n0, n1) x [r0, r1) and keys [0, cols) is kept when
//   row = n * L + r                                   (int64)
//   h   = fmix32(fmix32(lo32(row) ^ s2) ^ hi32(row))
//   c_j = fmix32(j ^ s1)
//   fmix32(h ^ c_j) < threshold                        (unsigned 32-bit)
// Bit-identical to the torch program it replaces on the CPU, where that program's ~15 small
// integer ops per tile cost more in dispatch than the hashing itself (tests/test_attention.py
// compares the two). Below it: the Function's softmax of one tile, and its whole forward and
// backward when one tile holds the call (short sequences: the host cost is the ops' dispatch).

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <limits>
#include <vector>

namespace actnn_zoo {

namespace {
void check_keep_args(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols, int64_t L,
                     int64_t threshold) {
  TORCH_CHECK(0 <= n0 && n0 <= n1 && 0 <= r0 && r0 <= r1 && cols >= 0 && L >= 1,
              "attention_keep: bad tile [", n0, ", ", n1, ") x [", r0, ", ", r1, ") x ", cols,
              " with L = ", L);
  TORCH_CHECK(0 <= threshold && threshold <= 0xFFFFFFFFLL,
              "attention_keep: threshold must be in [0, 2^32), got ", threshold);
}
}  // namespace

at::Tensor attention_keep_cpu(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols,
                              int64_t L, int64_t s1, int64_t s2, int64_t threshold) {
  check_keep_args(n0, n1, r0, r1, cols, L, threshold);
  const int64_t nb = n1 - n0, nr = r1 - r0;
  at::Tensor out = at::empty({nb, nr, cols}, at::TensorOptions().dtype(at::kBool));
  if (out.numel() == 0) return out;
  const uint32_t k1 = static_cast<uint32_t>(s1), k2 = static_cast<uint32_t>(s2);
  const uint32_t thr = static_cast<uint32_t>(threshold);
  std::vector<uint32_t> col(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) col[j] = keep_col_hash(j, k1);
  bool* dst = out.data_ptr<bool>();
  const uint32_t* c = col.data();
  at::parallel_for(0, nb * nr, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t h = keep_row_hash((n0 + i / nr) * L + (r0 + i % nr), k2);
      bool* o = dst + i * cols;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) o[j] = keep_of(h, c[j], thr);
    }
  });
  return out;
}

// The Python entry: the tile's mask on `device` (default the CPU), by the CPU loop above or the
// CUDA kernel (attention_dropout_cuda.cu), the arguments checked here first.
at::Tensor attention_keep(int64_t n0, int64_t n1, int64_t r0, int64_t r1, int64_t cols,
                          int64_t L, int64_t s1, int64_t s2, int64_t threshold,
                          std::optional<c10::Device> device) {
  if (!device.has_value() || device->is_cpu()) {
    return attention_keep_cpu(n0, n1, r0, r1, cols, L, s1, s2, threshold);
  }
  check_keep_args(n0, n1, r0, r1, cols, L, threshold);
#ifdef ACTNN_ZOO_CUDA
  if (device->is_cuda()) {
    return attention_keep_cuda(n0, n1, r0, r1, cols, L, s1, s2, threshold, *device);
  }
#endif
  TORCH_CHECK(false, "attention_keep: no kernel for ", *device, " in this build");
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

// The attention Function's forward and backward when one tile holds the whole call
// (functional/attention.py: every sample, row and key; no mask, no broadcast or GQA; float32
// on the CPU), the ops of its tile loop in the same order on the same tensors, so the results
// are its own bit for bit; one call each way instead of ~10 and ~20 Python-level ops.
// q, k, v: (N, L, E), (N, S, E), (N, S, Ev). Dropout when threshold >= 0 (its keep-mask from
// attention_keep_cpu with s1, s2, threshold; drop_scale = 1 / (1 - p) as the Function has it).
namespace {

void check_whole(const at::Tensor& q, const at::Tensor& k, const at::Tensor* v) {
  for (const at::Tensor* t : {&q, &k, v}) {
    if (t == nullptr) continue;
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3,
                      "attention_whole: q, k and v must be 3-d float32 CPU tensors, got ",
                      t->scalar_type(), " of shape ", t->sizes());
  }
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2) && q.size(1) > 0 &&
                        k.size(1) > 0 &&
                        (v == nullptr || (v->size(0) == q.size(0) && v->size(1) == k.size(1))),
                    "attention_whole: q ", q.sizes(), ", k ", k.sizes(), " and v ",
                    v == nullptr ? at::IntArrayRef() : v->sizes(), " do not fit one tile");
}

// softmax(qs k^T), causal from row 0: _probs of the whole tile
at::Tensor whole_probs(const at::Tensor& qs, const at::Tensor& k, bool causal) {
  return attention_softmax_cpu(at::bmm(qs, k.transpose(1, 2)), causal ? 0 : -1);
}

at::Tensor whole_keep(const at::Tensor& q, const at::Tensor& k, int64_t s1, int64_t s2,
                      int64_t threshold) {
  const int64_t n = q.size(0), l = q.size(1);
  return attention_keep_cpu(0, n, 0, l, k.size(1), l, s1, s2, threshold);
}

}  // namespace

at::Tensor attention_whole_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, bool causal,
                                       int64_t threshold, int64_t s1, int64_t s2,
                                       double drop_scale) {
  RECORD_USER_SCOPE("actnn_zoo::attention_whole_forward");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_whole(q, k, &v);
  at::Tensor p = whole_probs(q * scale, k, causal);
  if (threshold >= 0) p.mul_(whole_keep(q, k, s1, s2, threshold));
  at::Tensor o = at::bmm(p, v);
  if (threshold >= 0) o.mul_(drop_scale);
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_whole_backward_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
    const std::optional<at::Tensor>& v, double scale, bool causal, int64_t threshold,
    int64_t s1, int64_t s2, double drop_scale, bool need_q, bool need_k, bool need_v) {
  RECORD_USER_SCOPE("actnn_zoo::attention_whole_backward");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const bool need_qk = need_q || need_k;
  TORCH_CHECK_VALUE(!need_qk || (v.has_value() && v->defined()),
                    "attention_whole_backward: dq and dk need v");
  check_whole(q, k, need_qk ? &*v : nullptr);
  const at::Tensor qs = q * scale;
  at::Tensor p = whole_probs(qs, k, causal);
  at::Tensor keep;
  if (threshold >= 0) keep = whole_keep(q, k, s1, s2, threshold);
  const at::Tensor g = threshold >= 0 ? grad * drop_scale : grad;
  at::Tensor dq, dk, dv;
  if (need_v) {  // dV = (P * M)^T dO
    dv = at::bmm((keep.defined() ? p * keep : p).transpose(1, 2), g);
  }
  if (need_qk) {
    at::Tensor dp = at::bmm(g, v->transpose(1, 2));
    if (keep.defined()) dp.mul_(keep);
    at::Tensor ds = dp.mul_(p);  // dS = P * (dP - rowsum(P * dP))
    ds.addcmul_(p, ds.sum(-1, /*keepdim=*/true), -1.0);
    if (need_q) dq = at::bmm(ds, k).mul_(scale);
    if (need_k) dk = at::bmm(ds.transpose(1, 2), qs);
  }
  return {dq, dk, dv};
}

void register_attention_dropout(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("attention_keep", &attention_keep, py::call_guard<py::gil_scoped_release>(),
        py::arg("n0"), py::arg("n1"), py::arg("r0"), py::arg("r1"), py::arg("cols"),
        py::arg("L"), py::arg("s1"), py::arg("s2"), py::arg("threshold"),
        py::arg("device") = py::none(),
        "bool (n1 - n0, r1 - r0, cols) on device (default the CPU; CUDA in a CUDA build), the "
        "attention dropout keep-mask of one tile (functional.attention._Dropout.keep).");
  m.def("attention_softmax_", &attention_softmax_cpu, py::call_guard<py::gil_scoped_release>(),
        py::arg("s"), py::arg("causal"),
        "CPU only: in place, the attention Function's softmax of contiguous float32/float64 "
        "scores (nb, rows, cols), keys after row r + causal masked when causal >= 0 "
        "(functional.attention._probs).");
  m.def("attention_whole_forward", &attention_whole_forward_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("scale"), py::arg("causal"), py::arg("threshold"), py::arg("s1"), py::arg("s2"),
        py::arg("drop_scale"),
        "CPU only: the attention Function's output when one tile holds the whole call: "
        "softmax(q * scale @ k^T, causal) [* keep] @ v [* drop_scale] for float32 (N, L, E), "
        "(N, S, E), (N, S, Ev); dropout when threshold >= 0.");
  m.def("attention_whole_backward", &attention_whole_backward_cpu,
        py::call_guard<py::gil_scoped_release>(), py::arg("grad"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("scale"), py::arg("causal"), py::arg("threshold"), py::arg("s1"),
        py::arg("s2"), py::arg("drop_scale"), py::arg("need_q"), py::arg("need_k"),
        py::arg("need_v"),
        "CPU only: (dq, dk, dv) of attention_whole_forward at the given q, k, v (None where "
        "not needed); v may be None when only dv is needed.");
}

}  // namespace actnn_zoo
