// Python bindings of actnn_zoo._C: each function checks that its tensors share one device and
// sends the call to the CPU or CUDA kernel (kernels.h); the kernels check everything else.
//
// Each call opens a profiler scope named "actnn_zoo::<function>" (RECORD_USER_SCOPE), so the
// kernels show up in torch.profiler tables like operators do. With no profiler running that is
// one check of a flag, unlike a Python `record_function`, which costs an operator call each time.
#include "kernels.h"
#include "hadamard.h"
#include "isa_cpu.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <c10/core/DeviceGuard.h>
#include <mutex>
#include <string>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace actnn_zoo {
void register_division(pybind11::module_& m);  // division_cpu.cpp
void register_pack_compare(pybind11::module_& m);  // pack_compare_cpu.cpp
void register_sparse(pybind11::module_& m);  // sparse_cpu.cpp
void register_norm(pybind11::module_& m);  // norm_cpu.cpp
void register_variance(pybind11::module_& m);  // variance_cpu.cpp
void register_attention_dropout(pybind11::module_& m);  // attention_dropout_cpu.cpp
void register_qlayers(pybind11::module_& m);  // qlayers.cpp
void register_stacks(pybind11::module_& m);  // stacks.cpp
void register_loss(pybind11::module_& m);  // loss_cpu.cpp
}  // namespace actnn_zoo

namespace {

void check_same_device(const at::Tensor& ref, const char* ref_name,
                       std::initializer_list<std::pair<const at::Tensor*, const char*>> others) {
  for (const auto& item : others) {
    TORCH_CHECK(item.first->device() == ref.device(), item.second, " is on ",
                item.first->device(), " but ", ref_name, " is on ", ref.device(),
                "; all tensors of one call must be on the same device");
  }
}

[[noreturn]] void no_kernel(const char* fn, const at::Tensor& t) {
  if (t.is_cuda()) {
    TORCH_CHECK(false, "actnn_zoo._C.", fn, ": this build has no CUDA kernels (compiled without "
                "ACTNN_ZOO_CUDA); rebuild with a CUDA toolkit or use the reference backend");
  }
  TORCH_CHECK(false, "actnn_zoo._C.", fn, ": no kernel for tensors on ", t.device());
}

#ifdef ACTNN_ZOO_CUDA
// The CUDA entries' argument checks, compiled here by the host compiler and run before any
// nvcc-compiled code. On an H200 (torch 2.11, CUDA 13) a 1-d input to quantize crashed the
// interpreter (SIGSEGV) inside quantize_cuda, whose failing check printed the tensor's sizes;
// the checks before it, whose messages print no sizes, raised as they should. The same checks
// stay in quant_cuda.cu, with messages that print no sizes.
void check_cuda_rows(const char* fn, const at::Tensor& t, const char* name,
                     const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size) {
  TORCH_CHECK(t.dim() == 2, fn, ": ", name, " must be 2-d (N, D), got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous");
  const at::ScalarType dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, fn, ": ", name,
              " must be float32, float16 or bfloat16, got ", dt);
  const int64_t n = t.size(0);
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.dim() == 1 && bits.size(0) == n, fn,
              ": bits must be uint8 of shape (", n, ",), got ", bits.scalar_type(), " ",
              bits.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
              offsets.size(0) == n + 1, fn, ": offsets must be int64 of shape (", n + 1,
              ",), got ", offsets.scalar_type(), " ", offsets.sizes());
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, fn,
              ": group_size must be a positive multiple of 8, got ", group_size);
}

void check_cuda_codes(const char* fn, const at::Tensor& out, const at::Tensor& data,
                      const at::Tensor& lo, const at::Tensor& step, int64_t group_size) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1, fn,
              ": data must be a 1-d uint8 tensor, got ", data.scalar_type(), " ", data.sizes());
  const int64_t n = out.size(0), d = out.size(1);
  const int64_t g = d == 0 ? 0 : (d - 1) / group_size + 1;
  for (const at::Tensor* t : {&lo, &step}) {
    const char* name = t == &lo ? "lo" : "step";
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == g, fn, ": ", name, " must be bfloat16 of shape (", n, ", ",
                g, "), got ", t->scalar_type(), " ", t->sizes());
  }
}

