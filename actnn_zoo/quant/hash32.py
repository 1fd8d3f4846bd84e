"""murmur3's 32-bit finalizer (fmix32): the one Python copy of the hash behind every
counter-based random number of the package.

Why counter-based: a random number that is a pure function of (seed, element index) gives the
same draws on every backend, for any tiling or thread count, so the compiled kernels
(``cpp_ext/kernels.h``, ``fmix32``) can be checked bit for bit against the torch reference.
Users: the quantizer's stochastic rounding (:func:`actnn_zoo.quant.reference.uniform_from_index`),
the Hadamard transform's signs (:mod:`actnn_zoo.quant.hadamard`) and attention's dropout mask
(:mod:`actnn_zoo.functional.attention`).

Three forms of the same function: on a Python int (seed keys, references in tests), on int64
tensors holding uint32 values (the reference kernels: never overflows int64), and in place on
int32 tensors holding the 32 bits in two's complement (attention: half the memory traffic of
int64, and the shifts vectorise).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["M32", "C1", "C2", "fmix32_int", "mul32", "fmix32", "fmix32_int32_"]

M32 = 0xFFFFFFFF
C1 = 0x85EBCA6B
C2 = 0xC2B2AE35
# The multipliers as signed 32-bit values (c - 2^32), for int32 tensors.
_C1_I32 = C1 - (1 << 32)
_C2_I32 = C2 - (1 << 32)


def fmix32_int(h: int) -> int:
    """fmix32 of the low 32 bits of a Python int.

    >>> hex(fmix32_int(1))
    '0x514e28b7'
    """
    h &= M32
    h ^= h >> 16
    h = (h * C1) & M32
    h ^= h >> 13
    h = (h * C2) & M32
    return h ^ (h >> 16)


def mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow (the
    constant is split into 16-bit halves)."""
    lo16, hi16 = c & 0xFFFF, c >> 16
    return (h * lo16 + (((h * hi16) & 0xFFFF) << 16)) & M32


def fmix32(h: Tensor) -> Tensor:
    """fmix32 of an int64 tensor holding uint32 values; a new tensor of uint32 values."""
    h = h ^ (h >> 16)
    h = mul32(h, C1)
    h = h ^ (h >> 13)
    h = mul32(h, C2)
    return h ^ (h >> 16)


def fmix32_int32_(x: Tensor, tmp: Optional[Tensor] = None) -> Tensor:
    """fmix32 in place on an int32 tensor holding the 32 bits of each value (two's complement);
    returns ``x``. torch's int32 multiply wraps modulo 2^32 on CPU and CUDA, and the logical
    shift is an arithmetic shift masked to the low bits. ``tmp``: scratch of ``x``'s shape and
    dtype, to reuse across calls."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    torch.bitwise_right_shift(x, 16, out=tmp)
    x ^= tmp.bitwise_and_(0xFFFF)
    x.mul_(_C1_I32)
    torch.bitwise_right_shift(x, 13, out=tmp)
    x ^= tmp.bitwise_and_(0x7FFFF)
    x.mul_(_C2_I32)
    torch.bitwise_right_shift(x, 16, out=tmp)
    x ^= tmp.bitwise_and_(0xFFFF)
    return x
