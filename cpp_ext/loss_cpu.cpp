// Cross-entropy's forward and backward over (rows, classes) logits in one call each (CPU).
//
// functional/loss.py's CrossEntropyFunction makes about thirty torch calls per forward, each a
// trip from Python through the dispatcher (~3-5 us): a loss on a (2, 1000) batch took ~230 us
// against torch's ~5. For the common case -- float32 (rows, classes) contiguous logits, no
// class weights, no label smoothing, one chunk of rows -- these run the same ATen operators
// in the same order on the same tensors, so the results are bit-identical to the Python path
// (tests/test_loss.py compares them); Python keeps the compression of q through the capture
// store and everything else.
//
// Per row with target t (see the module docstring of functional/loss.py):
//   a = s * w_t,  d = a * p_t - s * w_t,  q = softmax(x) with q_t = 0,  loss = w_t * nll
// where w_t is 1 on rows whose target is not ignore_index (0 else) and s is 1 / sum(w_t) for
// 'mean', 1 otherwise. The backward is grad * (a q_hat + d onehot(t)) on the decoded q_hat.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>

#include <tuple>

namespace actnn_zoo {
namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // functional/loss.py's _REDUCTION_CODES

void check_rows(const at::Tensor& x, const char* fn) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.is_contiguous(),
                    fn, ": expected contiguous float32 (rows, classes) logits on the CPU, got ",
                    x.scalar_type(), " of shape ", x.sizes(), " on ", x.device());
}

void check_reduction(int64_t reduction, const char* fn) {
  TORCH_CHECK_VALUE(reduction == kNone || reduction == kMean || reduction == kSum, fn,
                    ": reduction code must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
}

}  // namespace

// (loss, tt, a, d, q): the reduced loss ('none': per row, float32), the target with ignored
// rows set to 0, the per-row coefficients a and d, and q (a new (rows, classes) tensor; undefined
// without need_grad). Each line is the Python path's operator on the same operands.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_rows_forward(
    const at::Tensor& x, const at::Tensor& target, int64_t ignore_index, int64_t reduction,
    bool need_grad) {
  RECORD_USER_SCOPE("actnn_zoo::cross_entropy_rows_forward");
  const char* fn = "cross_entropy_rows_forward";
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::NoGradGuard no_grad;
  check_rows(x, fn);
  check_reduction(reduction, fn);
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong || target.scalar_type() == at::kByte, fn,
                    ": expected an int64 or uint8 target, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.numel() == x.size(0), fn, ": ", target.numel(),
                    " targets for ", x.size(0), " rows");
  TORCH_CHECK_VALUE(target.device().is_cpu(), fn, ": the target must be on the CPU");
  // _targets
  const at::Tensor tf = target.reshape({-1}).to(at::kLong);
  const at::Tensor valid = tf.ne(ignore_index);
  at::Tensor tt = at::where(valid, tf, at::Scalar(static_cast<int64_t>(0)));
  at::Tensor wt = valid.to(at::kFloat);
  // _coefficients without smoothing. Python's `1.0 / den` is den.reciprocal() * 1.0, and
  // a = s * ((1 - e) * wt + (e / C) * sum(w)) and b = s * (1 - e) * wt are both s * wt bit for
  // bit at e = 0 (wt is 0 or 1; multiplying by 1.0 and adding +0.0 change no float). For 'sum'
  // and 'none' s is 1, so a is wt itself (0 on ignored rows, as the where makes it).
  const at::Tensor den = wt.sum();
  at::Tensor a = reduction == kMean ? at::where(valid, den.reciprocal().mul(wt), 0.0) : wt;
  // _row_losses
  const at::Tensor lse = at::logsumexp(x, {1});
  const at::Tensor idx = tt.unsqueeze(1);
  const at::Tensor nll = lse.sub(x.gather(1, idx).squeeze(1));
  const at::Tensor rows = wt.mul(nll);  // (1 - e) * wt * nll
  // _reduce
  at::Tensor loss = reduction == kNone ? rows
                    : reduction == kSum ? rows.sum()
                                        : rows.sum().div(den);
  at::Tensor d, q;
  if (need_grad) {
    q = x.sub(lse.unsqueeze(1));
    q.exp_();
    const at::Tensor pt = q.gather(1, idx).squeeze(1);
    q.scatter_(1, idx, 0.0);
    d = a.mul(pt).sub(a);  // a * p_t - b, b == a
  }
  return {loss, tt, a, d, q};
}

// The input gradient from the decoded q_hat (rows, classes) float32, in place:
// q_hat * (a * g)[:, None], then + (d * g) at each row's target. grad: the loss's gradient, a
// scalar, or one value per row for 'none'.
at::Tensor cross_entropy_rows_backward(at::Tensor q, const at::Tensor& tt, const at::Tensor& a,
                                       const at::Tensor& d, const at::Tensor& grad,
                                       int64_t reduction) {
  RECORD_USER_SCOPE("actnn_zoo::cross_entropy_rows_backward");
  const char* fn = "cross_entropy_rows_backward";
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::NoGradGuard no_grad;
  check_rows(q, fn);
  check_reduction(reduction, fn);
  const int64_t n = q.size(0);
  TORCH_CHECK_VALUE(tt.scalar_type() == at::kLong && tt.numel() == n && a.numel() == n &&
                        d.numel() == n,
                    fn, ": expected ", n, " int64 targets and ", n, " coefficients a and d");
  const at::Tensor gf = grad.to(at::kFloat);
  const at::Tensor g = reduction == kNone ? gf.reshape({-1}) : gf;
  TORCH_CHECK_VALUE(reduction != kNone || g.numel() == n, fn, ": 'none' needs ", n,
                    " gradient values, got ", g.numel());
  q.mul_(a.mul(g).unsqueeze(1));
  q.scatter_add_(1, tt.unsqueeze(1), d.mul(g).unsqueeze(1));
  return q;
}

void register_loss(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cross_entropy_rows_forward", &cross_entropy_rows_forward,
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("target"),
        py::arg("ignore_index"), py::arg("reduction"), py::arg("need_grad"),
        "CPU only: cross-entropy of contiguous float32 (rows, classes) logits, no class "
        "weights, no label smoothing: (loss, target with ignored rows at 0, a, d, q or None), "
        "reduction 0 none / 1 mean / 2 sum; CrossEntropyFunction's operators in its order.");
  m.def("cross_entropy_rows_backward", &cross_entropy_rows_backward,
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("tt"), py::arg("a"),
        py::arg("d"), py::arg("grad"), py::arg("reduction"),
        "CPU only: the input gradient q * (a g)[:, None] + (d g) onehot(tt), in place on the "
        "decoded (rows, classes) float32 q.");
}

}  // namespace actnn_zoo