// quantize on a CUDA tensor: the checks above, then the kernels (lean: the lean kernel where it
// applies; quant_cuda.cu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_on_cuda(
    const char* fn, const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets,
    int64_t total, int64_t group_size, int64_t seed, bool stochastic, bool lean) {
  check_cuda_rows(fn, x2d, "x2d", bits, offsets, group_size);
  TORCH_CHECK(total >= 0, fn, ": total must be >= 0, got ", total);
  const c10::DeviceGuard guard(x2d.device());
  return actnn_zoo::quantize_cuda(x2d, bits, offsets, total, group_size, seed, stochastic, lean);
}
#endif  // ACTNN_ZOO_CUDA

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic) {
  RECORD_USER_SCOPE("actnn_zoo::quantize");
  check_same_device(x2d, "x2d", {{&bits, "bits"}, {&offsets, "offsets"}});
  if (x2d.device().is_cpu()) {
    return actnn_zoo::quantize_cpu(x2d, bits, offsets, total, group_size, seed, stochastic);
  }
#ifdef ACTNN_ZOO_CUDA
  if (x2d.is_cuda()) {
    return quantize_on_cuda("quantize", x2d, bits, offsets, total, group_size, seed, stochastic,
                            /*lean=*/false);
  }
#endif
  no_kernel("quantize", x2d);
}

// quantize's CUDA path through the lean kernel (quant_cuda.cu) where it applies: for the
// parity tests and scripts/bench_cuda.py, until a GPU run makes it the default.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_lean(
    const at::Tensor& x2d, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic) {
  RECORD_USER_SCOPE("actnn_zoo::quantize");
  check_same_device(x2d, "x2d", {{&bits, "bits"}, {&offsets, "offsets"}});
#ifdef ACTNN_ZOO_CUDA
  if (x2d.is_cuda()) {
    return quantize_on_cuda("quantize_lean", x2d, bits, offsets, total, group_size, seed,
                            stochastic, /*lean=*/true);
  }
#endif
  TORCH_CHECK(false, "actnn_zoo._C.quantize_lean: CUDA tensors only (a CUDA build), got one on ",
              x2d.device(), "; quantize is the same on every device");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, const at::Tensor& bits, const at::Tensor& offsets, int64_t total,
    int64_t group_size, int64_t seed, bool stochastic) {
  RECORD_USER_SCOPE("actnn_zoo::quantize");
  check_same_device(x2d, "x2d", {{&bits, "bits"}, {&offsets, "offsets"}});
  if (x2d.device().is_cpu()) {
    return actnn_zoo::quantize_affine_cpu(x2d, shift, scale, row_stride, block, bits, offsets,
                                          total, group_size, seed, stochastic);
  }
  TORCH_CHECK(false, "actnn_zoo._C.quantize_affine: CPU only (got a tensor on ", x2d.device(),
              "); quantize the mapped tensor instead");
}

at::Tensor dequantize(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                      const at::Tensor& bits, const at::Tensor& offsets, int64_t group_size,
                      at::Tensor out) {
  RECORD_USER_SCOPE("actnn_zoo::dequantize");
  check_same_device(out, "out", {{&data, "data"}, {&lo, "lo"}, {&step, "step"},
                                 {&bits, "bits"}, {&offsets, "offsets"}});
  if (out.device().is_cpu()) {
    return actnn_zoo::dequantize_cpu(data, lo, step, bits, offsets, group_size, out);
  }
#ifdef ACTNN_ZOO_CUDA
  if (out.is_cuda()) {
    check_cuda_rows("dequantize", out, "out", bits, offsets, group_size);
    check_cuda_codes("dequantize", out, data, lo, step, group_size);
    const c10::DeviceGuard guard(out.device());
    return actnn_zoo::dequantize_cuda(data, lo, step, bits, offsets, group_size, out);
  }
#endif
  no_kernel("dequantize", out);
}

// One width for every row, rows back to back: the (N,) widths and (N + 1,) byte offsets the
// general kernels read, made here rather than as two small tensors from Python on every call
// (offsets start at row `first`). The one-width entries below use it on CUDA only: the CPU
// kernels compute that layout themselves (quantize_uniform_cpu), without the two tensors.
std::pair<at::Tensor, at::Tensor> uniform_layout(int64_t n, int64_t d, int64_t bits,
                                                 int64_t first, const at::Device& device) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8,
                    "bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(n >= 0 && d >= 0 && first >= 0, "rows and columns must be non-negative");
  const int64_t rb = (d * bits + 7) / 8;
  const auto opts = at::TensorOptions().device(device);
  if (!device.is_cpu()) {  // two small device ops, no host-to-device copy
    return {at::full({n}, bits, opts.dtype(at::kByte)),
            rb > 0 ? at::arange(first * rb, (first + n + 1) * rb, rb, opts.dtype(at::kLong))
                   : at::zeros({n + 1}, opts.dtype(at::kLong))};
  }
  at::Tensor b = at::empty({n}, opts.dtype(at::kByte));
  at::Tensor off = at::empty({n + 1}, opts.dtype(at::kLong));
  std::fill_n(b.data_ptr<uint8_t>(), n, static_cast<uint8_t>(bits));
  int64_t* o = off.data_ptr<int64_t>();
  for (int64_t r = 0; r <= n; ++r) o[r] = (first + r) * rb;
  return {b, off};
}

