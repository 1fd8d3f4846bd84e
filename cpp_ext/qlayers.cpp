// The autograd nodes of QLinear, QConv, QDropout, the activations, attention and the norms in
// C++: the forward is torch's op (attention's and the norms': the fused CPU calls), the
// backward decodes what was saved and makes the gradients, with no Python on the way.
//
// Why: a Python autograd Function costs the host tens of microseconds per call on top of its
// ops (apply, ctx, the saved-tensor bookkeeping, the Python backward node and its glue), as
// much as the layer's own work at small sizes, where a GPU step is host-bound (docs/design.md,
// "Host cost"). actnn_zoo/functional/linear.py, conv.py, dropout.py and activation.py take
// these nodes in the common case -- the plain quantizer (one width, per-sample widths or a
// ReLU output's sparse codes), one dtype, no autocast, the input decoded whole; for conv a
// plain (not transposed) convolution with numeric zero padding; for dropout elementwise, out
// of place, contiguous; for a mask activation contiguous and not sharing its mask with the
// next layer's codes; for a smooth one out of place, contiguous, one that does not read its
// output in backward; attention and the norms where their fused CPU calls apply -- and their
// Python Functions otherwise. Both compute the same outputs and gradients
// (tests/test_qlayer_nodes.py compares them bit for bit).
//
// The codes (dropout: the noise and its keep bits; an activation: those of f'(x)) are made in
// Python, where the capture store may answer from its cache, and saved here (with the weight)
// through ctx->save_for_backward: saved-tensor hooks see them as they see the Python
// Functions' saves, and the weight keeps autograd's in-place check -- except the capture
// store's own hooks when they are innermost (OwnSaves below).
#include "kernels.h"
#include "stacks.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace actnn_zoo {

// bindings.cpp: the actnn_zoo::dequantize_uniform operator's kernel without the dispatcher
at::Tensor dequantize_uniform_whole(const at::Tensor& data, const at::Tensor& lo,
                                    const at::Tensor& step, at::IntArrayRef shape, int64_t bits,
                                    int64_t group_size, at::ScalarType dtype);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// Backward computes in the forward's dtype whatever autocast state the caller's thread has
// (the Python Functions' no_autocast).
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

// A node's scalars (widths, dtypes, shapes, flags) as one int list under one saved_data key,
// written in forward and read back in order in backward. Why: saved_data is a string-keyed
// hash map; ~10 lookups a backward call and a vector copy per shape (toIntVector) were ~1 us
// of a tiny layer's backward (and as much again in its forward). An int list rather than a
// capsule of a C++ struct, because compiled autograd hashes saved_data.
const std::string kMeta = "meta";

// A shape read back: on the stack for up to 6 dims (no allocation).
using Shape = c10::SmallVector<int64_t, 6>;

class MetaWriter {
 public:
  void add(int64_t v) { list_.push_back(v); }
  void add(at::IntArrayRef values) {  // its length first
    list_.push_back(static_cast<int64_t>(values.size()));
    for (const int64_t v : values) list_.push_back(v);
  }
  void save(AutogradContext* ctx) { ctx->saved_data[kMeta] = std::move(list_); }

 private:
  c10::List<int64_t> list_;
};

class MetaReader {
 public:
  explicit MetaReader(AutogradContext* ctx) : list_(ctx->saved_data[kMeta].toListRef()) {}
  int64_t next() { return list_[at_++].toInt(); }
  bool flag() { return next() != 0; }
  at::ScalarType dtype() { return static_cast<at::ScalarType>(next()); }
  Shape shape() {  // as MetaWriter::add(IntArrayRef) wrote it
    Shape out(static_cast<size_t>(next()));
    for (int64_t& v : out) v = next();
    return out;
  }

 private:
  c10::ArrayRef<c10::IValue> list_;  // the map's entry, alive as long as the node
  size_t at_ = 0;
};

// What decode needs of a payload, and save_codes' flags: meta's first entries, in this order.
struct Codes {
  int64_t kind;  // 0 one width, 1 per-sample widths, 2 sparse codes
  at::ScalarType dtype;
  int64_t bits, group_size;
  bool x_grad;  // the input required a gradient (needs_input_grad is per backward call)
  bool bias;
  Shape shape;
};

void write_codes(MetaWriter& meta, int64_t kind, at::ScalarType dtype, int64_t bits,
                 int64_t group_size, bool x_grad, bool bias, at::IntArrayRef shape) {
  meta.add(kind);
  meta.add(static_cast<int64_t>(dtype));
  meta.add(bits);
  meta.add(group_size);
  meta.add(x_grad);
  meta.add(bias);
  meta.add(shape);
}

Codes read_codes(MetaReader& meta) {
  Codes c;
  c.kind = meta.next();
  c.dtype = meta.dtype();
  c.bits = meta.next();
  c.group_size = meta.next();
  c.x_grad = meta.flag();
  c.bias = meta.flag();
  c.shape = meta.shape();
  return c;
}

// What forward saves of the input's codes: data, lo, step, weight [, row widths, row offsets
// [, the nonzeros' mask]] through save_for_backward, the rest in `meta` (Codes), which the
// caller saves. Three payloads: one width (data, lo, step), per-sample widths (+ row_bits,
// offsets), sparse codes of a ReLU output (+ row_bits, offsets, mask: quant.quantize_sparse,
// CPU only).
void save_codes(AutogradContext* ctx, MetaWriter& meta, const at::Tensor& x,
                const at::Tensor& weight, const OptTensor& bias, const at::Tensor& data,
                const at::Tensor& lo, const at::Tensor& step, const OptTensor& row_bits,
                const OptTensor& offsets, const OptTensor& mask, int64_t bits,
                int64_t group_size) {
  auto given = [](const OptTensor& t) { return t.has_value() && t->defined(); };
  const bool mixed = given(row_bits), sparse = given(mask);
  TORCH_CHECK_VALUE(mixed == given(offsets) && (mixed || !sparse),
                    "row_bits and offsets come together (per-sample widths), and sparse codes "
                    "(mask) have both");
  if (sparse) {
    ctx->save_for_backward({data, lo, step, weight, *row_bits, *offsets, *mask});
  } else if (mixed) {
    ctx->save_for_backward({data, lo, step, weight, *row_bits, *offsets});
  } else {
    ctx->save_for_backward({data, lo, step, weight});
  }
  write_codes(meta, sparse ? 2 : mixed ? 1 : 0, x.scalar_type(), bits, group_size,
              x.requires_grad(), given(bias), x.sizes());
}

