"""Batch norm's training backward and layer norm's backward read from the codes of their saved
normalized input.

Why (docs/design.md, "The step's peak"): a QBatchNorm saves x_hat quantized. Decoding it, turning
it back into x and calling ``native_batch_norm_backward`` held three full maps next to the
incoming gradient (the decoded copy, the input gradient and a temporary of aten's); at the stem
of the CNN that set the peak of the whole step. :func:`batch_norm_backward_codes` reads the
codes a group at a time and holds only the input gradient it returns, in two passes over the
gradient and the codes instead of five over float maps.

Layer norm did the same (decode, rebuild x, ``native_layer_norm_backward``, which normalizes x
again); :func:`layer_norm_backward_codes` reads the codes a row at a time. Group norm is layer
norm over (sample, group) rows with a weight per channel: :func:`group_norm_backward_codes`
takes batch norm's two passes (per (sample, channel) sums, then the elementwise input gradient
with per-(sample, group) factors).

CPU kernels ``cpp_ext/norm_cpu.cpp``; elsewhere (and without the extension) the torch formulas
in :mod:`actnn_zoo.quant.reference`, which decode x_hat whole.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference
from .backend import kernels
from .tensor import QuantizedTensor

__all__ = ["batch_norm_backward_codes", "channels_last", "group_norm_backward_codes",
           "layer_norm_backward_codes", "reads_codes"]


def reads_codes(grad: Tensor, q: object, invstd: Tensor, weight: Optional[Tensor],
                kernel: str = "batch_norm_backward_codes") -> bool:
    """Whether :func:`batch_norm_backward_codes` applies: a plain QuantizedTensor (no rotation)
    of ``grad``'s shape, float32 gradient, statistics and weight, on the CPU with the compiled
    kernel (elsewhere the formula would decode x_hat whole: no better than aten's path), and a
    gradient that is not channels-last (the kernel reads (N, C, *spatial) order; a channels-last
    gradient is left to aten rather than copied and its input gradient given another layout).
    ``kernel``: which of the three (``"layer_norm_backward_codes"`` for layer norm,
    ``"group_norm_backward_codes"`` for group norm)."""
    return (isinstance(q, QuantizedTensor) and q.transform == "none"
            and grad.device.type == "cpu" and grad.dim() >= 2
            and grad.dtype == torch.float32 and invstd.dtype == torch.float32
            and (weight is None or weight.dtype == torch.float32)
            and tuple(grad.shape) == tuple(q.shape) and not channels_last(grad)
            and getattr(kernels(grad.device), kernel, None) is not None)


def channels_last(t: Tensor) -> bool:
    """Whether ``t`` is laid out channels-last (and not also plainly contiguous)."""
    if t.is_contiguous():
        return False
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def batch_norm_backward_codes(grad: Tensor, q: QuantizedTensor, invstd: Tensor,
                              weight: Optional[Tensor] = None, need_input: bool = True
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias) of training-mode batch norm, from ``grad`` (N, C,
    *spatial) and ``q``, the codes of its normalized input x_hat = (x - mean) * invstd, in
    float32: per channel gb = sum g, gw = sum g * x_hat and gi = (g - gb / m - x_hat * gw / m)
    * invstd * weight (m values per channel), what ``native_batch_norm_backward`` computes from
    x. grad_input is None when ``need_input`` is False. Equal to that formula on the decoded
    x_hat up to float rounding (the sums run in float32 lanes added in float64)."""
    n, c = _check_maps("batch_norm_backward_codes", grad, q)
    for name, t in (("invstd", invstd), ("weight", weight)):
        if t is not None and (t.dim() != 1 or t.shape[0] != c):
            raise ValueError(f"{name} must have shape ({c},), got {tuple(t.shape)}")
    g3 = grad.contiguous().view(n, c, -1)
    gi, gw, gb = _run("batch_norm_backward_codes", g3, q, invstd, weight, need_input)
    return (gi.view(grad.shape) if gi is not None else None), gw, gb


def layer_norm_backward_codes(grad: Tensor, q: QuantizedTensor, rstd: Tensor,
                              normalized_numel: int, weight: Optional[Tensor] = None,
                              need_input: bool = True
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias) of layer norm over the last dims holding
    ``normalized_numel`` values, from ``grad`` and ``q``, the codes of x_hat = (x - mean) * rstd
    (rows of ``q`` are samples: dim 0 of ``grad``). Per normalized row, with wg = g * weight:
    gi = (wg - mean(wg) - x_hat * mean(wg * x_hat)) * rstd; gw = sum g * x_hat, gb = sum g
    over rows, flat ``(normalized_numel,)``. What ``native_layer_norm_backward`` computes from x,
    up to float rounding."""
    if not isinstance(q, QuantizedTensor) or q.transform != "none":
        raise TypeError("layer_norm_backward_codes needs a QuantizedTensor without a transform")
    if grad.dim() < 1 or tuple(grad.shape) != tuple(q.shape):
        raise ValueError(f"gradient of shape {tuple(grad.shape)} for codes of {tuple(q.shape)}")
    f = int(normalized_numel)
    if f <= 0 or grad.numel() % f:
        raise ValueError(f"{f} normalized values do not divide the gradient's {grad.numel()}")
    g2 = grad.contiguous().view(-1, f)
    if rstd.numel() != g2.shape[0]:
        raise ValueError(f"rstd has {rstd.numel()} values for {g2.shape[0]} rows")
    if weight is not None and weight.numel() != f:
        raise ValueError(f"weight has {weight.numel()} values for {f} normalized ones")
    n = q.shape[0] if len(q.shape) >= 2 else 1
    d = grad.numel() // n if n else 0
    if n and d % f:
        raise ValueError(f"rows of {f} normalized values do not tile the {d} values of a sample:"
                         " layer norm over the batch dimension is not read from codes")
    gi, gw, gb = _run("layer_norm_backward_codes", g2, q, rstd.reshape(-1),
                      None if weight is None else weight.reshape(-1), need_input)
    return (gi.view(grad.shape) if gi is not None else None), gw, gb


def group_norm_backward_codes(grad: Tensor, q: QuantizedTensor, rstd: Tensor, num_groups: int,
                              weight: Optional[Tensor] = None, need_input: bool = True
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias) of group norm from ``grad`` (N, C, *spatial) and
    ``q``, the codes of x_hat = (x - mean) * rstd per (sample, group), ``rstd`` (N, G). Per
    (sample, group) row, with wg = g * weight[channel]: gi = (wg - mean(wg) - x_hat *
    mean(wg * x_hat)) * rstd; per channel gw = sum g * x_hat, gb = sum g. What
    ``native_group_norm_backward`` computes from x, up to float rounding."""
    n, c = _check_maps("group_norm_backward_codes", grad, q)
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f"{c} channels do not split into {num_groups} groups")
    if rstd.numel() != n * num_groups:
        raise ValueError(f"rstd has {rstd.numel()} values for {n} x {num_groups} groups")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != c):
        raise ValueError(f"weight must have shape ({c},), got {tuple(weight.shape)}")
    g3 = grad.contiguous().view(n, c, -1)
    gi, gw, gb = _run("group_norm_backward_codes", g3, q, rstd.reshape(-1), weight, need_input,
                      num_groups)
    return (gi.view(grad.shape) if gi is not None else None), gw, gb