// Byte offset of each row of mixed widths, (N + 1,) int64, as reference.row_offsets: one loop
// on the CPU, one kernel on CUDA (widths_cuda.cu), instead of seven small tensor ops per call (a
// Q-layer with per-sample widths pays it in every forward); those ops for other devices and
// widths of another dtype.
at::Tensor row_offsets(int64_t d, const at::Tensor& bits) {
  TORCH_CHECK_VALUE(bits.dim() == 1, "bits must be 1-d, got ", bits.dim(), " dims");
  TORCH_CHECK_VALUE(d >= 0, "d must be non-negative, got ", d);
#ifdef ACTNN_ZOO_CUDA
  if (bits.is_cuda() && bits.scalar_type() == at::kByte) {
    return actnn_zoo::row_offsets_cuda(d, bits);
  }
#endif
  if (!bits.is_cpu() || bits.scalar_type() != at::kByte) {
    auto sizes = bits.to(at::kLong).mul(d).add(7).div(8, "floor");
    return at::cat({at::zeros({1}, sizes.options()), at::cumsum(sizes, 0)});
  }
  const at::Tensor b = bits.contiguous();
  const int64_t n = b.size(0);
  at::Tensor out = at::empty({n + 1}, b.options().dtype(at::kLong));
  const uint8_t* w = b.data_ptr<uint8_t>();
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = 0;
  for (int64_t r = 0; r < n; ++r) o[r + 1] = o[r] + actnn_zoo::row_bytes(w[r], d);
  return out;
}

// x: any shape, contiguous, read as the contract's rows (the CPU kernel reads them without a
// view; elsewhere one is made for the general kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_uniform(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed, bool stochastic) {
  if (x.device().is_cpu()) {  // the layout is arithmetic in the CPU kernel: no tensors
    RECORD_USER_SCOPE("actnn_zoo::quantize");
    return actnn_zoo::quantize_uniform_cpu(x, bits, group_size, seed, stochastic);
  }
  const auto [n, d] = actnn_zoo::contract_rows(x.sizes());
  auto layout = uniform_layout(n, d, bits, 0, x.device());
  return quantize(x.view({n, d}), layout.first, layout.second, n * ((d * bits + 7) / 8),
                  group_size, seed, stochastic);
}

// quantize_affine with one width, the layout made here (as quantize_uniform): a norm's
// forward saves its normalized input through this once per call.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_affine_uniform(
    const at::Tensor& x2d, const at::Tensor& shift, const at::Tensor& scale, int64_t row_stride,
    int64_t block, int64_t bits, int64_t group_size, int64_t seed, bool stochastic) {
  TORCH_CHECK_VALUE(x2d.dim() == 2, "x2d must be 2-d, got ", x2d.dim(), " dims");
  if (x2d.device().is_cpu()) {
    RECORD_USER_SCOPE("actnn_zoo::quantize");
    return actnn_zoo::quantize_affine_uniform_cpu(x2d, shift, scale, row_stride, block, bits,
                                                  group_size, seed, stochastic);
  }
  const int64_t n = x2d.size(0), d = x2d.size(1);
  auto layout = uniform_layout(n, d, bits, 0, x2d.device());
  return quantize_affine(x2d, shift, scale, row_stride, block, layout.first, layout.second,
                         n * ((d * bits + 7) / 8), group_size, seed, stochastic);
}

// Per-sample widths as SampleBits promises them (CPU): every entry 1, 2, 4 or 8 and their sum
// at most max_sum, checked in the loop that makes the row offsets (row_offsets' result). One
// call where the checks took a bincount and a read-back per quantize.
at::Tensor sample_offsets(int64_t d, const at::Tensor& bits, int64_t max_sum) {
  TORCH_CHECK_VALUE(bits.dim() == 1 && bits.is_cpu() && bits.scalar_type() == at::kByte,
                    "bits must be a 1-d uint8 CPU tensor");
  TORCH_CHECK_VALUE(d >= 0, "d must be non-negative, got ", d);
  const at::Tensor b = bits.contiguous();
  const int64_t n = b.size(0);
  at::Tensor out = at::empty({n + 1}, b.options().dtype(at::kLong));
  const uint8_t* w = b.data_ptr<uint8_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t used = 0;
  o[0] = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t v = w[r];
    TORCH_CHECK_VALUE(v == 1 || v == 2 || v == 4 || v == 8,
                      "SampleBits.bits entries must be in (1, 2, 4, 8), got ", v);
    used += v;
    o[r + 1] = o[r] + (v * d + 7) / 8;
  }
  TORCH_CHECK_VALUE(used <= max_sum, "SampleBits.bits sums to ", used, ", more than max_sum=",
                    max_sum);
  return out;
}