// Which of (input, weight, bias) this backward call must give (the next edges: x, weight,
// [bias,] then the codes, which take no gradient).
struct Needed {
  bool x, w, b;
};

Needed needed(AutogradContext* ctx, const Codes& codes) {
  return {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
          codes.bias && ctx->needs_input_grad(2)};
}

// A payload decoded: the actnn_zoo::dequantize_uniform operator's kernel for one width (kind
// 0; called directly, see dequantize_uniform_whole), the general (1) or the sparse (2) kernel
// with the saved row widths and offsets. `first`: where its codes start in `saved` (data, lo,
// step); `extra`: where row_bits, offsets [and mask] start.
at::Tensor decode_payload(const variable_list& saved, size_t first, size_t extra, int64_t kind,
                          at::IntArrayRef shape, at::ScalarType dtype, int64_t bits,
                          int64_t group_size) {
  if (kind == 0) {
    return dequantize_uniform_whole(saved[first], saved[first + 1], saved[first + 2], shape,
                                    bits, group_size, dtype);
  }
  const at::Tensor& data = saved[first];
  const at::Tensor& lo = saved[first + 1];
  const at::Tensor& step = saved[first + 2];
  const at::Tensor& row_bits = saved[extra];
  const at::Tensor& offsets = saved[extra + 1];
  at::Tensor out = at::empty(shape, data.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const auto [n, d] = contract_rows(out.sizes());
  at::Tensor rows = out.view({n, d});
  if (kind == 2) {
    dequantize_sparse_cpu(data, lo, step, saved[extra + 2], row_bits, offsets, group_size, rows);
    return out;
  }
  if (out.device().is_cpu()) {
    dequantize_cpu(data, lo, step, row_bits, offsets, group_size, rows);
    return out;
  }
#ifdef ACTNN_ZOO_CUDA
  if (out.is_cuda()) {
    const c10::DeviceGuard guard(out.device());
    dequantize_cuda(data, lo, step, row_bits, offsets, group_size, rows);
    return out;
  }
#endif
  TORCH_CHECK(false, "actnn_zoo: no dequantize kernel for tensors on ", out.device());
  return out;
}

// The decoded input of a node that saved one payload (save_codes' layout).
at::Tensor decode(const Codes& codes, const variable_list& saved, size_t first = 0,
                  size_t extra = 4) {
  return decode_payload(saved, first, extra, codes.kind, codes.shape, codes.dtype, codes.bits,
                        codes.group_size);
}

// Raise in a backward that builds a graph (create_graph=True) for a node whose saves give no
// second derivative (the Python Functions' no_double_backward message).
void no_second_derivative(const std::string& what) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !at::GradMode::is_enabled(), "actnn_zoo: double backward (create_graph=True) through "
      "compressed ", what, " is not supported: its second derivative is not saved. Use the "
      "torch layer (to_float()) or disable quantization for it (qconfig.enabled=False).");
}

// Identity on a weight gradient made inside a create_graph backward when the input required a
// gradient: its derivative in the input would need the uncompressed input, so differentiating
// it raises (as the Python Functions' _SecondOrderGuard does).
struct SecondOrderGuard : public torch::autograd::Function<SecondOrderGuard> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& anchor, const std::string& layer) {
    ctx->saved_data["layer"] = layer;
    return value.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "actnn_zoo: differentiating the ", ctx->saved_data["layer"].toStringRef(),
        " weight gradient again (double backward) is not supported: its derivative with "
        "respect to the layer input needs the uncompressed input, which is not kept. Use the "
        "torch layer (to_float()) or set qconfig enabled=False for this layer.");
    return {};
  }
};

at::Tensor guard_second_order(const Codes& codes, at::Tensor gw, const at::Tensor& weight,
                              const char* layer) {
  if (gw.defined() && codes.x_grad && at::GradMode::is_enabled()) {
    return SecondOrderGuard::apply(gw, weight, std::string(layer));
  }
  return gw;
}

// -- Linear ---------------------------------------------------------------------------------
struct QLinearFunction : public torch::autograd::Function<QLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const at::Tensor& data, const at::Tensor& lo,
                            const at::Tensor& step, const OptTensor& row_bits,
                            const OptTensor& offsets, const OptTensor& mask, int64_t bits,
                            int64_t group_size) {
    RECORD_USER_SCOPE("actnn_zoo::qlinear");
    at::Tensor out = at::linear(x, weight, bias);
    MetaWriter meta;
    save_codes(ctx, meta, x, weight, bias, data, lo, step, row_bits, offsets, mask, bits,
               group_size);
    meta.save(ctx);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qlinear_backward");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    MetaReader meta(ctx);
    const Codes codes = read_codes(meta);
    const auto [need_x, need_w, need_b] = needed(ctx, codes);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[3];
    const at::Tensor& g = grads[0];
    // (rows, features) views only where a tensor is not 2-d already, and mm where matmul would
    // only call it: each view or composite op is a dispatch and a tensor more (same values)
    auto rows = [](const at::Tensor& t) {
      return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
    };
    const at::Tensor g2 = rows(g);
    variable_list out(11);  // gx, gw, gb, then the codes' (none)
    if (need_w) {  // first: the decoded input is freed before the input gradient exists
      const at::Tensor x2 = rows(decode(codes, saved));
      // A weight given as the transpose of a contiguous (in, out) Parameter (GPT-2's Conv1D)
      // gets its gradient in that layout, (x^T g)^T, not as a transposed copy.
      const bool by_rows = weight.dim() == 2 && weight.stride(0) == 1 && weight.size(1) > 1 &&
                           weight.stride(1) == weight.size(0);
      at::Tensor gw = by_rows ? x2.t().mm(g2).t() : g2.t().mm(x2);
      out[1] = guard_second_order(codes, std::move(gw), weight, "QLinear");
    }
    if (need_x) out[0] = g.dim() == 2 ? g.mm(weight) : g.matmul(weight);
    if (need_b) out[2] = g2.sum(0);
    return out;
  }
};

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                   const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                   const OptTensor& row_bits, const OptTensor& offsets, const OptTensor& mask,
                   int64_t bits, int64_t group_size) {
  if (!(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1))) {
    (void)at::linear(x, weight, bias);  // torch's own error (a RuntimeError), as nn.Linear's
    TORCH_CHECK(false, "qlinear: x ", x.sizes(), " does not fit weight ", weight.sizes());
  }
  TORCH_CHECK_VALUE(lo.dim() == 2 && step.sizes() == lo.sizes(),
                    "qlinear: lo and step must be (rows, groups) alike, got ", lo.sizes(),
                    " and ", step.sizes());
  return QLinearFunction::apply(x, weight, bias, data, lo, step, row_bits, offsets, mask, bits,
                                group_size);
}

