"""Kernels for the meta device: the CUDA entries' outputs, shapes only.

A converted model on ``torch.device("meta")`` runs every off-CPU branch of the library (the
ones a GPU takes) without computing anything: shape checks and dry runs work, and
:mod:`actnn_zoo.bench.offcpu` counts what a GPU step dispatches on a machine without a GPU.
Each function allocates what its CUDA entry in ``cpp_ext/bindings.cpp`` allocates, with the
same torch operators (the one-width layout's ``full`` and ``arange``, the per-sample offsets'
cumulative sum), so that an operator count on the meta device is the CUDA path's. Kernels the
CUDA build does not have are absent here too: callers that look them up with ``getattr``
take their torch program, as on a GPU. DIVISION's kernels are absent (its torch program runs
instead, not its CUDA kernel).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .reference import contract_rows

__all__ = ["quantize", "quantize_lean", "quantize_uniform", "dequantize", "dequantize_uniform",
           "row_offsets", "pack_mask", "unpack_mask", "masked_grad", "pack_compare",
           "hadamard_", "rounding_variance_codes", "rounding_variance_correct_",
           "attention_keep", "allocate_widths", "range_statistic"]

_VARIANCE_GROUP = 256  # functional._rounding_variance._VARIANCE_GROUP

def _codes(n: int, d: int, total: int, group_size: int, device: torch.device
           ) -> Tuple[Tensor, Tensor, Tensor]:
    groups = (d + group_size - 1) // group_size
    lo = torch.empty(n, groups, dtype=torch.bfloat16, device=device)
    return (torch.empty(int(total), dtype=torch.uint8, device=device), lo,
            torch.empty(n, groups, dtype=torch.bfloat16, device=device))


def _uniform_layout(n: int, d: int, bits: int, first: int, device: torch.device
                    ) -> Tuple[Tensor, Tensor]:
    rb = (d * bits + 7) // 8
    offsets = (torch.arange(first * rb, (first + n + 1) * rb, rb, dtype=torch.int64,
                            device=device) if rb > 0
               else torch.zeros(n + 1, dtype=torch.int64, device=device))
    return torch.full((n,), bits, dtype=torch.uint8, device=device), offsets


def quantize(x2d: Tensor, bits: Tensor, offsets: Tensor, total: int, group_size: int,
             seed: int, stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    n, d = x2d.shape
    return _codes(n, d, total, group_size, x2d.device)


quantize_lean = quantize


def quantize_uniform(x: Tensor, bits: int, group_size: int, seed: int, stochastic: bool
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    n, d = contract_rows(x.shape)
    _uniform_layout(n, d, bits, 0, x.device)
    return _codes(n, d, n * ((d * bits + 7) // 8), group_size, x.device)


def dequantize(data: Tensor, lo: Tensor, step: Tensor, bits: Tensor, offsets: Tensor,
               group_size: int, out: Tensor) -> Tensor:
    return out


def dequantize_uniform(data: Tensor, lo: Tensor, step: Tensor, bits: int, group_size: int,
                       first: int, out: Tensor) -> Tensor:
    n, d = contract_rows(out.shape)
    _uniform_layout(n, d, bits, first, out.device)
    return out


def row_offsets(d: int, bits: Tensor) -> Tensor:
    if bits.dtype == torch.uint8:  # the CUDA kernel's one output (cpp_ext/widths_cuda.cu)
        return torch.empty(bits.shape[0] + 1, dtype=torch.int64, device=bits.device)
    sizes = bits.to(torch.int64).mul(d).add(7).div(8, rounding_mode="floor")
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=bits.device),
                      torch.cumsum(sizes, 0)])


def pack_mask(mask: Tensor) -> Tensor:
    return torch.empty((mask.numel() + 7) // 8, dtype=torch.uint8, device=mask.device)


def unpack_mask(packed: Tensor, numel: int) -> Tensor:
    return torch.empty(numel, dtype=torch.bool, device=packed.device)


def masked_grad(grad: Tensor, packed: Tensor, on: Optional[float] = None,
                off: Optional[float] = None) -> Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def pack_compare(x: Tensor, kind: int, lo: float, hi: float,
                 out: Optional[Tensor] = None) -> Tensor:
    return torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)


def hadamard_(x2d: Tensor, group_size: int, seed: int, inverse: bool) -> Tensor:
    return x2d


def rounding_variance_codes(lo: Tensor, step: Tensor, row_bits: Optional[Tensor], bits: int,
                            group_size: int, src: Tensor, shift: Optional[Tensor],
                            scale: Optional[Tensor], stat_block: int, stat_period: int,
                            offset: int, stride: int, seed: int) -> Tensor:
    """The CUDA entry's steps (cpp_ext/variance_cuda.cu): the variances, their one-row 1-bit
    codes (a one-width layout made on the device), one buffer."""
    slots = -(-src.numel() // stride)
    if slots == 0:
        return torch.empty(0, dtype=torch.uint8, device=src.device)
    torch.empty(1, slots, dtype=torch.float32, device=src.device)
    nbytes = (slots + 7) // 8
    torch.full((1,), 1, dtype=torch.uint8, device=src.device)
    torch.arange(0, 2 * nbytes, nbytes, dtype=torch.int64, device=src.device)
    data, vlo, vstep = _codes(1, slots, nbytes, _VARIANCE_GROUP, src.device)
    return torch.cat([vlo.view(-1).view(torch.uint8), vstep.view(-1).view(torch.uint8), data])


def rounding_variance_correct_(grad_in: Tensor, grad: Tensor, codes: Tensor, offset: int,
                               stride: int, scale: Optional[Tensor], stat_block: int,
                               stat_period: int, weight: Optional[Tensor], weight_block: int,
                               weight_period: int, divisor: float) -> Tensor:
    return grad_in


def attention_keep(n0: int, n1: int, r0: int, r1: int, cols: int, L: int, s1: int, s2: int,
                   threshold: int, device: Optional[torch.device] = None) -> Tensor:
    return torch.empty(n1 - n0, r1 - r0, cols, dtype=torch.bool, device=device)


def allocate_widths(score: Tensor, extra: float) -> Tensor:
    return torch.empty(score.shape[0], dtype=torch.uint8, device=score.device)


def range_statistic(x2d: Tensor, group_size: int) -> Tensor:
    return torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device)
