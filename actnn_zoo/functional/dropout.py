"""Dropout saving its keep-mask at 1 bit per value (per channel for Dropout1d/2d/3d).

torch's CPU dropout saves a float mask (32 bits per value) and CUDA's a byte mask. Here the
noise is drawn exactly as torch's own CPU implementation draws it
(``empty_like(x).bernoulli_(1 - p)``, or ``new_empty(N, C, 1, ...)`` for feature dropout),
so with the same generator state the output is the same as torch's; only the packed mask
is kept. Backward rebuilds the scaled noise ``mask / (1 - p)`` in the input dtype, exactly as
torch computes it, so gradients are identical too. Elementwise dropout out of place on a
contiguous input runs as the compiled autograd node ``_C.qdropout`` (no Python in backward).
"""
from __future__ import annotations

import warnings
from typing import Tuple

import torch
from torch import Tensor

from .._session import active_session
from ._saving import keep_saved, load, save
from ..quant import ops, pack_compare
from ..quant.api import dropout_scale
from ..quant.backend import extension
from .activation import load_mask, masked_grad_in, memory_perm, to_memory_order
from .linear import _CUDA_NODES

__all__ = ["DropoutFunction", "PackedMaskDropout", "dropout", "dropout1d", "dropout2d", "dropout3d"]

# The compiled autograd node of elementwise dropout (cpp_ext/qlayers.cpp), None without it.
_QDROPOUT = getattr(extension(), "qdropout", None)