// -- Convolution ----------------------------------------------------------------------------
at::Tensor conv_forward(const at::Tensor& x, const at::Tensor& w, const OptTensor& b,
                        at::IntArrayRef stride, at::IntArrayRef padding,
                        at::IntArrayRef dilation, int64_t groups) {
  switch (x.dim()) {  // what F.conv1d/2d/3d call
    case 3: return at::conv1d(x, w, b, stride, padding, dilation, groups);
    case 4: return at::conv2d(x, w, b, stride, padding, dilation, groups);
    case 5: return at::conv3d(x, w, b, stride, padding, dilation, groups);
  }
  TORCH_CHECK_VALUE(false, "qconv: the input must be batched (N, C, *spatial) with 1-3 "
                    "spatial dims, got ", x.sizes());
  return at::Tensor();
}

struct QConvFunction : public torch::autograd::Function<QConvFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const at::Tensor& data, const at::Tensor& lo,
                            const at::Tensor& step, const OptTensor& row_bits,
                            const OptTensor& offsets, const OptTensor& mask, int64_t bits,
                            int64_t group_size, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, std::vector<int64_t> dilation,
                            int64_t groups, bool large) {
    RECORD_USER_SCOPE("actnn_zoo::qconv");
    at::Tensor out = conv_forward(x, weight, bias, stride, padding, dilation, groups);
    MetaWriter meta;  // the codes', then groups, large, format, stride, padding, dilation
    save_codes(ctx, meta, x, weight, bias, data, lo, step, row_bits, offsets, mask, bits,
               group_size);
    meta.add(groups);
    meta.add(large);
    // the input's memory format, which the decoded copy is given (cuDNN / oneDNN pick their
    // kernels by it): 0 contiguous, 1 channels_last, 2 channels_last_3d
    int64_t format = 0;
    if (!x.is_contiguous()) {
      if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) format = 1;
      if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) format = 2;
    }
    meta.add(format);
    meta.add(stride);
    meta.add(padding);
    meta.add(dilation);
    meta.save(ctx);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qconv_backward");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    MetaReader meta(ctx);
    const Codes codes = read_codes(meta);
    const int64_t groups = meta.next();
    const bool large = meta.flag();
    const int64_t format = meta.next();
    const Shape stride = meta.shape(), padding = meta.shape(), dilation = meta.shape();
    const auto [need_x, need_w, need_b] = needed(ctx, codes);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[3];
    const at::Tensor& go = grads[0];
    const at::IntArrayRef shape = codes.shape;
    const Shape zeros(stride.size(), 0);
    const at::OptionalIntArrayRef bias_sizes =
        need_b ? at::OptionalIntArrayRef(at::IntArrayRef(go.sizes().data() + 1, 1))
               : at::OptionalIntArrayRef();
    auto decoded = [&]() {
      at::Tensor x = decode(codes, saved);
      if (format == 1) return x.contiguous(at::MemoryFormat::ChannelsLast);
      if (format == 2) return x.contiguous(at::MemoryFormat::ChannelsLast3d);
      return x;
    };
    auto run = [&](const at::Tensor& x, std::array<bool, 3> mask) {
      return at::convolution_backward(go, x, weight, bias_sizes, stride, padding, dilation,
                                      false, zeros, groups, mask);
    };
    at::Tensor gi, gw, gb;
    if (need_x && need_w && !large) {
      // one call for a small input (a second call costs more than the arithmetic)
      std::tie(gi, gw, gb) = run(decoded(), {true, true, need_b});
    } else if (need_x || need_w) {
      if (need_w) {  // first: the decoded input is freed before the input gradient exists
        std::tie(std::ignore, gw, gb) = run(decoded(), {false, true, need_b});
      }
      if (need_x) gi = input_grad(go, weight, shape, stride, padding, dilation, groups);
      if (need_x && !gi.defined()) {  // the op reads the input's shape, not its values
        gi = std::get<0>(run(go.new_empty(at::IntArrayRef{}).expand(shape),
                             {true, false, false}));
      }
    }
    if (need_w) gw = guard_second_order(codes, gw, weight, "QConv");
    if (need_b && !need_w) {
      Shape dims{0};
      for (int64_t i = 2; i < go.dim(); ++i) dims.push_back(i);
      gb = go.sum(dims);
    }
    return {gi, gw, gb, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  }

  // The input gradient as the transposed convolution of grad_out with the output padding that
  // restores the input's size (no input tensor needed: aten's convolution_backward with a
  // stand-in input copies it to a full contiguous map first); undefined when the sizes cannot
  // be matched (functional/conv.py, ConvSpec.input_grad).
  static at::Tensor input_grad(const at::Tensor& go, const at::Tensor& weight,
                               at::IntArrayRef shape, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation,
                               int64_t groups) {
    Shape out_pad;
    for (size_t i = 0; i < stride.size(); ++i) {
      const int64_t n_in = shape[i + 2], n_out = go.size(static_cast<int64_t>(i) + 2);
      const int64_t span = dilation[i] * (weight.size(static_cast<int64_t>(i) + 2) - 1) + 1;
      const int64_t extra = n_in - ((n_out - 1) * stride[i] - 2 * padding[i] + span);
      if (extra < 0 || extra >= std::max(stride[i], dilation[i])) return at::Tensor();
      out_pad.push_back(extra);
    }
    switch (go.dim()) {
      case 3: return at::conv_transpose1d(go, weight, {}, stride, padding, out_pad, groups,
                                          dilation);
      case 4: return at::conv_transpose2d(go, weight, {}, stride, padding, out_pad, groups,
                                          dilation);
      case 5: return at::conv_transpose3d(go, weight, {}, stride, padding, out_pad, groups,
                                          dilation);
    }
    return at::Tensor();
  }
};

