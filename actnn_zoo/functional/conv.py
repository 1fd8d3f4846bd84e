"""Convolution, plain and transposed, 1d/2d/3d, that saves its input compressed.

Forward calls the same ``F.conv{1,2,3}d`` / ``F.conv_transpose{1,2,3}d`` the torch module calls,
on the real input, so the output (autocast included) is exactly torch's; only the copy kept for
backward is compressed. Backward dequantizes it and calls the public
``aten::convolution_backward`` (one code path for CPU and CUDA, every stride/padding/dilation/
groups/output_padding combination). The weight gradient is linear in the saved input, hence
unbiased under stochastic rounding; the input gradient does not read it and is exact. A large
saved input is decoded a chunk of samples at a time (``backward_chunks``), each chunk's call
giving its rows of the input gradient and a part of the weight gradient, so the step's peak
holds one chunk of x instead of all of it.

Double backward (``create_graph=True``): backward is made of differentiable ops
(``convolution_backward`` has a derivative formula in torch), so the input and bias gradients
are exact and differentiable in ``grad_out`` and the weight (their derivative in ``x`` is zero).
The weight gradient's derivative in ``x`` would need the uncompressed input: when ``x``
required a gradient the weight gradient raises if differentiated (``guard_second_order``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits
from ..quant.backend import extension
from ..quant.division import Payload
from ._autocast import no_autocast
from ._saving import (compress, dequantize_rows, large_input, load, load_codes, restore,
                      sample_chunks, save, save_codes)
from .linear import (cast, compiled_node_applies, dtype_of, guard_second_order,
                     memory_format_of, node_codes)

# The compiled autograd node of a plain convolution (cpp_ext/qlayers.cpp), None without it.
_QCONV = getattr(extension(), "qconv", None)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class ConvSpec:
    """The hyper-parameters of one convolution call, as the torch functional op takes them.

    ``padding`` may be the strings 'same' / 'valid' (plain conv only); :meth:`backward_padding`
    turns it into what ``convolution_backward`` needs.
    """

    dims: int
    stride: Tuple[int, ...]
    padding: Union[str, Tuple[int, ...]]
    dilation: Tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: Tuple[int, ...] = ()
    pad_mode: str = "zeros"  # 'reflect' / 'replicate' / 'circular': F.pad(x, pad_nd) first
    pad_nd: Tuple[int, ...] = ()

    def run(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """The torch op itself (what nn.ConvNd / nn.ConvTransposeNd compute)."""
        x = self.pad(x)
        if self.transposed:
            return _CONV_T[self.dims](x, weight, bias, self.stride, self.padding,
                                      self.output_padding, self.groups, self.dilation)
        return _CONV[self.dims](x, weight, bias, self.stride, self.padding, self.dilation,
                                self.groups)

    def pad(self, x: Tensor) -> Tensor:
        """padding_mode != 'zeros': the F.pad torch's module applies before the conv."""
        if self.pad_mode == "zeros":
            return x
        return F.pad(x, list(self.pad_nd), mode=self.pad_mode)

    def pad_backward(self, grad: Tensor, shape: torch.Size) -> Tensor:
        """The gradient of :meth:`pad` (public aten backward ops; circular by slicing)."""
        if self.pad_mode == "zeros":
            return grad
        if self.pad_mode == "circular":
            for i in range(len(self.pad_nd) // 2):
                dim = grad.dim() - 1 - i
                left, right = self.pad_nd[2 * i], self.pad_nd[2 * i + 1]
                size = grad.shape[dim] - left - right
                core = grad.narrow(dim, left, size).clone()
                if left:
                    core.narrow(dim, size - left, left).add_(grad.narrow(dim, 0, left))
                if right:
                    core.narrow(dim, 0, right).add_(grad.narrow(dim, left + size, right))
                grad = core
            return grad
        kind = {"reflect": "reflection", "replicate": "replication"}[self.pad_mode]
        op = getattr(torch.ops.aten, f"{kind}_pad{self.dims}d_backward")
        # The op reads only the input's shape.
        return op(grad, grad.new_empty(()).expand(shape), list(self.pad_nd))

    def backward_padding(self, kernel: Tuple[int, ...]) -> Tuple[List[int], List[int]]:
        """(symmetric padding, extra zeros after the input) per spatial dim.

        'same' with an even receptive field pads one more on the right; like aten's own
        'same' convolution we express that as an explicit right pad plus a symmetric padding.
        """
        if self.padding == "valid":
            return [0] * self.dims, [0] * self.dims
        if self.padding == "same":
            left, extra = [], []
            for d, k in zip(self.dilation, kernel):
                total = d * (k - 1)
                left.append(total // 2)
                extra.append(total - 2 * (total // 2))
            return left, extra
        return list(self.padding), [0] * self.dims

    def output_padding_list(self) -> List[int]:
        return list(self.output_padding) if self.transposed else [0] * self.dims

    def input_grad(self, grad: Tensor, weight: Tensor, padding: List[int],
                   shape: torch.Size) -> Optional[Tensor]:
        """The input gradient as the adjoint op's forward, or None where it does not fit.

        A conv's input gradient is the transposed conv of grad_out (and the reverse), with the
        output padding that restores ``shape``. This needs no input tensor: aten's
        ``convolution_backward`` with a stand-in input copies it to a contiguous full map
        (oneDNN), which costs a pass and a map the size of the input (docs/design.md,
        "The step's peak"). None when the sizes cannot be matched (transposed output padding
        of a stride or more).
        """
        kernel = weight.shape[2:]
        out_pad = []
        for i, (n_in, n_out) in enumerate(zip(shape[2:], grad.shape[2:])):
            s, p, d, k = self.stride[i], padding[i], self.dilation[i], kernel[i]
            span = d * (k - 1) + 1
            if self.transposed:  # the adjoint is a plain conv: its output size must be n_in
                if (n_out + 2 * p - span) // s + 1 != n_in:
                    return None
            else:
                extra = n_in - ((n_out - 1) * s - 2 * p + span)
                if not 0 <= extra < max(s, d):
                    return None
                out_pad.append(extra)
        if self.transposed:
            return _CONV[self.dims](grad, weight, None, self.stride, padding, self.dilation,
                                    self.groups)
        return _CONV_T[self.dims](grad, weight, None, self.stride, padding, out_pad,
                                  self.groups, self.dilation)


def _padded_shape(shape: torch.Size, spec: ConvSpec) -> torch.Size:
    """The input's shape after padding_mode's F.pad."""
    if spec.pad_mode == "zeros":
        return shape
    pads = list(spec.pad_nd)
    spatial = [s + pads[2 * (spec.dims - 1 - i)] + pads[2 * (spec.dims - 1 - i) + 1]
               for i, s in enumerate(shape[2:])]
    return torch.Size(list(shape[:2]) + spatial)


def _remember(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor,
              spec: ConvSpec, chunks: int) -> None:
    """What a conv Function's backward reads besides the saved tensors."""
    ctx.spec = spec
    ctx.x_shape = x.shape
    ctx.xp_shape = _padded_shape(x.shape, spec)
    ctx.x_format = memory_format_of(x)
    ctx.dtypes = (x.dtype, weight.dtype, dtype_of(bias))
    ctx.compute_dtype = out.dtype
    ctx.chunks = chunks


def conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], spec: ConvSpec,
         qconfig: LayerQConfig, bits: Bits) -> Tensor:
    """The training forward of a Q-conv layer on a batched input: ``spec.run`` whose backward
    reads ``x`` compressed. A plain convolution (not transposed, numeric zero padding) where
    ``linear.compiled_node_applies`` -- the common case -- gets the compiled autograd node
    ``_C.qconv`` (no Python in backward); anything else :class:`ConvFunction`. Both save the
    same codes and give the same gradients."""
    if (_QCONV is not None and not spec.transposed and spec.pad_mode == "zeros"
            and not isinstance(spec.padding, str)
            and compiled_node_applies(x, weight, bias, qconfig, bits)):
        q = compress(x, qconfig, bits, maps=True)
        made = node_codes(q, weight)
        if made is None:
            return ConvFunction.apply(x, weight, bias, spec, qconfig, bits, q)
        codes, own = made
        return _QCONV(x, weight, bias, *codes, list(spec.stride), list(spec.padding),
                      list(spec.dilation), spec.groups, large_input(q), own)
    return ConvFunction.apply(x, weight, bias, spec, qconfig, bits)


class ConvFunction(torch.autograd.Function):
    """Saves compress(x) (only when the weight needs a gradient) and the weight (a Parameter).

    Inputs must be batched (N, C, *spatial); the module unsqueezes unbatched ones. With
    padding_mode != 'zeros' the unpadded input is compressed and re-padded in backward.
    ``saved``: compress(x) when the caller made it already.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], spec: ConvSpec,
                qconfig: LayerQConfig, bits: Bits, saved: Optional[Payload] = None) -> Tensor:
        out = spec.run(x, weight, bias)  # autocast applies here exactly as in the torch module
        _remember(ctx, x, weight, bias, out, spec, qconfig.backward_chunks)
        if saved is None and ctx.needs_input_grad[1]:
            saved = compress(x, qconfig, bits, maps=True)
        save(ctx, saved, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        x_q, weight = load(ctx)
        chunks = sample_chunks(x_q, ctx.chunks) if ctx.needs_input_grad[1] else []

        def decode(rows: Optional[Tuple[int, int]] = None) -> Tensor:
            return restore(x_q) if rows is None else dequantize_rows(x_q, *rows)

        return conv_backward(ctx, grad_out, weight, decode, chunks, large_input(x_q)) + (
            None, None, None, None)


class TracedConvFunction(torch.autograd.Function):
    """The form ``torch.compile`` traces: :class:`ConvFunction` at one width, the input kept as
    ``actnn_zoo::quantize_uniform`` codes (``_saving.save_codes``) and decoded whole in
    backward. No host work: the graph has no break of its own at the layer."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], spec: ConvSpec,
                bits: int, group_size: int) -> Tensor:
        out = spec.run(x, weight, bias)
        _remember(ctx, x, weight, bias, out, spec, 1)
        save_codes(ctx, x if ctx.needs_input_grad[1] else None, bits, group_size, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        x, (weight,) = load_codes(ctx)
        return conv_backward(ctx, grad_out, weight, lambda rows=None: x, [], False) + (
            None, None, None)


def conv_backward(ctx, grad_out: Tensor, weight: Tensor,
                  decode: Callable[[Optional[Tuple[int, int]]], Tensor],
                  chunks: List[Tuple[int, int]], large: bool
                  ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(input, weight, bias) gradients of a conv Function. ``decode(rows)`` gives the saved
    input (samples ``rows`` of it, or all for None); ``chunks`` the sample ranges to decode one
    at a time ([] for whole); ``large``: a whole input large enough that the weight gradient
    is computed first and the decoded input freed before the input gradient exists.

    Differentiable ops only: with create_graph=True the graph of the input gradient is
    recorded (module docstring)."""
    spec: ConvSpec = ctx.spec
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    dt = ctx.compute_dtype
    pad, extra = spec.backward_padding(tuple(weight.shape[2:]))
    # F.pad order: last spatial dim first, (before, after) pairs.
    pad_nd = [v for e in reversed(extra) for v in (0, e)]
    xp_shape = ctx.xp_shape  # after padding_mode's F.pad
    padded_shape = xp_shape[:2] + tuple(s + e for s, e in zip(xp_shape[2:], extra))
    gi = gw = gb = None
    with no_autocast(grad_out.device.type):
        go, w = cast(grad_out, dt), cast(weight, dt)
        layer = f"QConv{'Transpose' if spec.transposed else ''}{spec.dims}d"

        def run(go_: Tensor, x: Tensor, mask: List[bool]) -> Tuple[Tensor, ...]:
            return torch.ops.aten.convolution_backward(
                go_, x, w, [go.shape[1]] if mask[2] else None, list(spec.stride), pad,
                list(spec.dilation), spec.transposed, spec.output_padding_list(),
                spec.groups, mask)

        def decoded(rows: Optional[Tuple[int, int]] = None) -> Tensor:
            x = spec.pad(cast(decode(rows), dt).contiguous(memory_format=ctx.x_format))
            return F.pad(x, pad_nd) if any(extra) else x

        if chunks:
            # The weight and bias gradients are sums over samples, accumulated chunk by chunk
            # so that only one chunk of x is decoded at a time; each chunk's input gradient
            # is written into its rows of one output (one call computes all three).
            if need_x:
                gi = torch.empty(padded_shape, dtype=dt, device=go.device,
                                 memory_format=ctx.x_format)
            for start, stop in chunks:
                gi_c, gw_c, gb_c = run(go[start:stop], decoded((start, stop)),
                                       [need_x, True, need_b])
                if need_x:
                    gi[start:stop].copy_(gi_c)
                del gi_c
                gw = gw_c if gw is None else gw.add_(gw_c)
                if need_b:
                    gb = gb_c if gb is None else gb.add_(gb_c)
        elif need_x and need_w and not large:
            # One call for a small input: its peak does not matter, a second call would
            # cost more than the arithmetic. Bias grad comes with the weight grad (oneDNN
            # computes them together); alone, it is just a sum, done below.
            gi, gw, gb = run(go, decoded(), [True, True, need_b])
        elif need_x or need_w:
            # The weight gradient first, from the decoded input, which is freed before the
            # input gradient exists: the backward then holds grad_out and one map more, not
            # two (docs/design.md, "The step's peak").
            if need_w:
                x = decoded()
                _, gw, gb = run(go, x, [False, True, need_b])
                del x
            if need_x:
                gi = spec.input_grad(go, w, pad, padded_shape)
            if need_x and gi is None:
                # The op reads the input's shape, not its values, for the input gradient.
                shape_only = go.new_empty(()).expand(padded_shape)
                gi = run(go, shape_only, [True, False, False])[0]
        if need_w:
            gw = guard_second_order(gw, weight, f"{layer} weight gradient", need_x)
        if need_b and not need_w:
            gb = go.sum([0] + list(range(2, go.dim())))
        if gi is not None and any(extra):
            gi = gi[(slice(None), slice(None)) + tuple(slice(0, s) for s in xp_shape[2:])]
        if gi is not None:
            gi = spec.pad_backward(gi, ctx.x_shape)
    return cast(gi, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype)