// quantize of x2d (N, D) at per-sample widths that promise to sum to at most max_sum
// (quant.SampleBits) on the CPU: the row offsets made and checked as sample_offsets makes
// them, the buffer sized from max_sum, then the kernel. Returns (data, lo, step, offsets): one
// call where the layout took a Python frame and a call of its own per quantize.
//
// x: any shape, contiguous, read as the contract's rows (dim 0 the sample; 0-d and 1-d one row),
// as quantize_uniform's x: the layers pass their input as it is, with no (N, D) view made in
// Python -- which, on an input that requires a gradient, took a detach too.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_samples(
    const at::Tensor& x, const at::Tensor& bits, int64_t max_sum, int64_t group_size,
    int64_t seed, bool stochastic) {
  const auto [n, d] = actnn_zoo::contract_rows(x.sizes());
  TORCH_CHECK_VALUE(x.is_cpu() && x.is_contiguous() && bits.dim() == 1 && bits.size(0) == n,
                    "quantize_samples: x must be a contiguous CPU tensor with one width per "
                    "row, got shape ", x.sizes(), " and ", bits.sizes(), " widths");
  at::Tensor x2d;
  {
    const at::NoGradGuard no_grad;  // the row view is for the kernel, not the graph
    x2d = x.view({n, d});
  }
  at::Tensor offsets = sample_offsets(d, bits, max_sum);
  auto [data, lo, step] = actnn_zoo::quantize_cpu(x2d, bits.contiguous(), offsets,
                                                  (d * max_sum + 7 * n) / 8, group_size, seed,
                                                  stochastic);
  return {data, lo, step, offsets};
}

// out: any shape, contiguous, its rows the contract's (as quantize_uniform's x).
at::Tensor dequantize_uniform(const at::Tensor& data, const at::Tensor& lo,
                              const at::Tensor& step, int64_t bits, int64_t group_size,
                              int64_t first, at::Tensor out) {
  const auto [n, d] = actnn_zoo::contract_rows(out.sizes());
  TORCH_CHECK_VALUE(first >= 0 && lo.dim() == 2 && first + n <= lo.size(0) &&
                    step.dim() == 2 && first + n <= step.size(0),
                    "rows ", first, ":", first + n, " are not rows of lo/step ", lo.sizes());
  if (out.device().is_cpu()) {  // no layout tensors, no narrowed views (see quantize_uniform)
    RECORD_USER_SCOPE("actnn_zoo::dequantize");
    check_same_device(out, "out", {{&data, "data"}, {&lo, "lo"}, {&step, "step"}});
    return actnn_zoo::dequantize_uniform_cpu(data, lo, step, bits, group_size, first, out);
  }
  auto layout = uniform_layout(n, d, bits, first, out.device());
  dequantize(data, lo.narrow(0, first, n), step.narrow(0, first, n), layout.first,
             layout.second, group_size, out.view({n, d}));
  return out;
}

at::Tensor pack_mask(const at::Tensor& mask) {
  RECORD_USER_SCOPE("actnn_zoo::pack_mask");
  if (mask.device().is_cpu()) return actnn_zoo::pack_mask_cpu(mask);
#ifdef ACTNN_ZOO_CUDA
  if (mask.is_cuda()) {
    const c10::DeviceGuard guard(mask.device());
    return actnn_zoo::pack_mask_cuda(mask);
  }
#endif
  no_kernel("pack_mask", mask);
}

at::Tensor unpack_mask(const at::Tensor& packed, int64_t numel) {
  RECORD_USER_SCOPE("actnn_zoo::unpack_mask");
  if (packed.device().is_cpu()) return actnn_zoo::unpack_mask_cpu(packed, numel);
#ifdef ACTNN_ZOO_CUDA
  if (packed.is_cuda()) {
    const c10::DeviceGuard guard(packed.device());
    return actnn_zoo::unpack_mask_cuda(packed, numel);
  }
#endif
  no_kernel("unpack_mask", packed);
}

at::Tensor masked_grad(const at::Tensor& grad, const at::Tensor& packed,
                       std::optional<double> on, std::optional<double> off) {
  RECORD_USER_SCOPE("actnn_zoo::masked_grad");
  check_same_device(grad, "grad", {{&packed, "packed"}});
  if (grad.device().is_cpu()) return actnn_zoo::masked_grad_cpu(grad, packed, on, off);
#ifdef ACTNN_ZOO_CUDA
  if (grad.is_cuda()) {
    const c10::DeviceGuard guard(grad.device());
    return actnn_zoo::masked_grad_cuda(grad, packed, on, off);
  }
#endif
  no_kernel("masked_grad", grad);
}

