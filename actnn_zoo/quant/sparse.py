"""Sparse codes: a tensor with many exact zeros kept as a mask of its nonzeros plus codes of the
nonzeros only.

Why (docs/design.md, "ReLU reads its consumer's codes"): a ReLU output is about half zeros and
is saved twice in a plain zoo, as ReLU's 1-bit mask and as the next layer's 2-bit codes (3.125
bits per value). Sparse codes keep the mask, which is then the only thing ReLU needs, and spend
the codes on the nonzero values alone, with each group's range over its nonzeros: at half
zeros and 2 bits, 1 + 1 + 0.125 bits per value, with a finer step than plain codes. (Coding
zero as an exact level of plain codes instead, tried first, cost the positive values one
interval, about 2x the gradient error, and was removed.) Stochastic rounding among a
group's levels keeps them unbiased; zeros are exact.

CPU kernels (``cpp_ext/sparse_cpu.cpp``), bit-identical to
:func:`actnn_zoo.quant.reference.quantize_sparse`; other devices run that reference (torch ops):
correct, not fast. The capture store uses sparse codes for ReLU outputs on the CPU only;
elsewhere ReLUs keep their own masks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from .api import (Bits, _row_bits, as_rows, check_quantize_args, check_sample_bits, no_graph,
                  rows_out)
from .backend import kernels
from .tensor import SparseQuantizedTensor

__all__ = ["quantize_sparse", "dequantize_sparse", "dequantize_sparse_rows", "rows_decodable",
           "sparse_kernels"]


def sparse_kernels(device: torch.device):
    """The module whose ``quantize_sparse`` / ``dequantize_sparse`` run on ``device``: the
    compiled CPU kernels when built, else the torch reference."""
    k = kernels(device)
    if device.type == "cpu" and getattr(k, "quantize_sparse", None) is not None:
        return k
    return reference


def quantize_sparse(x: Tensor, bits: Bits = 2, group_size: int = 256,
                    seed: Optional[int] = None, rounding: str = "stochastic",
                    validate: Optional[bool] = None,
                    mask_out: Optional[Tensor] = None) -> SparseQuantizedTensor:
    """Compress ``x`` as a mask of ``x != 0`` plus ``bits``-wide codes of its nonzero values.

    ``bits``: 1, 2, 4 or 8, per-sample widths as a 1-d integer tensor, or
    :class:`~actnn_zoo.quant.SampleBits`; ``group_size``, ``seed`` and ``rounding`` as in
    :func:`~actnn_zoo.quant.quantize`. Each group of ``group_size`` positions has its range
    over its nonzero values only; NaN counts as nonzero (its group decodes to NaN), -0.0 as
    zero (decodes to +0.0). The result dequantizes to an unbiased estimate of ``x`` with the
    zeros exact; its ``mask`` is ``pack_mask(x != 0)`` in row-major order.

    ``mask_out``: a contiguous uint8 CPU tensor of ``ceil(x.numel() / 8)`` bytes the mask is
    written into (through its pointer: its version counter does not move) and which becomes the
    result's ``mask`` -- a ReLU node's buffer, read by its backward (``functional.activation``).
    Compiled CPU kernels only.
    """
    group_size, seed = check_quantize_args(x, group_size, rounding, seed)
    rows = as_rows(no_graph(x))
    n, d = rows.shape
    row_bits, _ = _row_bits(bits, n, x.device)
    check_sample_bits(bits, validate)
    k = sparse_kernels(x.device)
    if mask_out is not None and k is reference:
        raise ValueError("quantize_sparse: mask_out needs the compiled CPU kernels")
    data, lo, step, mask, offsets = k.quantize_sparse(
        rows.contiguous(), row_bits.contiguous(), group_size, seed & 0xFFFFFFFF,
        rounding == "stochastic", *(() if mask_out is None else (mask_out,)))
    return SparseQuantizedTensor(data, lo, step, mask, row_bits, offsets, x.shape, x.dtype,
                                 group_size)


def dequantize_sparse(q: SparseQuantizedTensor) -> Tensor:
    """Reconstruct a contiguous tensor of ``q``'s shape and dtype (zeros where the mask is
    clear)."""
    if not isinstance(q, SparseQuantizedTensor):
        raise TypeError(f"dequantize_sparse expects a SparseQuantizedTensor, got "
                        f"{type(q).__name__}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    sparse_kernels(q.device).dequantize_sparse(q.data, q.lo, q.step, q.mask, q.row_bits,
                                               q.offsets, q.group_size, as_rows(out))
    return out


def rows_decodable(q: SparseQuantizedTensor) -> bool:
    """Whether :func:`dequantize_sparse_rows` can decode ``q`` a few samples at a time: it has a
    sample dimension and each sample's mask bits fill whole bytes (values per sample a multiple
    of 8), so a range of samples is a range of the mask's bytes."""
    return len(q.shape) >= 2 and q.shape[1:].numel() % 8 == 0


def dequantize_sparse_rows(q: SparseQuantizedTensor, start: int, stop: int,
                           out: Optional[Tensor] = None) -> Tensor:
    """Samples ``start:stop`` of ``q`` decoded, as ``dequantize_sparse(q)[start:stop]`` (value
    for value) without decoding the others: what ``quant.dequantize_rows`` does for plain codes,
    so that a backward summing over samples (a conv's weight gradient) holds one chunk of its
    input at a time. Needs :func:`rows_decodable`; the codes are addressed through absolute row
    offsets, so nothing is copied."""
    if not isinstance(q, SparseQuantizedTensor):
        raise TypeError(f"dequantize_sparse_rows expects a SparseQuantizedTensor, got "
                        f"{type(q).__name__}")
    if not rows_decodable(q):
        raise ValueError(f"codes of shape {tuple(q.shape)} cannot be decoded by samples: the "
                         "values per sample must be a multiple of 8")
    out = rows_out(q, start, stop, out)
    if out.numel() == 0:
        return out
    row_bytes = q.shape[1:].numel() // 8
    sparse_kernels(q.device).dequantize_sparse(
        q.data, q.lo[start:stop], q.step[start:stop],
        q.mask[start * row_bytes:stop * row_bytes], q.row_bits[start:stop],
        q.offsets[start:stop + 1], q.group_size, as_rows(out))
    return out
