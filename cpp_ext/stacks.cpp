// This thread's saved-tensor hook stack and torch function mode stack, as the capture session
// needs to know them (actnn_zoo/capture): which hooks a save made now reaches, and which mode a
// torch call made now is handed to first. torch's Python API has no query for either; these
// read the TLS through the C++ API's at::SavedTensorDefaultHooks and
// at::impl::PythonTorchFunctionTLS, without saving or dispatching anything (~0.2 us a call,
// where a probe save or a probe torch call through the stack cost 1.5-5 us).
#include "stacks.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <torch/extension.h>

namespace actnn_zoo {

namespace {

bool hooks_run(const at::impl::SavedTensorDefaultHooksTLS& tls) {
  return !tls.is_tracing && !tls.disabled_error_message.has_value() && !tls.stack.empty();
}

}  // namespace

bool saved_hooks_top_is(PyObject* pack) {
  const auto& tls = at::SavedTensorDefaultHooks::get_tls_state();
  if (!hooks_run(tls)) return false;
  const c10::SafePyObject& top = tls.stack.top().first;
  return top.ptr(&top.pyinterpreter()) == pack;
}

void register_stacks(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "saved_hooks_top_is",
      [](const py::object& pack) { return saved_hooks_top_is(pack.ptr()); }, py::arg("pack"),
      "Whether `pack` is this thread's innermost saved-tensor pack hook (the hooks a save "
      "made now reaches), without saving anything.");
  m.def(
      "saved_hooks_active",
      [] { return hooks_run(at::SavedTensorDefaultHooks::get_tls_state()); },
      "Whether saved-tensor default hooks are active in this thread (a save made now reaches "
      "some), without saving anything.");
  m.def(
      "innermost_function_mode",
      []() -> py::object {
        using at::impl::PythonTorchFunctionTLS;
        if (PythonTorchFunctionTLS::get_disabled_state() ==
            at::impl::TorchFunctionDisabledState::ALL_DISABLED) {
          return py::none();
        }
        const int64_t n = PythonTorchFunctionTLS::stack_len();
        if (n == 0) return py::none();
        const auto& mode = PythonTorchFunctionTLS::get_stack_at(n - 1);
        return py::reinterpret_borrow<py::object>(mode->ptr(&mode->pyinterpreter()));
      },
      "The torch function mode a torch call made now in this thread is handed to first (the "
      "innermost of the stack), or None (no mode, or torch function handling disabled), "
      "without calling anything.");
}

}  // namespace actnn_zoo