at::Tensor range_statistic(const at::Tensor& x2d, int64_t group_size) {
  RECORD_USER_SCOPE("actnn_zoo::range_statistic");
#ifdef ACTNN_ZOO_CUDA
  if (x2d.is_cuda()) {  // the checks here, in host code (quant_cuda.cu says why)
    TORCH_CHECK_VALUE(x2d.dim() == 2 && x2d.is_contiguous(),
                      "range_statistic: x2d must be 2-d and contiguous, got shape ", x2d.sizes());
    TORCH_CHECK_VALUE(group_size > 0, "group_size must be positive, got ", group_size);
    TORCH_CHECK(x2d.scalar_type() == at::kFloat || x2d.scalar_type() == at::kHalf ||
                    x2d.scalar_type() == at::kBFloat16,
                "x must be float32, float16 or bfloat16, got ", x2d.scalar_type());
    return actnn_zoo::range_statistic_cuda(x2d, group_size);
  }
#endif
  return actnn_zoo::range_statistic_cpu(x2d, group_size);
}

at::Tensor allocate_widths(const at::Tensor& score, double extra) {
  RECORD_USER_SCOPE("actnn_zoo::allocate_widths");
#ifdef ACTNN_ZOO_CUDA
  if (score.is_cuda()) {  // the checks here, in host code (quant_cuda.cu says why)
    TORCH_CHECK(score.scalar_type() == at::kFloat && score.dim() == 1 && score.is_contiguous(),
                "score must be a contiguous 1-d float32 tensor");
    TORCH_CHECK_VALUE(score.size(0) <= std::numeric_limits<int32_t>::max() / 3,
                      "allocate_widths: at most 2^31 / 3 items on CUDA, got ", score.size(0));
    return actnn_zoo::allocate_widths_cuda(score, extra);
  }
#endif
  return actnn_zoo::allocate_widths_cpu(score, extra);
}

