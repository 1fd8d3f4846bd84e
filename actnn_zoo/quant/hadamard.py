"""Randomized Walsh-Hadamard transform per quantization group: the torch specification of
``actnn_zoo._C.hadamard_`` (``cpp_ext/hadamard.h``), and the call that picks the kernel.

Why rotate before quantizing: a group's step is its range over ``2^b - 1``, so one outlier (a
transformer feature 100x the others, a channel of large scale sharing a group with small ones)
sets a step that rounds every other value of the group to an endpoint. The normalized
Walsh-Hadamard matrix is orthogonal and spreads each value over the whole group; with random
signs in front no fixed input lines up with its rows. Quantizing ``y = H (s * x) / sqrt(g)``
and applying the inverse after dequantize gives back ``x`` with an error that is spread evenly
instead of landing on the small values, and, the inverse being linear, stochastic rounding
stays unbiased: ``E[s * H deq(Q(y)) / sqrt(g)] = s * H y / sqrt(g) = x``.

Layout: each row of a float32 ``(N, D)`` tensor, each *full* group of ``g`` columns (``g`` a
power of two in [32, 8192]); the last ``D % g`` columns of a row are left untransformed. Signs
``s_j`` are a hash of (seed, column ``j``), so the payload stores only the seed.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .backend import kernels
from .hash32 import C1 as _C1
from .hash32 import M32 as _M32
from .hash32 import fmix32 as _fmix32
from .hash32 import fmix32_int, mul32 as _mul32

TRANSFORMS = ("none", "hadamard")
MIN_GROUP, MAX_GROUP = 32, 8192  # as kHadamardMinGroup / kHadamardMaxGroup in hadamard.h
_SALT = 0x632BE5AB


def check_transform(value: object, name: str = "transform") -> str:
    """Validate a transform name; returns it."""
    if not isinstance(value, str) or value not in TRANSFORMS:
        raise ValueError(f"{name} must be one of {TRANSFORMS}, got {value!r}")
    return value


def check_transform_group(transform: str, group_size: int, name: str = "group_size") -> None:
    """The Hadamard transform needs a power-of-two group in [32, 8192]."""
    if transform == "hadamard" and not (MIN_GROUP <= group_size <= MAX_GROUP
                                        and group_size & (group_size - 1) == 0):
        raise ValueError(f"{name} must be a power of two in [{MIN_GROUP}, {MAX_GROUP}] with "
                         f"transform 'hadamard', got {group_size}")


def signs(d: int, seed: int, device: torch.device = torch.device("cpu")) -> Tensor:
    """(d,) float32 of +-1: s_j = -1 where fmix32(lo32(j) ^ key ^ hi32(j) * 0x85EBCA6B) has
    its top bit set, key = fmix32(seed + 0x632BE5AB)."""
    key = fmix32_int((seed & _M32) + _SALT)
    j = torch.arange(d, dtype=torch.int64, device=device)
    h = _fmix32((j & _M32) ^ key ^ _mul32(j >> 32, _C1))
    return 1.0 - 2.0 * (h >> 31).to(torch.float32)


def _butterflies(v: Tensor) -> Tensor:
    """H v along the last dim (a power of two), as log2(g) stages pairing k and k + h."""
    m, g = v.shape
    h = 1
    while h < g:
        w = v.view(m, g // (2 * h), 2, h)
        a, b = w[:, :, 0, :], w[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2).reshape(m, g)
        h *= 2
    return v


def hadamard_reference(x2d: Tensor, group_size: int, seed: int, inverse: bool = False
                       ) -> Tensor:
    """Out-of-place torch version of ``_C.hadamard_`` (same float32 operations, same order)."""
    n, d = x2d.shape
    g = group_size
    full = d // g
    out = x2d.to(torch.float32, copy=True)
    if n == 0 or full == 0:
        return out
    scale = float(torch.tensor(1.0 / math.sqrt(g), dtype=torch.float32))
    s = signs(full * g, seed, x2d.device).view(full, g)
    head = out[:, :full * g].reshape(n, full, g)
    if not inverse:
        head = head * s
    v = _butterflies(head.reshape(n * full, g)).view(n, full, g) * scale
    if inverse:
        v = v * s
    out[:, :full * g] = v.reshape(n, full * g)
    return out


def hadamard_(x2d: Tensor, group_size: int, seed: int, inverse: bool = False) -> Tensor:
    """The transform in place on a contiguous float32 ``(N, D)`` tensor; returns it.

    Runs ``_C.hadamard_`` (C++ on CPU, CUDA on GPU); the torch reference only when there is no
    compiled kernel for the device (``ACTNN_ZOO_BACKEND=reference``, or an older build).
    """
    if x2d.dtype != torch.float32 or x2d.dim() != 2 or not x2d.is_contiguous():
        raise ValueError(f"hadamard_ needs a contiguous float32 (N, D) tensor, got "
                         f"{x2d.dtype} {tuple(x2d.shape)}")
    check_transform_group("hadamard", group_size)
    fn = getattr(kernels(x2d.device), "hadamard_", None)
    if fn is None:
        x2d.copy_(hadamard_reference(x2d, group_size, seed, inverse))
        return x2d
    return fn(x2d, group_size, seed & _M32, inverse)