def _check_p(p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


class DropoutFunction(torch.autograd.Function):
    """Elementwise (``noise_shape`` None) or feature dropout with ``0 < p < 1``.

    ``noise_shape`` broadcasts against the input: ``(N, C, 1, ...)`` for batched feature
    dropout, ``(C, 1, ...)`` for unbatched input. That mask is all that is saved.
    """

    @staticmethod
    def forward(ctx, x: Tensor, p: float, noise_shape, inplace: bool) -> Tensor:
        if noise_shape is None:
            noise = torch.empty_like(x)
        else:
            noise = x.new_empty(noise_shape)
        noise.bernoulli_(1 - p)
        perm = memory_perm(noise)
        kept = to_memory_order(noise, perm)
        packed, mshape = pack_compare(kept, "gt", 0.0), kept.shape  # the bits of noise != 0
        noise.div_(1 - p)
        if inplace:
            out = x.mul_(noise)
            ctx.mark_dirty(x)
        else:
            out = x * noise
        ctx.p = p
        ctx.mshape = mshape
        ctx.perm = perm
        ctx.noise_dtype = noise.dtype
        ctx.elementwise = noise_shape is None
        save(ctx, packed)
        session = active_session()
        if session is not None and ctx.elementwise and perm is None and not inplace:
            # a later save of ``out`` (a matmul's operand after softmax -> dropout) can be
            # answered with ``x``'s payload and this mask: no bytes of its own (store.derive)
            session.store.derive(out, x, packed, p)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (packed,) = load(ctx)
        if ctx.elementwise and grad.dtype == ctx.noise_dtype:
            # One fused pass (quant.masked_grad): grad * scale where kept, grad * 0.0 where
            # dropped (not +0: torch's grad * noise gives -0.0 and NaN there too), with the scale
            # rounded to the noise dtype as torch's ``mask.to(dtype).div_(1 - p)`` rounds it.
            scale = dropout_scale(ctx.noise_dtype, ctx.p)
            return masked_grad_in(grad, packed, ctx.mshape, ctx.perm, scale, 0.0), None, None, None
        # Feature dropout: the (N, C, 1, ...) noise is small and broadcasts in the product.
        noise = load_mask(packed, ctx.mshape, ctx.perm).to(ctx.noise_dtype).div_(1 - ctx.p)
        return grad * noise, None, None, None


class PackedMaskDropout(torch.autograd.Function):
    """The form ``torch.compile`` traces for elementwise dropout with ``0 < p < 1``: values
    kept where a float32 uniform draw is below ``1 - p`` (inductor fuses the draw with the
    compare and the scaling, as it does torch's own dropout; an explicit ``bernoulli_`` ran as
    a separate call per layer), the keep-mask packed to 1 bit by the
    ``actnn_zoo::pack_mask`` operator (a graph keeps an operator's output as it is; a bool
    mask would cost a byte per value), the gradient rebuilt as :class:`DropoutFunction`'s.
    Out of place, as :class:`~actnn_zoo.functional.activation.TracedDerivativeActivation`."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:  # type: ignore[override]
        keep = torch.rand_like(x, dtype=torch.float32) < 1 - p
        packed = ops.pack_mask(keep)
        noise = keep.to(x.dtype).div_(1 - p)  # 1 / (1 - p) rounded to x's dtype, as torch's
        out = x * noise
        ctx.p, ctx.shape, ctx.noise_dtype = p, list(x.shape), noise.dtype
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        keep = ops.unpack_mask(packed, ctx.shape)
        # 1 / (1 - p) rounded to the noise dtype, as torch's noise holds it (a tensor: no
        # read-back in a graph); grad * 0.0 where dropped, as torch's grad * noise (-0.0 and
        # NaN pass alike)
        scale = torch.ones((), dtype=ctx.noise_dtype, device=grad.device).div_(1 - ctx.p)
        return torch.where(keep, grad * scale, grad * 0.0), None


def _trivial(x: Tensor, p: float) -> bool:
    """Cases torch handles without random noise: p == 0 (identity), p == 1 (zeros), empty."""
    return p == 0 or p == 1 or x.numel() == 0


def dropout(x: Tensor, p: float = 0.5, inplace: bool = False) -> Tensor:
    """Training-mode elementwise dropout saving a 1-bit keep-mask."""
    _check_p(p)
    if _trivial(x, p):
        return torch.nn.functional.dropout(x, p, True, inplace)
    if _QDROPOUT is not None and not inplace and type(x) is Tensor and x.is_contiguous() \
            and (x.device.type == "cpu" or _CUDA_NODES):
        return _dropout_node(x, p)
    return DropoutFunction.apply(x, p, None, inplace)


def _dropout_node(x: Tensor, p: float) -> Tensor:
    """:class:`DropoutFunction`'s forward, elementwise and out of place, with the compiled
    autograd node ``_C.qdropout`` (cpp_ext/qlayers.cpp) instead of the Python Function: the
    same noise, output, saved bits and gradient, no Python in backward."""
    noise = torch.empty_like(x)
    noise.bernoulli_(1 - p)
    packed = pack_compare(noise, "gt", 0.0)  # the bits of noise != 0
    noise.div_(1 - p)
    # what is saved is final (and counted as a Function's)
    out = _QDROPOUT(x, noise, packed, dropout_scale(noise.dtype, p), keep_saved(packed))
    session = active_session()
    if session is not None:  # as DropoutFunction: a later save of out may reuse x's payload
        session.store.derive(out, x, packed, p)
    return out


def _feature(x: Tensor, p: float, inplace: bool, batched: bool, plain) -> Tensor:
    if _trivial(x, p):
        return plain(x, p, True, inplace)
    if batched:
        if x.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        shape: Tuple[int, ...] = (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2)
    else:
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    return DropoutFunction.apply(x, p, shape, inplace)


def dropout1d(x: Tensor, p: float = 0.5, inplace: bool = False) -> Tensor:
    """Channel dropout for (N, C, L) or unbatched (C, L) input; saves the (N, C) mask."""
    _check_p(p)
    if x.dim() not in (2, 3):
        raise RuntimeError(
            f"dropout1d: Expected 2D or 3D input, but received a {x.dim()}D input. "
            "Note that dropout1d exists to provide channel-wise dropout on inputs with 1 "
            "spatial dimension, a channel dimension, and an optional batch dimension "
            "(i.e. 2D or 3D inputs).")
    return _feature(x, p, inplace, x.dim() == 3, torch.nn.functional.dropout1d)


def dropout2d(x: Tensor, p: float = 0.5, inplace: bool = False) -> Tensor:
    """Channel dropout as ``F.dropout2d`` (3-D input is read as (N, C, L), like torch)."""
    _check_p(p)
    if x.dim() not in (3, 4):
        warnings.warn(
            f"dropout2d: Received a {x.dim()}-D input to dropout2d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout2d "
            "exists to provide channel-wise dropout on inputs with 2 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 3D or 4D inputs).",
            stacklevel=3)
    if x.dim() == 3:
        warnings.warn(
            "dropout2d: Received a 3D input to dropout2d and assuming that channel-wise "
            "1D dropout behavior is desired - input is interpreted as shape (N, C, L), where C "
            "is the channel dim. This behavior will change in a future release to interpret the "
            "input as one without a batch dimension, i.e. shape (C, H, W). To maintain the 1D "
            "channel-wise dropout behavior, please switch to using dropout1d instead.",
            stacklevel=3)
    if _trivial(x, p):
        with warnings.catch_warnings():  # already warned above
            warnings.simplefilter("ignore")
            return torch.nn.functional.dropout2d(x, p, True, inplace)
    return _feature(x, p, inplace, True, None)


def dropout3d(x: Tensor, p: float = 0.5, inplace: bool = False) -> Tensor:
    """Channel dropout for (N, C, D, H, W) or unbatched (C, D, H, W) input."""
    _check_p(p)
    if x.dim() not in (4, 5):
        warnings.warn(
            f"dropout3d: Received a {x.dim()}-D input to dropout3d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout3d "
            "exists to provide channel-wise dropout on inputs with 3 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 4D or 5D inputs).",
            stacklevel=3)
    if _trivial(x, p):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.nn.functional.dropout3d(x, p, True, inplace)
    return _feature(x, p, inplace, x.dim() == 5, None)