at::Tensor qconv(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                 const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                 const OptTensor& row_bits, const OptTensor& offsets, const OptTensor& mask,
                 int64_t bits, int64_t group_size, std::vector<int64_t> stride,
                 std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                 bool large) {
  const size_t dims = static_cast<size_t>(x.dim()) - 2;
  TORCH_CHECK_VALUE(x.dim() >= 3 && x.dim() <= 5 && weight.dim() == x.dim() &&
                    stride.size() == dims && padding.size() == dims && dilation.size() == dims,
                    "qconv: x ", x.sizes(), ", weight ", weight.sizes(), " and stride/padding/"
                    "dilation of ", stride.size(), "/", padding.size(), "/", dilation.size(),
                    " dims do not fit");
  TORCH_CHECK_VALUE(lo.dim() == 2 && step.sizes() == lo.sizes(),
                    "qconv: lo and step must be (rows, groups) alike, got ", lo.sizes(), " and ",
                    step.sizes());
  return QConvFunction::apply(x, weight, bias, data, lo, step, row_bits, offsets, mask, bits,
                              group_size, std::move(stride), std::move(padding),
                              std::move(dilation), groups, large);
}

// The backward of a layer that saved packed mask bits (quant.masked_grad): where the bit is set
// grad (on unset) or grad * on, elsewhere +0.0 (off unset) or grad * off. `differentiable`:
// torch.where of the same products, so a create_graph backward records it; otherwise the fused
// masked_grad kernel.
at::Tensor masked_backward(const at::Tensor& g, const at::Tensor& packed,
                           std::optional<double> on, std::optional<double> off,
                           bool differentiable) {
  if (differentiable || g.numel() == 0) {
    static const auto unpack = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("actnn_zoo::unpack_mask", "")
                                   .typed<at::Tensor(const at::Tensor&, c10::SymIntArrayRef)>();
    const at::Tensor mask = unpack.call(packed, c10::fromIntArrayRefSlow(g.sizes()));
    const at::Tensor kept = on.has_value() ? g * *on : g;
    return off.has_value() ? at::where(mask, kept, g * *off) : at::where(mask, kept, 0.0);
  }
  if (g.device().is_cpu()) return masked_grad_cpu(g.contiguous(), packed, on, off);
#ifdef ACTNN_ZOO_CUDA
  const c10::DeviceGuard guard(g.device());
  return masked_grad_cuda(g.contiguous(), packed, on, off);
#else
  TORCH_CHECK(false, "actnn_zoo: no masked_grad kernel for tensors on ", g.device());
  return at::Tensor();
#endif
}

// -- Dropout --------------------------------------------------------------------------------
// out = x * noise, the noise (kept values at 1 / (1 - p), dropped at 0) drawn in Python as
// torch's CPU dropout draws it; saved: its keep bits (pack_compare). Backward: grad * scale
// where kept, grad * 0.0 where dropped (the fused masked_grad kernel; torch.where of the same
// products when backward builds a graph), `scale` = 1 / (1 - p) rounded to the noise dtype.
struct QDropoutFunction : public torch::autograd::Function<QDropoutFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& noise,
                            const at::Tensor& packed, double scale) {
    RECORD_USER_SCOPE("actnn_zoo::qdropout");
    at::Tensor out = x * noise;
    ctx->save_for_backward({packed});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qdropout_backward");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor packed = ctx->get_saved_variables()[0];
    const double scale = ctx->saved_data["scale"].toDouble();
    // differentiable in grad whenever the backward builds a graph
    return {masked_backward(grads[0], packed, scale, 0.0, at::GradMode::is_enabled()), {}, {},
            {}};
  }
};

at::Tensor qdropout(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& packed,
                    double scale) {
  TORCH_CHECK_VALUE(noise.sizes() == x.sizes() && packed.scalar_type() == at::kByte &&
                    packed.numel() == (x.numel() + 7) / 8,
                    "qdropout: noise must have x's shape ", x.sizes(), " and packed hold one bit "
                    "per value, got ", noise.sizes(), " and ", packed.numel(), " bytes");
  return QDropoutFunction::apply(x, noise, packed, scale);
}

// -- Mask activations ----------------------------------------------------------------------
// y = relu / leaky_relu(a) / hardtanh(a, b) of x (in place when asked: x marked dirty), saving
// the packed bits of the slope that applied (made in Python by pack_compare, torch's backward
// predicate); backward grad where the bit is set and +0.0 (off unset) or grad * off elsewhere:
// the fused masked_grad kernel, or torch.where of the same products when the result must be
// differentiable (functional/activation.py's MaskActivationFunction and quant.masked_grad).
//
// `filled` (a 1-byte flag, optional): `packed` is filled after the forward, by whoever writes it
// through its pointer (a ReLU whose consumer's sparse codes hold its mask, or the mask packed
// at the end of the forward: functional/activation.py's _claim_node). Backward raises while
// the flag is 0 (the output was modified in place before anything saved it).
struct QMaskFunction : public torch::autograd::Function<QMaskFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, const at::Tensor& packed,
                            const std::string& op, double a, double b, bool inplace,
                            std::optional<double> off, const std::optional<at::Tensor>& filled) {
    RECORD_USER_SCOPE("actnn_zoo::qmask");
    at::Tensor out;
    if (op == "relu") {
      out = inplace ? at::relu_(x) : at::relu(x);
    } else if (op == "leaky_relu") {
      out = inplace ? at::leaky_relu_(x, a) : at::leaky_relu(x, a);
    } else if (op == "hardtanh") {
      out = inplace ? at::hardtanh_(x, a, b) : at::hardtanh(x, a, b);
    } else {
      TORCH_CHECK_VALUE(false, "qmask: no compiled node for activation ", op);
    }
    if (inplace) ctx->mark_dirty({x});
    if (filled.has_value()) {
      ctx->save_for_backward({packed, *filled});
    } else {
      ctx->save_for_backward({packed});
    }
    ctx->saved_data["off"] = off;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qmask_backward");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& packed = saved[0];
    TORCH_CHECK(saved.size() < 2 || saved[1].data_ptr<uint8_t>()[0] != 0,
                "actnn_zoo: the output of a ReLU was modified by an in-place operation after "
                "the ReLU and before anything saved it; its backward needs the original "
                "(torch's own ReLU raises for the same reason)");
    const c10::IValue off_value = ctx->saved_data["off"];
    const std::optional<double> off =
        off_value.isNone() ? std::nullopt : std::optional<double>(off_value.toDouble());
    const at::Tensor& g = grads[0];
    // as quant.masked_grad: differentiable when the result must be (a graph, a grad that
    // requires one)
    return {masked_backward(g, packed, std::nullopt, off,
                            at::GradMode::is_enabled() && g.requires_grad()),
            {}, {}, {}, {}, {}, {}, {}};
  }
};

