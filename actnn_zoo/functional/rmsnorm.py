"""RMSNorm that saves its normalized input compressed (torch ``nn.RMSNorm`` and the Hugging Face
LlamaRMSNorm / T5LayerNorm formulas).

Forward computes the output with the very ops the original module runs (``F.rms_norm`` for
torch; for Hugging Face the float32 ``pow / mean / rsqrt`` sequence and its casts), so outputs
are bit-identical to the original's, autocast included. Saved, like the other norms
(``functional/norm.py``): compress(n) with n = x * rstd the normalized input (unit scale in
every row, see that module's docstring for why the normalized input and not x), the exact
per-row ``rstd = rsqrt(mean(x^2) + eps)`` (float32) and the weight (a Parameter).

Backward: with g = grad_out * weight (the gradient reaching n),

    grad_x = rstd * (g - n * mean(g * n))      grad_weight = sum over rows of grad_out * n

Both are written in n and rstd, so unlike the other norms backward does not rebuild
x = n / rstd: torch has no public aten backward op for rms_norm to hand x to, and the formula
in n is one pass shorter. grad_weight is linear in the saved n (unbiased under stochastic
rounding); grad_x has the same quadratic term in n as layer norm's, whose diagonal is biased by
``rstd * g_i * Var(n_hat_i) / m``. As in the other norms, forward also saves an unbiased
estimate of the rounding variance (``_rounding_variance``) when x needs a gradient, and backward
adds that term back: exactly unbiased for the plain stochastic quantizer
(tests/test_bias.py).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits
from ._rounding_variance import correct_, norm_stride, sample_variance
from ._saving import compress, load, restore, save
from ._autocast import no_autocast
from .linear import cast, dtype_of, first_order_only
from .norm import _needs_saved_input

__all__ = ["RMS_STYLES", "RMSNormFunction", "rms_norm"]

#: "torch": ``F.rms_norm`` (nn.RMSNorm). "llama": HF LlamaRMSNorm (float32 compute, cast back
#: to the input dtype, then times the weight). "t5": HF T5LayerNorm (float32 variance, x times
#: rsqrt in promoted dtype, cast to the weight dtype when that is half/bfloat16, times weight).
RMS_STYLES = ("torch", "llama", "t5")


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _forward(x: Tensor, weight: Optional[Tensor], shape: Sequence[int], eps: Optional[float],
             style: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(output exactly as the original computes it, n = x * rstd in the work dtype, rstd)."""
    dims = tuple(range(-len(shape), 0))
    work = _work_dtype(x)
    if style == "torch":
        out = F.rms_norm(x, list(shape), weight, eps)
        e = torch.finfo(x.dtype).eps if eps is None else eps
        xw = x.to(work)
        rstd = torch.rsqrt(xw.pow(2).mean(dims, keepdim=True) + e)
        return out, xw * rstd, rstd
    if style == "llama":  # LlamaRMSNorm.forward, op for op
        h = x.to(torch.float32)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        n = h * rstd
        return weight * n.to(x.dtype), n, rstd
    if style == "t5":  # T5LayerNorm.forward, op for op
        rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
        h = x * rstd
        n = h if h.dtype == work else x.to(work) * rstd
        if weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(weight.dtype)
        return weight * h, n, rstd
    raise ValueError(f"unknown RMSNorm style {style!r}; expected one of {RMS_STYLES}")


class RMSNormFunction(torch.autograd.Function):
    """RMS norm over the last ``len(normalized_shape)`` dims; saves compress(n), exact
    per-row rstd and the weight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], normalized_shape: Sequence[int],
                eps: Optional[float], style: str, qconfig: LayerQConfig, bits: Bits) -> Tensor:
        out, n, rstd = _forward(x, weight, normalized_shape, eps, style)
        ctx.dims = tuple(range(-len(normalized_shape), 0))
        ctx.dtypes = (x.dtype, dtype_of(weight))
        n_q = var = None
        ctx.var_offset = None
        if _needs_saved_input(ctx, 1):
            n32 = n.to(torch.float32)
            n_q = compress(n32, qconfig, bits, maps=False)
            if ctx.needs_input_grad[0]:  # for the unbiased correction of grad_x
                ctx.var_offset, var = sample_variance(n_q, n32, qconfig.rounding,
                                                      norm_stride(math.prod(normalized_shape)))
            del n32
        del n
        save(ctx, n_q, rstd, weight, var)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        first_order_only("QRMSNorm (rms_norm)")
        n_q, rstd, weight, var = load(ctx)
        need_x, need_w = ctx.needs_input_grad[:2]
        x_dtype, w_dtype = ctx.dtypes
        gi = gw = None
        if n_q is not None:
            work = rstd.dtype
            with no_autocast(grad_out.device.type):
                go = cast(grad_out, work)
                n = cast(restore(n_q), work)
                if need_w:
                    lead = list(range(go.dim() - len(ctx.dims)))
                    gw = (go * n).sum(lead) if lead else go * n
                if need_x:
                    g = go if weight is None else go * weight.to(work)
                    gi = rstd * (g - n * (g * n).mean(ctx.dims, keepdim=True))
                    # + rstd w_i go_i Var(n_hat_i) / m (module docstring)
                    m = math.prod(go.shape[go.dim() - len(ctx.dims):])
                    gi = correct_(gi, go, ctx.var_offset, var, scale=rstd,
                                  weight=weight, stat=(m, 0), weight_stat=(1, m), divisor=m)
        return (cast(gi, x_dtype) if need_x else None, cast(gw, w_dtype) if need_w else None,
                None, None, None, None, None)


def rms_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
             eps: Optional[float] = None, style: str = "torch",
             qconfig: Optional[LayerQConfig] = None, bits: Optional[Bits] = None) -> Tensor:
    """``F.rms_norm`` (or an HF RMSNorm formula, ``style``) saving its normalized input
    compressed."""
    if style not in RMS_STYLES:
        raise ValueError(f"unknown RMSNorm style {style!r}; expected one of {RMS_STYLES}")
    qconfig = LayerQConfig() if qconfig is None else qconfig
    return RMSNormFunction.apply(x, weight, tuple(normalized_shape), eps, style, qconfig,
                                 qconfig.bits if bits is None else bits)