// One training forward's per-sample widths of a watched layer (precision/actnn.py, _choose):
// range_statistic of x's rows (the contract's: dim 0 the sample), raised to `exponent` when
// given (a 0-d float32 tensor: torch's pow, as score.pow(exponent)), then allocate_widths.
// Returns (score, widths): one call for three (each a pybind crossing and a Python frame on a
// path that runs per layer per step), x read as it is through its pointer. Two operator calls
// in all besides the pow (the two outputs' allocations): no row view, no zero or one fills.
std::tuple<at::Tensor, at::Tensor> choose_widths(const at::Tensor& x, int64_t group_size,
                                                 const std::optional<at::Tensor>& exponent,
                                                 double extra) {
  RECORD_USER_SCOPE("actnn_zoo::choose_widths");
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.is_contiguous(),
                    "choose_widths: x must be contiguous with a sample dim, got shape ",
                    x.sizes());
  const auto [n, d] = actnn_zoo::contract_rows(x.sizes());
  at::Tensor score = at::empty({n}, x.options().dtype(at::kFloat));
  actnn_zoo::range_statistic_rows_cpu(x, n, d, group_size, score.data_ptr<float>());
  if (!exponent.has_value()) return {score, actnn_zoo::allocate_widths_cpu(score, extra)};
  at::Tensor expected;
  {
    const at::NoGradGuard no_grad;  // an exponent that requires grad records nothing here
    expected = score.pow(*exponent);
  }
  TORCH_CHECK_VALUE(expected.scalar_type() == at::kFloat,
                    "exponent must leave the float32 scores float32, got ", expected.scalar_type());
  return {score, actnn_zoo::allocate_widths_cpu(expected.contiguous(), extra)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "actnn_zoo compiled kernels: per-group stochastic quantization and mask packing "
            "(the compiled twins of actnn_zoo.quant.reference)";
  // Kernels do not touch Python objects: let other Python threads run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quantize", &quantize, nogil, py::arg("x2d"), py::arg("bits"), py::arg("offsets"),
        py::arg("total"), py::arg("group_size"), py::arg("seed"), py::arg("stochastic"),
        "(N, D) contiguous float32/float16/bfloat16 -> (packed uint8 data [total], lo bf16 "
        "(N, G), step bf16 (N, G)); bits (N,) uint8, offsets (N + 1,) int64.");
  m.def("quantize_lean", &quantize_lean, nogil, py::arg("x2d"), py::arg("bits"),
        py::arg("offsets"), py::arg("total"), py::arg("group_size"), py::arg("seed"),
        py::arg("stochastic"),
        "quantize on CUDA through the lean kernel where it applies (one warp per group, "
        "16-byte aligned rows): the same results, fewer instructions. Not yet the default.");
  m.def("quantize_affine", &quantize_affine, nogil, py::arg("x2d"), py::arg("shift"),
        py::arg("scale"), py::arg("row_stride"), py::arg("block"), py::arg("bits"),
        py::arg("offsets"), py::arg("total"), py::arg("group_size"), py::arg("seed"),
        py::arg("stochastic"),
        "quantize of (x2d - shift[i]) * scale[i] (float32), i = n * row_stride + p / block at "
        "position p of row n, without making it: the codes quantize gives that tensor. CPU "
        "only.");
  m.def("dequantize", &dequantize, nogil, py::arg("data"), py::arg("lo"), py::arg("step"),
        py::arg("bits"), py::arg("offsets"), py::arg("group_size"), py::arg("out"),
        "Writes lo + q * step (float32 arithmetic) into out (N, D), contiguous, and returns it.");
  m.def("row_offsets", &row_offsets, nogil, py::arg("d"), py::arg("bits"),
        "(N + 1,) int64 byte offsets of rows of d codes at widths bits (N,), the last entry the "
        "total: what reference.row_offsets computes.");
  m.def("quantize_affine_uniform", &quantize_affine_uniform, nogil, py::arg("x2d"),
        py::arg("shift"), py::arg("scale"), py::arg("row_stride"), py::arg("block"),
        py::arg("bits"), py::arg("group_size"), py::arg("seed"), py::arg("stochastic"),
        "quantize_affine with one width for every row, rows back to back (the layout of "
        "quantize_uniform, made here). CPU only.");
  m.def("uniform_layout", [](int64_t n, int64_t d, int64_t bits) {
          return uniform_layout(n, d, bits, 0, at::Device(at::kCPU));
        }, nogil, py::arg("n"), py::arg("d"), py::arg("bits"),
        "CPU: (widths uint8 (n,), row byte offsets int64 (n + 1,)) of n rows of d codes at one "
        "width, rows back to back: the layout quantize_uniform makes for itself.");
  m.def("sample_offsets", &sample_offsets, nogil, py::arg("d"), py::arg("bits"),
        py::arg("max_sum"),
        "CPU: row_offsets of per-sample widths, raising ValueError unless every width is 1, 2, "
        "4 or 8 and they sum to at most max_sum (the promises of quant.SampleBits).");
  m.def("quantize_samples", &quantize_samples, nogil, py::arg("x"), py::arg("bits"),
        py::arg("max_sum"), py::arg("group_size"), py::arg("seed"), py::arg("stochastic"),
        "CPU: quantize at per-sample widths bits (N,) uint8 that sum to at most max_sum "
        "(checked as sample_offsets checks them; the buffer holds (D * max_sum + 7 N) / 8 "
        "bytes): (data, lo, step, row offsets).");
  m.def("quantize_uniform", &quantize_uniform, nogil, py::arg("x2d"), py::arg("bits"),
        py::arg("group_size"), py::arg("seed"), py::arg("stochastic"),
        "quantize with one width (1, 2, 4 or 8) for every row, rows back to back (total = "
        "N * ceil(D * bits / 8) bytes); the widths and offsets are made here.");
  m.def("dequantize_uniform", &dequantize_uniform, nogil, py::arg("data"), py::arg("lo"),
        py::arg("step"), py::arg("bits"), py::arg("group_size"), py::arg("first"),
        py::arg("out"),
        "dequantize rows first:first + out.size(0) of a one-width QuantizedTensor's codes "
        "(data whole, lo/step of every row) into out.");
  m.def("pack_mask", &pack_mask, nogil, py::arg("mask"),
        "Contiguous bool tensor -> ceil(n / 8) uint8, element i at bit i % 8 of byte i // 8.");
  m.def("unpack_mask", &unpack_mask, nogil, py::arg("packed"), py::arg("numel"),
        "Inverse of pack_mask: a 1-d bool tensor of numel values.");
  m.def("masked_grad", &masked_grad, nogil, py::arg("grad"), py::arg("packed"),
        py::arg("on") = py::none(), py::arg("off") = py::none(),
        "Fused backward of a 1-bit mask: contiguous grad (float32/float64/float16/bfloat16) and "
        "its pack_mask bits -> contiguous grad_in; where the bit is set grad (on=None) or "
        "grad * on, elsewhere +0.0 (off=None) or grad * off, bit-identical to torch.where.");
  m.def("range_statistic", &range_statistic, nogil, py::arg("x2d"),
        py::arg("group_size"),
        "(N,) float32, per row the sum over its groups of len * (max - min)^2; a group holding "
        "NaN or Inf counts 0. CPU, and CUDA in a CUDA build (the same values).");
  m.def("allocate_widths", &allocate_widths, nogil, py::arg("score"),
        py::arg("extra"),
        "uint8 widths in {1, 2, 4, 8} minimising sum score / (2^b - 1)^2 with at most `extra` "
        "bits above 1 each (precision.solver.allocate_samples); CPU, and CUDA in a CUDA build.");
  m.def("choose_widths", &choose_widths, nogil, py::arg("x"), py::arg("group_size"),
        py::arg("exponent"), py::arg("extra"),
        "CPU only: (range_statistic of x's rows, allocate_widths(that ** exponent, extra)) for "
        "contiguous x with a sample dim; exponent a 0-d float32 tensor or None (1).");
  actnn_zoo::register_hadamard(m);
  actnn_zoo::register_division(m);  // division_quantize, division_dequantize
  actnn_zoo::register_pack_compare(m);
  actnn_zoo::register_sparse(m);  // quantize_sparse, dequantize_sparse (CPU)
  actnn_zoo::register_norm(m);  // batch_norm_backward_codes (CPU)
  actnn_zoo::register_variance(m);  // rounding_variance_codes / _correct_, draw_sample (CPU)
  actnn_zoo::register_attention_dropout(m);  // attention_keep (CPU)
  actnn_zoo::register_qlayers(m);  // qlinear, qconv: the C++ autograd nodes of the layers
  actnn_zoo::register_stacks(m);  // saved_hooks_top_is, innermost_function_mode
  actnn_zoo::register_loss(m);  // cross_entropy_rows_forward / _backward (CPU)
  m.def(
      "env_flag",
      [](const std::string& name) {
        // quant.api.env_flag's rule: the value with surrounding ASCII whitespace dropped,
        // ASCII case ignored, is 1, true, yes or on. Read at every call (getenv sees what
        // os.environ sets: it calls putenv): ~0.1 us where os.environ.get costs ~0.7 when
        // unset (a KeyError inside), and quantize asks at every call.
        const char* raw = std::getenv(name.c_str());
        if (raw == nullptr) return false;
        std::string v(raw);
        const char* space = " \t\n\r\v\f";
        const auto first = v.find_first_not_of(space);
        if (first == std::string::npos) return false;
        v = v.substr(first, v.find_last_not_of(space) - first + 1);
        for (char& c : v) {
          if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
        }
        return v == "1" || v == "true" || v == "yes" || v == "on";
      },
      py::arg("name"),
      "Whether the environment variable name is set to 1/true/yes/on (ASCII case and "
      "surrounding ASCII whitespace ignored), read now.");
  m.def("cpu_isa", &actnn_zoo::cpu_isa,
        "The instruction set the CPU kernels' loops run with: 'avx2' or 'baseline' (portable "
        "build, chosen at the first call from the CPU and ACTNN_ZOO_CPU_ISA), 'native'.");
  // The torch.library operators below are defined by this library's load (quant/ops.py asks).
  m.attr("has_torch_ops") = py::bool_(true);
