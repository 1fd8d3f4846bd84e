// This thread's saved-tensor hook stack and torch function mode stack, as the capture session
// needs to know them (actnn_zoo/capture): which hooks a save made now reaches, and which mode a
// torch call made now is handed to first. torch's Python API has no query for either; these
// read the TLS through the C++ API's at::SavedTensorDefaultHooks and
// at::impl::PythonTorchFunctionTLS, without saving or dispatching anything (~0.2 us a call,
// where a probe save or a probe torch call through the stack cost 1.5-5 us).
//
// Also three calls every Q-layer call of a capture session makes, in C so that they cost no
// Python frames: running a layer with the capture mode off the mode stack
// (call_without_mode), counting the tensors a zoo Function saves on purpose (count_saves),
// and the capture store's key of a tensor's memory (memory_key). They take CPython's own
// calling conventions (fast call, METH_O): a pybind11 binding's argument parsing would cost
// about what the Python it replaces did. Without pybind11 nothing turns a
// C++ exception into a Python one, so each body runs inside torch's HANDLE_TH_ERRORS (a
// tensor without storage, say, raises NotImplementedError as in Python, not abort()).
#include "stacks.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace actnn_zoo {

namespace {

bool hooks_run(const at::impl::SavedTensorDefaultHooksTLS& tls) {
  return !tls.is_tracing && !tls.disabled_error_message.has_value() && !tls.stack.empty();
}

// call_without_mode(mode_type, fn, *args, **kwargs): fn(*args, **kwargs), with the innermost
// torch function mode taken off the stack while fn runs when it is an instance of mode_type
// (and put back after, also when fn raises); plainly otherwise. What
// actnn_zoo.capture.mode.call_unrouted does with the mode's __exit__ / __enter__, whose
// TorchFunctionMode versions only pop and push the stack.
PyObject* call_without_mode(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs,
                            PyObject* kwnames) {
  HANDLE_TH_ERRORS
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError,
                    "call_without_mode(mode_type, fn, *args, **kwargs) takes at least 2 "
                    "positional arguments");
    return nullptr;
  }
  PyObject* mode_type = args[0];
  PyObject* fn = args[1];
  using at::impl::PythonTorchFunctionTLS;
  std::shared_ptr<c10::SafePyObject> popped;
  if (PythonTorchFunctionTLS::get_disabled_state() !=
          at::impl::TorchFunctionDisabledState::ALL_DISABLED &&
      PythonTorchFunctionTLS::stack_len() > 0) {
    const auto& top = PythonTorchFunctionTLS::get_stack_at(PythonTorchFunctionTLS::stack_len() - 1);
    const int is_mode = PyObject_IsInstance(top->ptr(&top->pyinterpreter()), mode_type);
    if (is_mode < 0) return nullptr;
    if (is_mode) popped = PythonTorchFunctionTLS::pop_stack();
  }
  // args[2:] and the keywords, handed on as they came
  PyObject* result =
      PyObject_Vectorcall(fn, args + 2, static_cast<size_t>(nargs - 2), kwnames);
  if (popped) PythonTorchFunctionTLS::push_onto_stack(std::move(popped));
  return result;
  END_HANDLE_TH_ERRORS
}

// count_saves(tensors, min_numel, kept) -> (n_small, bytes_small, n_big, bytes_big): the
// tensors below min_numel elements and the others, with their bytes; each of the others that
// is strided and floating or bool is entered in the dict kept as {storage address: weak
// reference}. actnn_zoo.capture.store.CompressedStore._count_kept's loop, which it replaces.
PyObject* count_saves(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3 || !PyTuple_Check(args[0]) || !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "count_saves(tensors: tuple, min_numel: int, kept: dict) takes 3 arguments");
    return nullptr;
  }
  const long long min_numel = PyLong_AsLongLong(args[1]);
  if (min_numel == -1 && PyErr_Occurred()) return nullptr;
  long long n_small = 0, b_small = 0, n_big = 0, b_big = 0;
  const Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(args[0], i);
    if (!THPVariable_Check(obj)) {
      PyErr_Format(PyExc_TypeError, "count_saves: item %zd is a %s, not a Tensor", i,
                   Py_TYPE(obj)->tp_name);
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    const long long numel = t.numel();
    const long long nbytes = numel * static_cast<long long>(t.element_size());
    if (numel < min_numel) {
      ++n_small;
      b_small += nbytes;
      continue;
    }
    ++n_big;
    b_big += nbytes;
    if (t.layout() == at::kStrided && (t.is_floating_point() || t.scalar_type() == at::kBool)) {
      PyObject* key = PyLong_FromVoidPtr(const_cast<void*>(t.storage().data()));
      if (key == nullptr) return nullptr;
      PyObject* ref = PyWeakref_NewRef(obj, nullptr);
      if (ref == nullptr) {
        Py_DECREF(key);
        return nullptr;
      }
      const int err = PyDict_SetItem(args[2], key, ref);
      Py_DECREF(key);
      Py_DECREF(ref);
      if (err < 0) return nullptr;
    }
  }
  return Py_BuildValue("(LLLL)", n_small, b_small, n_big, b_big);
  END_HANDLE_TH_ERRORS
}

// memory_key(x) -> (storage address, storage offset, sizes, strides, dtype, version): the
// memory x views at its current version, the capture store's key (its Python twin is
// actnn_zoo.capture.store.memory_key, which took three Python frames and five calls on every
// compressed save).
PyObject* memory_key(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "memory_key: expected a Tensor, got %s",
                 Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(arg);
  const void* ptr = t.storage().data();  // raises as untyped_storage() does, e.g. sparse
  const int64_t offset = t.storage_offset();
  const int64_t version = t._version();
  const at::IntArrayRef sizes = t.sizes(), strides = t.strides();
  PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  PyObject* stride = PyTuple_New(static_cast<Py_ssize_t>(strides.size()));
  if (shape == nullptr || stride == nullptr) {
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return nullptr;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(sizes[i]));
    PyTuple_SET_ITEM(stride, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(strides[i]));
  }
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  // "N" steals the tuples' references, "O" adds one to the borrowed dtype
  return Py_BuildValue("(NLNNOL)", PyLong_FromVoidPtr(const_cast<void*>(ptr)),
                       static_cast<long long>(offset), shape, stride, dtype,
                       static_cast<long long>(version));
  END_HANDLE_TH_ERRORS
}

static PyMethodDef kMemoryKey = {
    "memory_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(memory_key)),
    METH_O,
    "memory_key(x) -> (storage address, storage offset, sizes, strides, dtype, version): the "
    "memory x views at its current version."};

static PyMethodDef kCallWithoutMode = {
    "call_without_mode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                             call_without_mode)),
    METH_FASTCALL | METH_KEYWORDS,
    "call_without_mode(mode_type, fn, *args, **kwargs): fn(*args, **kwargs) with the innermost "
    "torch function mode off the stack while fn runs when it is a mode_type (put back after, "
    "also when fn raises); plainly otherwise."};

static PyMethodDef kCountSaves = {
    "count_saves", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(count_saves)),
    METH_FASTCALL,
    "count_saves(tensors: tuple, min_numel: int, kept: dict) -> (n_small, bytes_small, n_big, "
    "bytes_big); each counted-big strided floating or bool tensor is entered in kept as "
    "{storage address: weak reference}."};

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
  for (PyMethodDef* def : {&kCallWithoutMode, &kCountSaves, &kMemoryKey}) {
    PyObject* fn = PyCFunction_NewEx(def, nullptr, m.attr("__name__").ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace actnn_zoo