def _check_maps(name: str, grad: Tensor, q: object) -> Tuple[int, int]:
    """(N, C) of a (N, C, *spatial) gradient whose codes ``q`` are plain and of its shape."""
    if not isinstance(q, QuantizedTensor) or q.transform != "none":
        raise TypeError(f"{name} needs a QuantizedTensor without a transform")
    if grad.dim() < 2 or tuple(grad.shape) != tuple(q.shape):
        raise ValueError(f"gradient of shape {tuple(grad.shape)} for codes of {tuple(q.shape)}"
                         " (need the same (N, C, *spatial) shape)")
    return grad.shape[0], grad.shape[1]


def _run(name: str, grad: Tensor, q: QuantizedTensor, stat: Tensor, weight: Optional[Tensor],
         need_input: bool, *extra: int):
    """The compiled kernel ``name`` on the CPU for float32 tensors, else its torch twin."""
    row_bits, offsets = q.row_layout()
    fn = getattr(kernels(grad.device), name, None)
    if fn is None or grad.device.type != "cpu" or not all(
            t.dtype == torch.float32 for t in (grad, stat, weight) if t is not None):
        fn = getattr(reference, name)
    return fn(grad, q.data, q.lo, q.step, row_bits, offsets, q.group_size, stat.contiguous(),
              None if weight is None else weight.contiguous(), need_input, *extra)