#ifdef ACTNN_ZOO_CUDA
  m.attr("has_cuda") = py::bool_(true);
#else
  m.attr("has_cuda") = py::bool_(false);
#endif
}

// ---------------------------------------------------------------------------------------------
// The same kernels as torch.library operators (actnn_zoo::quantize_uniform, ...), for graphs
// that torch.compile traces (actnn_zoo/quant/ops.py adds their fake kernels and, for devices
// this build has no kernel for, the reference implementation). Registered here, in C++, because
// an operator implemented in Python pays the dispatcher's trip back into the interpreter and a
// Python frame on every call: ~15 us per call on a tiny tensor against ~3 us for the kernel,
// and a compiled step makes two calls per saved tensor. Each checks its arguments as the
// Python twins did (same messages), then calls the functions the pybind bindings call.
namespace {

void check_width(const char* op, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8, "actnn_zoo::", op,
                    ": bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0, "actnn_zoo::", op,
                    ": group_size must be a positive multiple of 8, got ", group_size);
}

// A 31-bit seed from torch's default CPU generator (reproducible under torch.manual_seed), read
// without a tensor op or a device sync.
int64_t generator_seed() {
  auto gen = at::globalContext().defaultGenerator(c10::DeviceType::CPU);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return static_cast<int64_t>(at::check_generator<at::CPUGeneratorImpl>(gen)->random() &
                              0x7FFFFFFFu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_uniform_op(
    const at::Tensor& x, const std::optional<at::Tensor>& seed, int64_t bits,
    int64_t group_size, bool stochastic) {
  check_width("quantize_uniform", bits, group_size);
  TORCH_CHECK_VALUE(x.is_contiguous(), "actnn_zoo::quantize_uniform needs a contiguous tensor");
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "actnn_zoo::quantize_uniform: float32/16 or bfloat16, got ", dt);
  TORCH_CHECK_VALUE(!seed.has_value() || seed->numel() >= 1,
                    "actnn_zoo::quantize_uniform: seed must hold a value");
  const auto [n, d] = actnn_zoo::contract_rows(x.sizes());
  if (n * d == 0) {
    at::Tensor lo = at::empty({n, (d + group_size - 1) / group_size},
                              x.options().dtype(at::kBFloat16));
    return {at::empty({0}, x.options().dtype(at::kByte)), lo, at::empty_like(lo)};
  }
  // None: drawn here, one generator read per call (what a compiled graph passes: no
  // torch.randint node per saved tensor). A given seed is read as a host scalar.
  const int64_t s = seed.has_value() ? seed->reshape({-1})[0].item<int64_t>() & 0xFFFFFFFFLL
                                     : generator_seed();
  return quantize_uniform(x, bits, group_size, s, stochastic);
}

at::Tensor dequantize_uniform_op(const at::Tensor& data, const at::Tensor& lo,
                                 const at::Tensor& step, at::IntArrayRef shape, int64_t bits,
                                 int64_t group_size, at::ScalarType dtype) {
  check_width("dequantize_uniform", bits, group_size);
  at::Tensor out = at::empty(shape, data.options().dtype(dtype));
  if (out.numel() == 0) return out;
  dequantize_uniform(data, lo, step, bits, group_size, 0, out);
  return out;
}

at::Tensor pack_mask_op(const at::Tensor& mask) {
  const at::Tensor flat = mask.reshape({-1}).contiguous();
  if (flat.numel() == 0) return at::empty({0}, mask.options().dtype(at::kByte));
  return pack_mask(flat);
}

at::Tensor unpack_mask_op(const at::Tensor& packed, at::IntArrayRef shape) {
  int64_t numel = 1;
  for (const int64_t s : shape) numel *= s;
  TORCH_CHECK_VALUE(packed.numel() == (numel + 7) / 8, "actnn_zoo::unpack_mask: ",
                    packed.numel(), " bytes do not hold ", numel, " values");
  if (numel == 0) return at::empty(shape, packed.options().dtype(at::kBool));
  return unpack_mask(packed.contiguous(), numel).view(shape);
}

}  // namespace