at::Tensor qmask(const at::Tensor& x, const at::Tensor& packed, const std::string& op, double a,
                 double b, bool inplace, std::optional<double> off,
                 const std::optional<at::Tensor>& filled) {
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.numel() == (x.numel() + 7) / 8,
                    "qmask: packed must hold one bit per value of x ", x.sizes(), ", got ",
                    packed.numel(), " bytes of ", packed.scalar_type());
  if (filled.has_value()) check_byte_buffer(*filled, 1, "qmask: filled");
  return QMaskFunction::apply(x, packed, op, a, b, inplace, off, filled);
}

// Set a 1-byte flag (qmask's `filled`) through its pointer: its version counter does not move.
void set_flag(const at::Tensor& flag) {
  check_byte_buffer(flag, 1, "set_flag: flag");
  flag.data_ptr<uint8_t>()[0] = 1;
}

// -- Smooth activations --------------------------------------------------------------------
// y = f(x) (torch's op, by name), saving the codes of f'(x) (made in Python: float32, of x's
// shape, one width or per-sample widths); backward grad * f'(x)_hat in float32, cast back to
// x's dtype, into the decoded copy: what functional/activation.py's
// DerivativeActivationFunction computes, for the ops that do not read their output in backward.
at::Tensor activation_forward(const at::Tensor& x, const std::string& op, double a, double b,
                              const std::string& approximate) {
  if (op == "gelu") return at::gelu(x, approximate);
  if (op == "silu") return at::silu(x);
  if (op == "elu") return at::elu(x, a);
  if (op == "softplus") return at::softplus(x, a, b);
  if (op == "hardswish") return at::hardswish(x);
  if (op == "hardsigmoid") return at::hardsigmoid(x);
  if (op == "mish") return at::mish(x);
  TORCH_CHECK_VALUE(false, "qderivative: no compiled node for activation ", op);
  return at::Tensor();
}

// f'(x) as functional/activation.py's activation_derivative makes it (x: the output for
// sigmoid and tanh), in one call instead of its Python (the unit gradient made, the backward
// operator reached through torch.ops, ~20-30 us a call in a model's step): torch's own backward
// kernel over a unit gradient, in float32 (float64 stays), no graph. The exact GELU on the CPU
// takes a dense unit gradient that the result overwrites, the others a stride-0 one, as there
// (torch's kernels may differ in the last bit by layout), so the values are the same.
at::Tensor activation_derivative(const at::Tensor& x, const std::string& op, double a, double b,
                                 const std::string& approximate) {
  RECORD_USER_SCOPE("actnn_zoo::activation_derivative");
  const at::NoGradGuard no_grad;  // f'(x) is never differentiated
  const at::Tensor t = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  if (op == "gelu" && approximate == "none" && t.device().is_cpu()) {
    at::Tensor d = at::ones_like(t);
    return at::gelu_backward_out(d, d, t, "none");
  }
  const at::Tensor one = at::ones({}, t.options()).expand(t.sizes());
  if (op == "sigmoid") return at::sigmoid_backward(one, t);
  if (op == "tanh") return at::tanh_backward(one, t);
  if (op == "gelu") return at::gelu_backward(one, t, approximate);
  if (op == "silu") return at::silu_backward(one, t);
  if (op == "elu") return at::elu_backward(one, a, 1, 1, false, t);
  if (op == "softplus") return at::softplus_backward(one, t, a, b);
  if (op == "hardswish") return at::hardswish_backward(one, t);
  if (op == "hardsigmoid") return at::hardsigmoid_backward(one, t);
  if (op == "mish") return at::mish_backward(one, t);
  TORCH_CHECK_VALUE(false, "activation_derivative: unknown activation ", op);
  return at::Tensor();
}

struct QDerivativeFunction : public torch::autograd::Function<QDerivativeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& op,
                            double a, double b, const std::string& approximate,
                            const at::Tensor& data, const at::Tensor& lo, const at::Tensor& step,
                            const OptTensor& row_bits, const OptTensor& offsets, int64_t bits,
                            int64_t group_size) {
    RECORD_USER_SCOPE("actnn_zoo::qderivative");
    at::Tensor out = activation_forward(x, op, a, b, approximate);
    const bool mixed = row_bits.has_value() && row_bits->defined();
    TORCH_CHECK_VALUE(mixed == (offsets.has_value() && offsets->defined()),
                      "qderivative: row_bits and offsets come together (per-sample widths)");
    if (mixed) {
      ctx->save_for_backward({data, lo, step, *row_bits, *offsets});
    } else {
      ctx->save_for_backward({data, lo, step});
    }
    MetaWriter meta;  // the codes' (f'(x) was quantized in float32), then x's dtype
    write_codes(meta, mixed ? 1 : 0, at::kFloat, bits, group_size, false, false, x.sizes());
    meta.add(static_cast<int64_t>(x.scalar_type()));
    meta.save(ctx);
    ctx->saved_data["op"] = op;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qderivative_backward");
    // (the op's name looked up only for the error)
    if (at::GradMode::is_enabled()) no_second_derivative(ctx->saved_data["op"].toStringRef());
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    MetaReader meta(ctx);
    const Codes codes = read_codes(meta);
    const at::ScalarType in_dtype = meta.dtype();
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor deriv = decode(codes, saved, 0, 3);
    const at::Tensor& g = grads[0];
    // the decoded copy is this call's own: the product goes into it when it has the result's
    // dtype and shape (the values of grad * deriv), as the Python Function does
    at::Tensor gi = (at::promote_types(g.scalar_type(), deriv.scalar_type()) ==
                             deriv.scalar_type() && deriv.sizes() == g.sizes())
                        ? deriv.mul_(g)
                        : g * deriv;
    // (to() of the dtype it has gives the tensor itself: the dispatch is skipped)
    return {gi.scalar_type() == in_dtype ? gi : gi.to(in_dtype), {}, {}, {}, {}, {}, {}, {}, {},
            {}, {}, {}};
  }
};

