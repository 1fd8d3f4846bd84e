"""Softmax saving its compressed output.

The backward of softmax is ``grad_in = y * (g - sum(g * y, dim))``, which needs the output
``y`` only. ``y`` is stored compressed (per-group stochastic rounding) and the backward uses
the reconstruction ``y_hat`` in both places. That formula is quadratic in ``y_hat``:
``E[y_hat_i * y_hat_i] = y_i^2 + Var(y_hat_i)`` (different elements are rounded independently,
so cross terms are unbiased), which left a bias of ``-Var(y_hat_i) * g_i`` per element: at 2
bits the mean of 400 backward passes missed the exact gradient by 1.36x what their noise
explains (``tests/test_bias.py``). Forward therefore also saves an unbiased estimate of each
value's rounding variance (``_rounding_variance``: every 8th value's, at 1 bit, about 0.14 bit
per value) and backward adds ``g_i * Var_hat_i``: the gradient is exactly unbiased for the
plain stochastic quantizer (other compressors keep the small bias; docs/design.md, "Which
Functions are unbiased").
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits
from ._rounding_variance import correct_, sample_variance
from ._saving import compress, load, restore, save
from .activation import no_double_backward

__all__ = ["SoftmaxFunction", "LogSoftmaxFunction", "softmax", "log_softmax", "softmax_dim"]


def softmax_dim(ndim: int, dim: Optional[int]) -> int:
    """The dim ``F.softmax`` uses: the given one, or torch's legacy implicit choice."""
    if dim is not None:
        return dim
    return 0 if ndim in (0, 1, 3) else 1


def _maps(dim: int, y: Tensor) -> Optional[bool]:
    """The output's layout for DIVISION (``compress(maps=...)``): over its last dim (attention
    probabilities, class scores) the output is features last, never maps; over another dim
    (per-pixel class maps, dim 1) the layout is not known."""
    return False if dim % max(y.dim(), 1) == y.dim() - 1 else None


class SoftmaxFunction(torch.autograd.Function):
    """``F.softmax(x, dim)`` saving the compressed output (float64 outputs are compressed as
    float32: quantization supports up to float32). ``create_graph=True`` raises."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: Optional[int], qconfig: LayerQConfig,
                bits: Optional[Bits]) -> Tensor:
        y = F.softmax(x, dim)  # warns like torch when dim is None
        ctx.dim = softmax_dim(x.dim(), dim)
        ctx.in_dtype = x.dtype
        ctx.out_dtype = y.dtype
        yq = y if y.dtype != torch.float64 else y.float()
        q = compress(yq, qconfig, bits, maps=_maps(ctx.dim, y))
        # the rounding variance of y_hat, for the unbiased correction in backward
        ctx.var_offset, var = sample_variance(q, yq, qconfig.rounding)
        save(ctx, q, var)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        no_double_backward("softmax")
        q, var = load(ctx)
        y = restore(q)
        work = torch.float64 if ctx.out_dtype == torch.float64 else torch.float32
        y = y.to(work)
        g = grad.to(work)
        grad_in = y * (g - (g * y).sum(ctx.dim, keepdim=True))
        # + g_i Var(y_hat_i): E[y_hat_i^2] = y_i^2 + Var(y_hat_i)
        grad_in = correct_(grad_in, g, ctx.var_offset, var)
        return grad_in.to(ctx.in_dtype), None, None, None


def softmax(x: Tensor, dim: Optional[int] = None, qconfig: Optional[LayerQConfig] = None,
            bits: Optional[Bits] = None) -> Tensor:
    """Softmax along ``dim`` saving its output compressed as ``qconfig`` says."""
    return SoftmaxFunction.apply(x, dim, LayerQConfig() if qconfig is None else qconfig, bits)


class LogSoftmaxFunction(torch.autograd.Function):
    """``F.log_softmax(x, dim)`` saving the compressed probabilities ``p = exp(y)``.

    The backward ``grad_in = g - p * sum(g, dim)`` is linear in ``p``, so stochastic rounding
    keeps it unbiased. (Saving the log-probabilities ``y`` compressed instead would be biased
    and far worse: the backward exponentiates them, turning a quantization step into a factor.)
    ``create_graph=True`` raises.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dim: Optional[int], qconfig: LayerQConfig,
                bits: Optional[Bits]) -> Tensor:
        y = F.log_softmax(x, dim)
        ctx.dim = softmax_dim(x.dim(), dim)
        ctx.in_dtype = x.dtype
        ctx.out_dtype = y.dtype
        p = y.exp() if y.dtype != torch.float64 else y.exp().float()
        save(ctx, compress(p, qconfig, bits, maps=_maps(ctx.dim, y)))
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        no_double_backward("log_softmax")
        (q,) = load(ctx)
        work = torch.float64 if ctx.out_dtype == torch.float64 else torch.float32
        p = restore(q).to(work)
        g = grad.to(work)
        grad_in = g - p * g.sum(ctx.dim, keepdim=True)
        return grad_in.to(ctx.in_dtype), None, None, None


def log_softmax(x: Tensor, dim: Optional[int] = None, qconfig: Optional[LayerQConfig] = None,
                bits: Optional[Bits] = None) -> Tensor:
    """Log-softmax along ``dim`` saving the probabilities compressed as ``qconfig`` says."""
    return LogSoftmaxFunction.apply(x, dim, LayerQConfig() if qconfig is None else qconfig, bits)
