// QLinear's autograd node in C++: the forward is torch's linear, the backward decodes the saved
// input codes and makes the three gradients, with no Python on the way.
//
// Why: a Python autograd Function costs the host ~50-70 us per call on top of its ops (apply,
// ctx, the saved-tensor bookkeeping, the Python backward node and its glue), as much as the
// layer's own work at small sizes, where a GPU step is host-bound (docs/design.md, "Host
// cost"). actnn_zoo/functional/linear.py takes this path in the common case -- one width, the
// plain quantizer, no autocast, one dtype, the input decoded whole -- and its Python Function
// otherwise; both compute the same gradients from the same codes.
//
// The codes are made in Python (the capture store may answer from its cache) and saved here
// with the weight through ctx->save_for_backward, so saved-tensor hooks see them as they see
// the Python Function's saves, and the weight keeps autograd's in-place check.
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include <optional>

namespace actnn_zoo {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The decoded input (the actnn_zoo::dequantize_uniform operator: CPU or CUDA kernel).
at::Tensor decode(const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                  at::IntArrayRef shape, int64_t bits, int64_t group_size, at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("actnn_zoo::dequantize_uniform", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, c10::SymIntArrayRef, int64_t,
                                               int64_t, at::ScalarType)>();
  return op.call(data, lo, step, c10::fromIntArrayRefSlow(shape), bits, group_size, dtype);
}

// Identity on a weight gradient made inside a create_graph backward: its derivative in the
// layer input would need the uncompressed input, so differentiating it raises (as the Python
// Function's _SecondOrderGuard does).
struct SecondOrderGuard : public torch::autograd::Function<SecondOrderGuard> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& anchor) {
    return value.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false,
        "actnn_zoo: differentiating the QLinear weight gradient again (double backward) is not "
        "supported: its derivative with respect to the layer input needs the uncompressed "
        "input, which is not kept. Use the torch layer (to_float()) or set qconfig "
        "enabled=False for this layer.");
  }
};

struct QLinearFunction : public torch::autograd::Function<QLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& data,
                            const at::Tensor& lo, const at::Tensor& step, int64_t bits,
                            int64_t group_size) {
    RECORD_USER_SCOPE("actnn_zoo::qlinear");
    at::Tensor out = at::linear(x, weight, bias);
    ctx->save_for_backward({data, lo, step, weight});
    ctx->saved_data["shape"] = x.sizes();
    ctx->saved_data["dtype"] = x.scalar_type();
    ctx->saved_data["bits"] = bits;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["x_grad"] = x.requires_grad();  // (needs_input_grad is per backward call)
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qlinear_backward");
    const bool has_bias = ctx->saved_data["bias"].toBool();
    // next edges: x, weight, [bias,] data, lo, step
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = has_bias && ctx->needs_input_grad(2);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[3];
    const at::Tensor& g = grads[0];
    const at::Tensor g2 = g.reshape({-1, g.size(-1)});
    at::Tensor gx, gw, gb;
    if (need_w) {  // first: the decoded input is freed before the input gradient exists
      const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
      at::Tensor x = decode(saved[0], saved[1], saved[2], shape, ctx->saved_data["bits"].toInt(),
                            ctx->saved_data["group_size"].toInt(),
                            ctx->saved_data["dtype"].toScalarType());
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});
      // A weight given as the transpose of a contiguous (in, out) Parameter (GPT-2's Conv1D)
      // gets its gradient in that layout, (x^T g)^T, not as a transposed copy.
      const bool by_rows = weight.dim() == 2 && weight.stride(0) == 1 && weight.size(1) > 1 &&
                           weight.stride(1) == weight.size(0);
      gw = by_rows ? x2.t().matmul(g2).t() : g2.t().matmul(x2);
      // create_graph: gw's derivative in x is lost with x, so differentiating gw raises
      if (ctx->saved_data["x_grad"].toBool() && at::GradMode::is_enabled()) {
        gw = SecondOrderGuard::apply(gw, weight);
      }
    }
    if (need_x) gx = g.matmul(weight);
    if (need_b) gb = g2.sum(0);
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, const at::Tensor& data,
                   const at::Tensor& lo, const at::Tensor& step, int64_t bits,
                   int64_t group_size) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
                    "qlinear: x ", x.sizes(), " does not fit weight ", weight.sizes());
  TORCH_CHECK_VALUE(lo.dim() == 2 && step.sizes() == lo.sizes(),
                    "qlinear: lo and step must be (rows, groups) alike, got ", lo.sizes(), " and ",
                    step.sizes());
  return QLinearFunction::apply(x, weight, bias, data, lo, step, bits, group_size);
}

}  // namespace

void register_qlinear(pybind11::module_& m) {
  m.def("qlinear", &qlinear, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("data"), pybind11::arg("lo"),
        pybind11::arg("step"), pybind11::arg("bits"), pybind11::arg("group_size"),
        "y = linear(x, weight, bias) whose backward decodes x from its one-width codes "
        "(data, lo, step: quantize_uniform of x at bits and group_size) for the weight "
        "gradient; the input and bias gradients are exact.");
}

}  // namespace actnn_zoo