at::Tensor qderivative(const at::Tensor& x, const std::string& op, double a, double b,
                       const std::string& approximate, const at::Tensor& data,
                       const at::Tensor& lo, const at::Tensor& step, const OptTensor& row_bits,
                       const OptTensor& offsets, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(lo.dim() == 2 && step.sizes() == lo.sizes(),
                    "qderivative: lo and step must be (rows, groups) alike, got ", lo.sizes(),
                    " and ", step.sizes());
  return QDerivativeFunction::apply(x, op, a, b, approximate, data, lo, step, row_bits, offsets,
                                    bits, group_size);
}

// -- Norms ----------------------------------------------------------------------------------
// Batch, layer and group norm where their fused CPU calls apply (functional/norm.py,
// _norm_node): Python runs the fused forward (native_*_norm, the codes of x_hat, the sampled
// rounding variances) and hands its results here in `made` -- out, data, lo, step, mean,
// stat [, var] -- so that the capture store is told of the saves before they happen; the node
// saves them as the Python Function does and its backward is the fused backward. `made` is
// one argument, not a tensor list, so that `out` is this node's own output, not a view of an
// input (which torch would forbid to modify in place: a ReLU after a batch norm).
// kind: 0 batch norm, 1 layer norm (extra: values per row), 2 group norm (extra: groups).
struct QNormFunction : public torch::autograd::Function<QNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                            const OptTensor& bias, const std::vector<at::Tensor>& made,
                            int64_t kind, int64_t extra, int64_t bits, int64_t group_size,
                            int64_t var_offset, int64_t var_stride, bool save_bias,
                            const std::string& layer) {
    RECORD_USER_SCOPE("actnn_zoo::qnorm");
    auto given = [](const OptTensor& t) { return t.has_value() && t->defined(); };
    const bool has_var = made.size() == 7;
    variable_list saved(made.begin() + 1, made.begin() + 6);  // data, lo, step, mean, stat
    if (given(weight)) saved.push_back(*weight);
    if (save_bias && given(bias)) saved.push_back(*bias);
    if (has_var) saved.push_back(made[6]);
    ctx->save_for_backward(saved);
    // kind, extra, bits, group_size, has_var, var_offset, var_stride, has_weight, has_bias
    // [, the weight's shape] [, the bias's]
    MetaWriter meta;
    for (const int64_t v : {kind, extra, bits, group_size, int64_t{has_var}, var_offset,
                            var_stride, int64_t{given(weight)}, int64_t{given(bias)}}) {
      meta.add(v);
    }
    if (given(weight)) meta.add(weight->sizes());
    if (given(bias)) meta.add(bias->sizes());
    meta.save(ctx);
    ctx->saved_data["layer"] = layer;
    return made[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qnorm_backward");
    TORCH_CHECK_NOT_IMPLEMENTED(
        !at::GradMode::is_enabled(), "actnn_zoo: double backward (create_graph=True) through ",
        ctx->saved_data["layer"].toStringRef(), " is not supported: its input gradient "
        "depends on the input, of which only a compressed copy is kept. Use the torch layer "
        "(to_float()) or set qconfig enabled=False for this layer.");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    const variable_list saved = ctx->get_saved_variables();
    MetaReader meta(ctx);
    const int64_t kind = meta.next(), extra = meta.next(), bits = meta.next(),
                  group_size = meta.next();
    const int64_t var[3] = {meta.next(), meta.next(), meta.next()};  // has_var, offset, stride
    const bool has_weight = meta.flag(), has_bias = meta.flag();
    const Shape weight_shape = has_weight ? meta.shape() : Shape();
    const Shape bias_shape = has_bias ? meta.shape() : Shape();
    const OptTensor weight = has_weight ? OptTensor(saved[5]) : std::nullopt;
    const OptTensor codes = var[0] ? OptTensor(saved.back()) : std::nullopt;
    const bool need_x = ctx->needs_input_grad(0);
    const at::Tensor& g = grads[0];
    at::Tensor gi, gw, gb;
    switch (kind) {
      case 0:
        std::tie(gi, gw, gb) = batch_norm_backward_fused_cpu(
            g, saved[0], saved[1], saved[2], bits, group_size, saved[4], weight, codes, var[1],
            var[2], need_x);
        break;
      case 1:
        std::tie(gi, gw, gb) = layer_norm_backward_fused_cpu(
            g, saved[0], saved[1], saved[2], bits, group_size, saved[4], weight, codes, var[1],
            var[2], extra, need_x);
        break;
      default:
        std::tie(gi, gw, gb) = group_norm_backward_fused_cpu(
            g, saved[0], saved[1], saved[2], bits, group_size, saved[4], weight, codes, var[1],
            var[2], extra, need_x);
    }
    const bool need_w = has_weight && ctx->needs_input_grad(1);
    const bool need_b = has_bias && ctx->needs_input_grad(2);
    // the gradients in the parameters' shapes: a view only where the kernel's differs (the
    // same values; a view is a dispatch and a tensor more)
    auto shaped = [](const at::Tensor& t, at::IntArrayRef shape) {
      return t.sizes() == shape ? t : t.view(shape);
    };
    return {need_x ? gi : at::Tensor(),
            need_w ? shaped(gw, weight_shape) : at::Tensor(),
            need_b ? shaped(gb, bias_shape) : at::Tensor(),
            {}, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

at::Tensor qnorm(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                 const std::vector<at::Tensor>& made, int64_t kind, int64_t extra, int64_t bits,
                 int64_t group_size, int64_t var_offset, int64_t var_stride, bool save_bias,
                 const std::string& layer) {
  TORCH_CHECK_VALUE(made.size() == 6 || made.size() == 7,
                    "qnorm: made must be (out, data, lo, step, mean, stat[, var]), got ",
                    made.size(), " tensors");
  TORCH_CHECK_VALUE(0 <= kind && kind <= 2, "qnorm: kind must be 0 (batch), 1 (layer) or 2 "
                    "(group norm), got ", kind);
  TORCH_CHECK_VALUE(made[0].sizes() == x.sizes() && !made[0].requires_grad(),
                    "qnorm: out must be the norm's output of x's shape, made outside autograd");
  return QNormFunction::apply(x, weight, bias, made, kind, extra, bits, group_size, var_offset,
                              var_stride, save_bias, layer);
}

// -- Attention ------------------------------------------------------------------------------
// F.scaled_dot_product_attention when one tile holds the call (functional/attention.py,
// _attention_node: float32 on the CPU, no mask, no broadcasting): the forward and backward are
// attention_whole_forward / _backward, and the payloads are the codes of q, k [and v] that
// Python made through the capture store (v only when dq or dk can be needed). `codes`: six
// entries per payload (data, lo, step, row_bits, offsets, mask; the last three None for one
// width), `bits` one per payload (0: per-sample widths or sparse codes).
struct QAttentionFunction : public torch::autograd::Function<QAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, at::IntArrayRef out_shape, double scale,
                            bool causal, int64_t threshold, int64_t s1, int64_t s2,
                            double drop_scale, const std::vector<OptTensor>& codes,
                            const std::vector<int64_t>& bits, int64_t group_size) {
    RECORD_USER_SCOPE("actnn_zoo::qattention");
    at::Tensor out =
        attention_whole_forward_cpu(q, k, v, scale, causal, threshold, s1, s2, drop_scale)
            .reshape(out_shape);
    variable_list kept;
    // payloads, group_size, causal, threshold, s1, s2, (first, kind, bits) per payload, then
    // the shapes of query, key and value; the two scales as a float list of their own
    MetaWriter meta;
    for (const int64_t v : {static_cast<int64_t>(bits.size()), group_size, int64_t{causal},
                            threshold, s1, s2}) {
      meta.add(v);
    }
    for (size_t i = 0; i < bits.size(); ++i) {
      const OptTensor* c = &codes[6 * i];
      const bool mixed = c[3].has_value() && c[3]->defined();
      const bool sparse = c[5].has_value() && c[5]->defined();
      meta.add(static_cast<int64_t>(kept.size()));
      meta.add(sparse ? 2 : mixed ? 1 : 0);
      meta.add(bits[i]);
      for (int j = 0; j < (sparse ? 6 : mixed ? 5 : 3); ++j) kept.push_back(*c[j]);
    }
    ctx->save_for_backward(kept);
    meta.add(query.sizes());
    meta.add(key.sizes());
    meta.add(value.sizes());
    meta.save(ctx);
    ctx->saved_data["scales"] = c10::List<double>({scale, drop_scale});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_USER_SCOPE("actnn_zoo::qattention_backward");
    no_second_derivative("scaled_dot_product_attention");
    const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
    const variable_list saved = ctx->get_saved_variables();
    MetaReader meta(ctx);
    const size_t payloads = static_cast<size_t>(meta.next());
    const int64_t group_size = meta.next();
    const bool causal = meta.flag();
    const int64_t threshold = meta.next(), s1 = meta.next(), s2 = meta.next();
    int64_t first[3], kinds[3], bits[3];
    for (size_t i = 0; i < payloads; ++i) {
      first[i] = meta.next();
      kinds[i] = meta.next();
      bits[i] = meta.next();
    }
    const Shape shapes[3] = {meta.shape(), meta.shape(), meta.shape()};
    const c10::ArrayRef<c10::IValue> scales = ctx->saved_data["scales"].toListRef();
    auto rows = [](at::IntArrayRef s) {  // (prod(batch), rows, features)
      return std::array<int64_t, 3>{c10::multiply_integers(s.begin(), s.end() - 2),
                                    s.end()[-2], s.back()};
    };
    // q, k, v were quantized in their inputs' shapes; decoded contiguous, so view() gives
    // what reshape() would, one dispatch fewer
    auto payload = [&](size_t i) {
      const size_t f = static_cast<size_t>(first[i]);
      return decode_payload(saved, f, f + 3, kinds[i], shapes[i], at::kFloat, bits[i],
                            group_size)
          .view(rows(shapes[i]));
    };
    const bool need_q = ctx->needs_input_grad(0), need_k = ctx->needs_input_grad(1),
               need_v = ctx->needs_input_grad(2);
    const at::Tensor q = payload(0), k = payload(1);
    const OptTensor v = payloads > 2 ? OptTensor(payload(2)) : std::nullopt;
    const auto v_rows = rows(shapes[2]);
    const at::Tensor go = grads[0].reshape({v_rows[0], q.size(1), v_rows[2]});
    auto [dq, dk, dv] = attention_whole_backward_cpu(
        go, q, k, v, scales[0].toDouble(), causal, threshold, s1, s2, scales[1].toDouble(),
        need_q, need_k, need_v);
    return {need_q ? dq.reshape(shapes[0]) : at::Tensor(),
            need_k ? dk.reshape(shapes[1]) : at::Tensor(),
            need_v ? dv.reshape(shapes[2]) : at::Tensor(),
            {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

at::Tensor qattention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::IntArrayRef out_shape, double scale, bool causal, int64_t threshold,
                      int64_t s1, int64_t s2, double drop_scale,
                      const std::vector<OptTensor>& codes, const std::vector<int64_t>& bits,
                      int64_t group_size) {
  TORCH_CHECK_VALUE((bits.size() == 2 || bits.size() == 3) && codes.size() == 6 * bits.size(),
                    "qattention: the codes of q, k [and v], six entries each, with one width "
                    "each; got ", codes.size(), " entries and ", bits.size(), " widths");
  for (size_t i = 0; i < bits.size(); ++i) {
    for (int j = 0; j < 3; ++j) {
      TORCH_CHECK_VALUE(codes[6 * i + j].has_value() && codes[6 * i + j]->defined(),
                        "qattention: payload ", i, " lacks its data, lo or step");
    }
  }
  TORCH_CHECK_VALUE(q.numel() == query.numel() && k.numel() == key.numel() &&
                        v.numel() == value.numel(),
                    "qattention: q, k and v must be query, key and value as (N, rows, "
                    "features)");
  return QAttentionFunction::apply(query, key, value, q, k, v, out_shape, scale, causal,
                                   threshold, s1, s2, drop_scale, codes, bits, group_size);
}

// A node's saves skip the capture store's saved-tensor hooks when those are innermost.
//
// Why: the store's pack hook passes a Q-layer's own saves (its codes, its weight) through
// unchanged, and its unpack hook gives them back; each is still one C++ -> Python call (a
// converted GPT-2 saves ~570 tensors a step, a ResNet-50 ~880). `own` is the pack hook
// object the store pushed (None: run the hooks); the hooks are skipped only when that very
// object is on top of the stack, so a user's hooks or a checkpoint's entered inside the
// forward (on top then) still see every save. Skipping is torch's own switch for deferring
// the default hooks (SavedTensorDefaultHooks::set_tracing, what dynamo sets while it traces),
// set for this call only: the saves are then plain saved variables, as without capture.
class OwnSaves {
 public:
  explicit OwnSaves(PyObject* own) {
    if (own == nullptr || own == Py_None || !saved_hooks_top_is(own)) return;
    previous_ = at::SavedTensorDefaultHooks::set_tracing(true);
    active_ = true;
  }
  ~OwnSaves() {
    if (active_) at::SavedTensorDefaultHooks::set_tracing(previous_);
  }
  OwnSaves(const OwnSaves&) = delete;
  OwnSaves& operator=(const OwnSaves&) = delete;

 private:
  bool active_ = false;
  bool previous_ = false;
};

// `fn` with one more argument, own_saves (see OwnSaves), last. Arguments taken by value (qconv's
// stride, padding, dilation) are moved on, not copied.
template <typename R, typename... A>
auto with_own_saves(R (*fn)(A...)) {
  return [fn](A... args, const pybind11::object& own_saves) -> R {
    OwnSaves guard(own_saves.ptr());
    return fn(std::forward<A>(args)...);
  };
}

}  // namespace

void register_qlayers(pybind11::module_& m) {
  namespace py = pybind11;
  // every node takes own_saves last (see OwnSaves)
  const auto own = py::arg("own_saves") = py::none();
  m.def("qlinear", with_own_saves(&qlinear),
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("data"), py::arg("lo"), py::arg("step"), py::arg("row_bits") = py::none(),
        py::arg("offsets") = py::none(), py::arg("mask") = py::none(), py::arg("bits"),
        py::arg("group_size"), own,
        "y = linear(x, weight, bias) whose backward decodes x from its codes for the weight "
        "gradient: data, lo, step (quantize of x at bits and group_size), with row_bits and "
        "offsets for per-sample widths, and mask too for sparse codes (quantize_sparse, CPU); "
        "the input and bias gradients are exact.");
  m.def("qconv", with_own_saves(&qconv),
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("data"), py::arg("lo"), py::arg("step"), py::arg("row_bits") = py::none(),
        py::arg("offsets") = py::none(), py::arg("mask") = py::none(), py::arg("bits"),
        py::arg("group_size"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
        py::arg("groups"), py::arg("large"), own,
        "y = conv{1,2,3}d(x, weight, bias, stride, padding, dilation, groups) whose backward "
        "decodes x from its codes (as qlinear) for the weight gradient; `large`: the weight "
        "gradient first and the decoded input freed before the input gradient is made.");
  m.def("qdropout", with_own_saves(&qdropout),
        py::arg("x"), py::arg("noise"), py::arg("packed"),
        py::arg("scale"), own,
        "out = x * noise (elementwise dropout's scaled noise) whose backward is grad * scale "
        "where `packed` (its keep bits) is set and grad * 0.0 elsewhere.");
  m.def("qmask", with_own_saves(&qmask),
        py::arg("x"), py::arg("packed"), py::arg("op"), py::arg("a"),
        py::arg("b"), py::arg("inplace"), py::arg("off") = py::none(),
        py::arg("filled") = py::none(), own,
        "y = relu / leaky_relu(a) / hardtanh(a, b) of x (in place when asked) whose backward is "
        "grad where `packed` (pack_compare of the slope's predicate) is set and +0.0, or grad * "
        "off, elsewhere. filled: a 1-byte flag set (set_flag) once `packed` was written after "
        "the forward; backward raises while it is 0.");
  m.def("set_flag", &set_flag, py::arg("flag"),
        "Set a 1-byte uint8 flag to 1 through its pointer (no version counter change).");
  m.def("qnorm", with_own_saves(&qnorm),
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("made"),
        py::arg("kind"), py::arg("extra"), py::arg("bits"), py::arg("group_size"),
        py::arg("var_offset"), py::arg("var_stride"), py::arg("save_bias"), py::arg("layer"),
        own,
        "CPU only: a norm's output as an autograd node. made = (out, data, lo, step, mean, "
        "stat[, var]) as batch/layer/group_norm_forward_codes returned them for x; kind 0 "
        "batch, 1 layer (extra: values per row), 2 group norm (extra: groups); backward is "
        "the matching *_backward_fused. save_bias: the bias is saved too (as layer norm's "
        "Python Function does); layer names the layer in the double-backward error.");
  m.def("qattention", with_own_saves(&qattention),
        py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out_shape"), py::arg("scale"),
        py::arg("causal"), py::arg("threshold"), py::arg("s1"), py::arg("s2"),
        py::arg("drop_scale"), py::arg("codes"), py::arg("bits"), py::arg("group_size"), own,
        "CPU only: scaled_dot_product_attention when one tile holds the call "
        "(attention_whole_forward of q, k, v: (N, rows, features) views of query, key and "
        "value), reshaped to out_shape, whose backward decodes q, k [and v] from their codes "
        "(six entries each: data, lo, step, row_bits, offsets, mask; one width per payload, 0 "
        "for per-sample widths or sparse codes) and runs attention_whole_backward.");
  m.def("activation_derivative", &activation_derivative, py::arg("x"), py::arg("op"),
        py::arg("a"), py::arg("b"), py::arg("approximate"),
        "f'(x) of a smooth activation (x: the output for sigmoid and tanh) by torch's backward "
        "kernel over a unit gradient, float32 (float64 stays), without a graph: "
        "functional/activation.py's activation_derivative in one call.");
  m.def("qderivative", with_own_saves(&qderivative),
        py::arg("x"), py::arg("op"), py::arg("a"), py::arg("b"),
        py::arg("approximate"), py::arg("data"), py::arg("lo"), py::arg("step"),
        py::arg("row_bits") = py::none(), py::arg("offsets") = py::none(), py::arg("bits"),
        py::arg("group_size"), own,
        "y = op(x) (gelu with `approximate`, silu, elu(alpha=a), softplus(beta=a, "
        "threshold=b), hardswish, hardsigmoid, mish) whose backward is grad * f'(x) decoded "
        "from its codes (float32, x's shape; row_bits and offsets for per-sample widths), in "
        "x's dtype.");
}

}  // namespace actnn_zoo