namespace actnn_zoo {
// The actnn_zoo::dequantize_uniform operator's CPU/CUDA kernel without the dispatcher, same
// checks, same result: the compiled nodes' backward (qlayers.cpp) decodes one-width codes
// through it. Why: the operator call adds ~3 us of host work (the autograd fallback, which
// boxes its arguments, and the SymInt shape) to a ~1.6 us decode of a tiny tensor.
at::Tensor dequantize_uniform_whole(const at::Tensor& data, const at::Tensor& lo,
                                    const at::Tensor& step, at::IntArrayRef shape, int64_t bits,
                                    int64_t group_size, at::ScalarType dtype) {
  return dequantize_uniform_op(data, lo, step, shape, bits, group_size, dtype);
}
}  // namespace actnn_zoo

// A fragment: actnn_zoo/quant/ops.py adds the fake kernels and the fallback to the namespace.
// When ops.py defined the schemas first (the reference backend, ACTNN_ZOO_BACKEND=reference,
// then something imported this module), they are not defined twice: a second definition
// would fail this library's import; the kernels below still register for them.
TORCH_LIBRARY_FRAGMENT(actnn_zoo, m) {
  if (c10::Dispatcher::singleton().findSchema({"actnn_zoo::quantize_uniform", ""}).has_value()) {
    return;
  }
  // nondeterministic_seeded: with no seed it draws one, so compilers must not merge or replay it.
  const char* quantize_schema =
      "quantize_uniform(Tensor x, Tensor? seed, int bits, int group_size, bool stochastic) "
      "-> (Tensor, Tensor, Tensor)";
  const std::vector<at::Tag> seeded{at::Tag::nondeterministic_seeded};
  m.def(quantize_schema, seeded);
  m.def("dequantize_uniform(Tensor data, Tensor lo, Tensor step, SymInt[] shape, int bits, "
        "int group_size, ScalarType dtype) -> Tensor");
  m.def("pack_mask(Tensor mask) -> Tensor");
  m.def("unpack_mask(Tensor packed, SymInt[] shape) -> Tensor");
}

TORCH_LIBRARY_IMPL(actnn_zoo, CPU, m) {
  m.impl("quantize_uniform", &quantize_uniform_op);
  m.impl("dequantize_uniform", &dequantize_uniform_op);
  m.impl("pack_mask", &pack_mask_op);
  m.impl("unpack_mask", &unpack_mask_op);
}

#ifdef ACTNN_ZOO_CUDA
TORCH_LIBRARY_IMPL(actnn_zoo, CUDA, m) {
  m.impl("quantize_uniform", &quantize_uniform_op);
  m.impl("dequantize_uniform", &dequantize_uniform_op);
  m.impl("pack_mask", &pack_mask_op);
  m.impl("unpack_mask", &unpack_mask_op);
}
#endif
