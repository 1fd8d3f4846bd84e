"""Linear that saves its input compressed; plus helpers shared by the conv and norm Functions.

Forward runs ``F.linear`` on the real input (so the output, autocast included, is exactly
torch's); only the copy kept for backward is compressed. The weight gradient is linear in the
saved input, so with unbiased stochastic rounding it is an unbiased estimate; the input gradient
does not use the saved input at all and is exact.

Double backward (``create_graph=True``, e.g. a WGAN-GP gradient penalty): the input gradient
``grad_out @ W`` is built from differentiable torch ops, so it is exact and differentiable in
both ``grad_out`` and ``W`` -- its derivative in ``x`` is zero, so nothing is missing. The
weight gradient ``grad_out^T x`` is differentiable in ``grad_out``; its derivative in ``x``
cannot be expressed (only the compressed ``x`` is kept), so when ``x`` required a gradient the
weight gradient is wrapped by :func:`guard_second_order`, which raises if anything ever
differentiates through it, instead of returning a silently wrong gradient.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits, QuantizedTensor, SampleBits, SparseQuantizedTensor
from ..quant.backend import extension
from ..quant.division import Payload
from ._autocast import autocast_on, no_autocast
from . import _saving
from ._saving import (compress, dequantize_rows, keep_saved, load, load_codes, restore,
                      sample_chunks, save, save_codes)

# The compiled autograd node of linear (cpp_ext/qlayers.cpp), None without the extension (the
# reference backend) or in a build older than this file; on CUDA only in a build with CUDA.
_QLINEAR = getattr(extension(), "qlinear", None)
_CUDA_NODES = bool(getattr(extension(), "has_cuda", False))
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# float64 is compressed through a float32 copy (``_saving.compress``); see check_compressible.
COMPRESSIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# -- helpers shared by conv.py and norm.py ------------------------------------------------------
def check_compressible(x: Tensor, layer: object) -> None:
    """Raise NotImplementedError for inputs that activation compression cannot hold.

    ``layer``: the layer or its name, for the message. The layer's class is named only when
    raising: read in a forward that torch.compile traces, ``type(layer).__name__`` was a
    Python guard per layer, run at every compiled call.

    Falling back silently would keep a full-precision copy while the user believes the layer
    compresses; the user can opt out per layer with ``qconfig.enabled=False`` instead.

    float64 is accepted and compressed like float32 (``_saving.compress`` quantizes a float32
    copy; forward and the exact parts of backward stay float64). Why not pass it through: the
    point of a Q-layer is the memory, and a float64 activation kept whole costs 32x its 2-bit
    copy. Why the cast costs nothing: a quantization step is at least 1/255 of its group's
    range, some 2^15 times coarser than float32's rounding, so the float32 copy adds no
    measurable error (values beyond float32's range become inf, and their group NaN, as any
    non-finite group does).
    """
    if x.is_nested:
        raise NotImplementedError(f"{_name(layer)}: nested tensor input is not supported "
                                  "while compressing activations (set qconfig enabled=False)")
    if x.layout != torch.strided:
        raise NotImplementedError(f"{_name(layer)}: sparse input (layout {x.layout}) is not "
                                  "supported while compressing activations (set qconfig "
                                  "enabled=False)")
    if x.dtype not in COMPRESSIBLE_DTYPES:
        raise NotImplementedError(f"{_name(layer)}: {x.dtype} input is not supported while "
                                  "compressing activations (float32/float16/bfloat16 only; set "
                                  "qconfig enabled=False)")


def _name(layer: object) -> str:
    return layer if isinstance(layer, str) else type(layer).__name__


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last(_3d) when ``x`` is laid out that way (and not also plain contiguous)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def cast(t: Optional[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """``t.to(dtype)`` that passes None through (gradients come back in the input's dtype).
    Same dtype: ``t`` itself without the call (what ``to`` returns then; every Q-layer backward
    casts several tensors that already have their dtype)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def dtype_of(t: Optional[Tensor]) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


class _SecondOrderGuard(torch.autograd.Function):
    """Identity on a gradient whose own derivative is incomplete; raises if differentiated.

    Built in a backward that runs with ``create_graph=True``: the value is right (it is what
    the first-order backward returns), but part of its dependence on the forward's inputs is
    lost with the uncompressed activation. Differentiating it again must not silently drop that
    part, so this node raises instead (``anchor`` only makes the output part of the graph).
    """

    @staticmethod
    def forward(ctx, value: Tensor, anchor: Tensor, what: str) -> Tensor:
        ctx.what = what
        return value.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[None, None, None]:
        raise NotImplementedError(
            f"actnn_zoo: differentiating the {ctx.what} again (double backward) is not "
            "supported: its derivative with respect to the layer input needs the uncompressed "
            "input, which is not kept. Use the torch layer (to_float()) or set qconfig "
            "enabled=False for this layer.")


def guard_second_order(value: Optional[Tensor], anchor: Tensor, what: str,
                       needed: bool) -> Optional[Tensor]:
    """``value`` unchanged, or, when ``needed`` and backward is building a graph
    (``create_graph=True``), wrapped so that differentiating it raises (see
    :class:`_SecondOrderGuard`). ``anchor``: a tensor that requires grad (the weight)."""
    if value is None or not needed or not torch.is_grad_enabled():
        return value
    return _SecondOrderGuard.apply(value, anchor, what)


def first_order_only(layer: str) -> None:
    """Raise when backward runs with ``create_graph=True`` for a layer whose input gradient
    depends on the input itself (norms): only its compressed copy is kept, so a graph of that
    gradient would lack the input's part -- a silently wrong second derivative."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"actnn_zoo: double backward (create_graph=True) through {layer} is not "
            "supported: its input gradient depends on the input, of which only a compressed "
            "copy is kept. Use the torch layer (to_float()) or set qconfig enabled=False for "
            "this layer.")


# -- Linear -------------------------------------------------------------------------------------
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], qconfig: LayerQConfig,
           bits: Bits) -> Tensor:
    """The training forward of a Q-linear layer: ``F.linear`` whose backward reads ``x``
    compressed. Where :func:`compiled_node_applies` -- the common case -- the autograd node is
    the compiled ``_C.qlinear`` (no Python in backward); otherwise :class:`LinearFunction`.
    Both save the same codes and give the same gradients."""
    if _QLINEAR is not None and compiled_node_applies(x, weight, bias, qconfig, bits):
        q = compress(x, qconfig, bits, maps=False)
        made = node_codes(q, weight)
        if made is None:
            return LinearFunction.apply(x, weight, bias, qconfig, bits, q)
        codes, own = made
        return _QLINEAR(x, weight, bias, *codes, own)
    return LinearFunction.apply(x, weight, bias, qconfig, bits)


def compiled_node_applies(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                          qconfig: LayerQConfig, bits: Bits) -> bool:
    """Whether a layer's compiled autograd node (cpp_ext/qlayers.cpp) computes what its Python
    Function would: the plain quantizer (one width or per-sample widths), a weight that needs
    its gradient (else nothing is saved), one floating dtype and no autocast (no casts to
    track), the input decoded whole (``backward_chunks`` off or a small input), a plain
    tensor on a device the extension has kernels for."""
    return (weight.requires_grad and type(x) is Tensor and x.dtype in _FUSED_DTYPES
            and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
            and qconfig.compressor == "quant" and qconfig.transform == "none"
            and isinstance(bits, (int, SampleBits))
            and (qconfig.backward_chunks <= 1 or x.numel() * 4 < _saving.CHUNK_MIN_BYTES)
            and (x.is_cpu or _CUDA_NODES)
            and not autocast_on(x))


def node_codes(q: Payload, weight: Optional[Tensor] = None) -> Optional[Tuple[tuple, object]]:
    """``q`` as a compiled node takes it -- (data, lo, step, row_bits, offsets, mask, bits,
    group_size) for a layer's input, (data, lo, step, row_bits, offsets, bits, group_size)
    without ``weight`` (an activation's f'(x), never sparse codes) -- and the node's
    ``own_saves`` (:func:`~actnn_zoo.functional._saving.keep_saved` of these tensors and
    ``weight``); or None for a payload it does not decode (a rotation)."""
    codes = payload_codes(q, sparse=weight is not None)
    if codes is None:
        return None
    # the payload's tensors, read off the codes (``q.tensors()`` in another order, which
    # keep_saved does not mind): two Python frames less on every compiled layer call
    saves = codes[:3] if codes[3] is None else codes[:5]  # row_bits and offsets come together
    if weight is None:
        return codes[:5] + codes[6:], keep_saved(*saves)
    if codes[5] is not None:
        saves += (codes[5],)
    return codes, keep_saved(*saves, weight)


def payload_codes(q: Payload, sparse: bool = True) -> Optional[tuple]:
    """``q`` as the compiled nodes decode it -- (data, lo, step, row_bits, offsets, mask, bits,
    group_size); bits 0 for per-sample widths or sparse codes, None where absent -- or None for
    a payload they do not decode (a rotation, DIVISION; sparse codes unless ``sparse``)."""
    if type(q) is QuantizedTensor and q.transform == "none":
        return (q.data, q.lo, q.step, q.row_bits, q.offsets, None, q.bits or 0, q.group_size)
    if type(q) is SparseQuantizedTensor and sparse:  # a ReLU output's codes
        return (q.data, q.lo, q.step, q.row_bits, q.offsets, q.mask, 0, q.group_size)
    return None


class LinearFunction(torch.autograd.Function):
    """y = x W^T + b, saving compress(x) (only when W needs a gradient) and W (a Parameter).
    ``saved``: compress(x) when the caller made it already."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], qconfig: LayerQConfig,
                bits: Bits, saved: Optional[Payload] = None) -> Tensor:
        out = F.linear(x, weight, bias)  # autocast applies here exactly as for nn.Linear
        ctx.dtypes = (x.dtype, weight.dtype, dtype_of(bias))
        ctx.compute_dtype = out.dtype
        ctx.chunks = qconfig.backward_chunks
        if saved is None and ctx.needs_input_grad[1]:
            saved = compress(x, qconfig, bits, maps=False)
        save(ctx, saved, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        x_q, weight = load(ctx)
        chunks = sample_chunks(x_q, ctx.chunks) if ctx.needs_input_grad[1] else []

        def decode(rows: Optional[Tuple[int, int]] = None) -> Tensor:
            return restore(x_q) if rows is None else dequantize_rows(x_q, *rows)

        return linear_backward(ctx, grad_out, weight, decode, chunks) + (None, None, None)


class TracedLinearFunction(torch.autograd.Function):
    """The form ``torch.compile`` traces: :class:`LinearFunction` at one width, the input kept
    as ``actnn_zoo::quantize_uniform`` codes (``_saving.save_codes``), no host work."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], bits: int,
                group_size: int) -> Tensor:
        out = F.linear(x, weight, bias)
        ctx.dtypes = (x.dtype, weight.dtype, dtype_of(bias))
        ctx.compute_dtype = out.dtype
        save_codes(ctx, x if ctx.needs_input_grad[1] else None, bits, group_size, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        x, (weight,) = load_codes(ctx)
        return linear_backward(ctx, grad_out, weight, lambda rows=None: x, []) + (None, None)


def traced_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], bits: int,
                  group_size: int) -> Tensor:
    """:class:`TracedLinearFunction` on ``x`` with its leading dims flattened outside the
    Function: a view made inside a custom Function may not be modified in place later (an
    in-place activation after a linear layer on (N, T, D) input), a view made outside may."""
    out = TracedLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, bits,
                                     group_size)
    return out.view(*x.shape[:-1], out.shape[-1])


def _weight_grad(g: Tensor, x: Tensor, by_rows: bool) -> Tensor:
    """``g^T x`` (out, in) for (rows, out) ``g`` and (rows, in) ``x``; ``by_rows``: as the
    transpose of a contiguous (in, out) ``x^T g``, the layout of a weight stored (in, out)."""
    return x.t().matmul(g).t() if by_rows else g.t().matmul(x)


def linear_backward(ctx, grad_out: Tensor, weight: Tensor,
                    decode: Callable[[Optional[Tuple[int, int]]], Tensor],
                    chunks: List[Tuple[int, int]]
                    ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(input, weight, bias) gradients of a linear Function; ``decode(rows)`` gives the saved
    input (samples ``rows``, or all for None), ``chunks`` the sample ranges to decode one at a
    time ([] for whole).

    Plain torch ops throughout: with create_graph=True (grad mode on here) the input and bias
    gradients are recorded, exact and differentiable; see the module docstring."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    dt = ctx.compute_dtype
    gi = gw = gb = None
    with no_autocast(grad_out.device.type):
        go = cast(grad_out, dt)
        go2 = go.reshape(-1, go.shape[-1])
        # The weight gradient first: the decoded input is freed before the input gradient
        # exists, so the backward holds one map less (docs/design.md, "The step's peak").
        if need_w:
            # A weight given as the transpose of a contiguous (in, out) Parameter (GPT-2's
            # Conv1D) gets its gradient made in that layout, (x^T g)^T: made as g^T x, the
            # Parameter's .grad would be a transposed copy, one weight-sized copy per step.
            by_rows = (weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1
                       and weight.stride(1) == weight.shape[0])  # (no view made to ask)
            if chunks:  # sum over samples, one decoded chunk at a time (_saving)
                for start, stop in chunks:
                    x2 = cast(decode((start, stop)), dt)
                    gw_c = _weight_grad(go[start:stop].reshape(-1, go.shape[-1]),
                                        x2.reshape(-1, x2.shape[-1]), by_rows)
                    gw = gw_c if gw is None else gw.add_(gw_c)
                    del x2
            else:
                x2 = cast(decode(None), dt)
                gw = _weight_grad(go2, x2.reshape(-1, x2.shape[-1]), by_rows)
            gw = guard_second_order(gw, weight, "QLinear weight gradient", need_x)
        if need_x:
            gi = go.matmul(cast(weight, dt))
        if need_b:
            gb = go2.sum(0)
    return cast(gi, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype)
