"""The kernels as ``torch.library`` custom operators, for graphs that ``torch.compile`` traces.

Eager code calls the extension directly (:mod:`actnn_zoo.quant.api`): a custom operator's
dispatch costs several microseconds per call that a layer would pay on every save. A traced
graph cannot call an opaque pybind function, so the compiled path
(:mod:`actnn_zoo.compiled`) calls these instead: each has a schema, a fake (meta) kernel that
gives the output shapes without running anything, and one implementation for every device
(the backend chosen by :func:`~actnn_zoo.quant.backend.kernels`). ``tests/test_custom_ops.py``
checks them with ``torch.library.opcheck``.

The seed is a tensor, not an int: a graph draws it with ``torch.randint`` on every run, so
each step rounds with new random numbers while the operator itself stays a function of its
inputs (which opcheck and graph replays need).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from .backend import kernels

__all__ = ["quantize_uniform", "dequantize_uniform", "pack_mask", "unpack_mask", "rows_of"]

_NS = "actnn_zoo"


def rows_of(shape: Sequence[int]) -> Tuple[int, int]:
    """(N, D) of the quantization contract's row view: dim 0 is the sample, the rest one row;
    0-d and 1-d tensors are one row (works on symbolic sizes too)."""
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    d = 1
    for s in shape[1:]:
        d = d * s
    return shape[0], d


def _check(bits: int, group_size: int) -> None:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"actnn_zoo::quantize_uniform: bits must be 1, 2, 4 or 8, got {bits}")
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"actnn_zoo::quantize_uniform: group_size must be a positive "
                         f"multiple of 8, got {group_size}")


@torch.library.custom_op(f"{_NS}::quantize_uniform", mutates_args=())
def quantize_uniform(x: Tensor, seed: Tensor, bits: int, group_size: int,
                     stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(codes, lo, step) of a contiguous float tensor at one width for every row: the codes
    are ``N * ceil(D * bits / 8)`` bytes, ``lo``/``step`` bfloat16 ``(N, ceil(D / group))``.
    ``seed``: a one-element integer tensor (its low 32 bits seed the rounding)."""
    _check(bits, group_size)
    if not x.is_contiguous():
        raise ValueError("actnn_zoo::quantize_uniform needs a contiguous tensor")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"actnn_zoo::quantize_uniform: float32/16 or bfloat16, got {x.dtype}")
    n, d = rows_of(x.shape)
    if n * d == 0:
        lo = torch.empty(n, -(-d // group_size), dtype=torch.bfloat16, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), lo, torch.empty_like(lo)
    s = int(seed.reshape(-1)[0]) & 0xFFFFFFFF
    data, lo, step = kernels(x.device).quantize_uniform(x.reshape(n, d), bits, group_size, s,
                                                         stochastic)
    return data, lo, step


@quantize_uniform.register_fake
def _(x: Tensor, seed: Tensor, bits: int, group_size: int, stochastic: bool):
    _check(bits, group_size)
    n, d = rows_of(x.shape)
    lo = x.new_empty((n, (d + group_size - 1) // group_size), dtype=torch.bfloat16)
    data = x.new_empty((n * ((d * bits + 7) // 8),), dtype=torch.uint8)
    return data, lo, torch.empty_like(lo)


@torch.library.custom_op(f"{_NS}::dequantize_uniform", mutates_args=())
def dequantize_uniform(data: Tensor, lo: Tensor, step: Tensor, shape: List[int], bits: int,
                       group_size: int, dtype: torch.dtype) -> Tensor:
    """The contiguous tensor of ``shape`` and ``dtype`` that :func:`quantize_uniform`'s codes
    stand for."""
    _check(bits, group_size)
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if out.numel():
        n, d = rows_of(out.shape)
        kernels(data.device).dequantize_uniform(data, lo, step, bits, group_size, 0,
                                                out.view(n, d))
    return out


@dequantize_uniform.register_fake
def _(data: Tensor, lo: Tensor, step: Tensor, shape: List[int], bits: int, group_size: int,
      dtype: torch.dtype) -> Tensor:
    return data.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{_NS}::pack_mask", mutates_args=())
def pack_mask(mask: Tensor) -> Tensor:
    """A bool tensor at 1 bit per value, in memory order of its contiguous copy."""
    flat = mask.reshape(-1).contiguous()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=mask.device)
    return kernels(mask.device).pack_mask(flat)


@pack_mask.register_fake
def _(mask: Tensor) -> Tensor:
    return mask.new_empty(((mask.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::unpack_mask", mutates_args=())
def unpack_mask(packed: Tensor, shape: List[int]) -> Tensor:
    """The bool tensor of ``shape`` that :func:`pack_mask` packed."""
    numel = 1
    for s in shape:
        numel *= s
    if packed.numel() != (numel + 7) // 8:
        raise ValueError(f"actnn_zoo::unpack_mask: {packed.numel()} bytes do not hold "
                         f"{numel} values")
    if numel == 0:
        return torch.empty(shape, dtype=torch.bool, device=packed.device)
    return kernels(packed.device).unpack_mask(packed.contiguous(), numel).view(shape)


@unpack_mask.register_fake
def _(packed: Tensor, shape: List[int]) -> Tensor:
    return packed.new_empty(shape, dtype=torch.bool)
