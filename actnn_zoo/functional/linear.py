"""Linear that saves its input compressed; plus helpers shared by the conv and norm Functions.

Forward runs ``F.linear`` on the real input (so the output, autocast included, is exactly
torch's); only the copy kept for backward is compressed. The weight gradient is linear in the
saved input, so with unbiased stochastic rounding it is an unbiased estimate; the input gradient
does not use the saved input at all and is exact.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..config import LayerQConfig
from ..quant import Bits
from ._saving import compress, load, restore, save

COMPRESSIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# -- helpers shared by conv.py and norm.py ------------------------------------------------------
def check_compressible(x: Tensor, layer: str) -> None:
    """Raise NotImplementedError for inputs that activation compression cannot hold.

    Falling back silently would keep a full-precision copy while the user believes the layer
    compresses; the user can opt out per layer with ``qconfig.enabled=False`` instead.
    """
    if x.is_nested:
        raise NotImplementedError(f"{layer}: nested tensor input is not supported while "
                                  "compressing activations (set qconfig enabled=False)")
    if x.layout != torch.strided:
        raise NotImplementedError(f"{layer}: sparse input (layout {x.layout}) is not supported "
                                  "while compressing activations (set qconfig enabled=False)")
    if x.dtype not in COMPRESSIBLE_DTYPES:
        raise NotImplementedError(f"{layer}: {x.dtype} input is not supported while compressing "
                                  "activations (float32/float16/bfloat16 only; set qconfig "
                                  "enabled=False)")


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
    """``t.to(dtype)`` that passes None through (gradients come back in the input's dtype)."""
    if t is None or dtype is None:
        return t
    return t.to(dtype)


def dtype_of(t: Optional[Tensor]) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


# -- Linear -------------------------------------------------------------------------------------
class LinearFunction(torch.autograd.Function):
    """y = x W^T + b, saving compress(x) (only when W needs a gradient) and W (a Parameter)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], qconfig: LayerQConfig,
                bits: Bits) -> Tensor:
        out = F.linear(x, weight, bias)  # autocast applies here exactly as for nn.Linear
        need_w = ctx.needs_input_grad[1]
        ctx.dtypes = (x.dtype, weight.dtype, dtype_of(bias))
        ctx.compute_dtype = out.dtype
        save(ctx, compress(x, qconfig, bits) if need_w else None, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        x_q, weight = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dt = ctx.compute_dtype
        gi = gw = gb = None
        with torch.autocast(grad_out.device.type, enabled=False):
            go = grad_out.to(dt)
            go2 = go.reshape(-1, go.shape[-1])
            if need_x:
                gi = go.matmul(weight.to(dt))
            if need_w:
                x2 = restore(x_q).to(dt)
                gw = go2.t().matmul(x2.reshape(-1, x2.shape[-1]))
            if need_b:
                gb = go2.sum(0)
        return cast(gi, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype), None, None
