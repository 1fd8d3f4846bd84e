"""Pure-torch quantization kernels: the executable specification.

The compiled kernels (``cpp_ext/``) must produce bit-identical codes and metadata to these
functions for the same inputs and seed. Every step below is written as one fp32 operation at a
time (no fused multiply-add) so that C++ compiled with ``-ffp-contract=off`` can match it.

Layout (see docs/design.md, the quantization contract):

* ``x2d`` is ``(N, D)``: row ``n`` is sample ``n``. Each row is cut into ``G = ceil(D / group_size)``
  groups; the last group of a row may be shorter and its range covers only its own values.
* ``lo`` and ``step`` are bfloat16 ``(N, G)``. ``lo`` is the group minimum rounded down and ``step``
  the range over ``2^b - 1`` rounded up, then nudged up until ``lo + (2^b - 1) * step >= max`` in
  fp32, and raised to at least 2^-126 when positive (so 1 / step is finite). A group holding NaN or +-Inf gets ``lo = step = NaN`` (it dequantizes to NaN).
* Codes ``q = clamp(floor((x - lo) * (1 / step) + u), 0, 2^b - 1)`` with ``u`` from the counter hash
  below (``u = 0.5`` for round-to-nearest), computed from the *stored* bf16 ``lo`` and ``step``.
* Row ``n`` with ``b_n`` bits is packed LSB-first, ``8 / b_n`` codes per byte, into
  ``ceil(D * b_n / 8)`` bytes starting at byte ``offsets[n]`` of one uint8 buffer.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .hash32 import C1 as _C1
from .hash32 import M32 as _M32
from .hash32 import fmix32 as _fmix32
from .hash32 import fmix32_int, mul32 as _mul32

GOLDEN = 0x9E3779B9
MIN_STEP = 2.0 ** -126  # smallest normal float32, exactly representable in bfloat16


# ----------------------------------------------------------------------------------------------
# Counter-based random numbers
# ----------------------------------------------------------------------------------------------
def seed_key(seed: int) -> int:
    """The 32-bit key every backend derives from a user seed."""
    return fmix32_int((seed & _M32) + GOLDEN)


def uniform_from_index(index: Tensor, seed: int) -> Tensor:
    """u in [0, 1) as float32, a pure function of (seed, element index).

    ``h = fmix32(lo32(i) ^ key ^ (hi32(i) * 0x85EBCA6B))``, ``u = (h >> 8) * 2^-24``.
    """
    key = seed_key(seed)
    hi = _mul32(index >> 32, _C1)
    h = _fmix32((index & _M32) ^ key ^ hi)
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


# ----------------------------------------------------------------------------------------------
# Directed rounding to bfloat16
# ----------------------------------------------------------------------------------------------
def _bf16_step(b: Tensor, toward_larger: Tensor) -> Tensor:
    """Move bf16 values one ulp up (toward_larger) or down, through their bit patterns."""
    bits = b.view(torch.int16)
    negative = bits < 0
    # Moving up means: a smaller magnitude for negatives, a larger one for positives.
    delta = torch.where(toward_larger ^ negative, 1, -1).to(torch.int16)
    return (bits + delta).view(torch.bfloat16)


def round_down_bf16(v: Tensor) -> Tensor:
    """Largest bfloat16 value <= v (v float32, finite or not; NaN stays NaN)."""
    b = v.to(torch.bfloat16)
    wrong = b.float() > v
    return torch.where(wrong, _bf16_step(b, torch.zeros_like(wrong)), b)


def round_up_bf16(v: Tensor) -> Tensor:
    """Smallest bfloat16 value >= v."""
    b = v.to(torch.bfloat16)
    wrong = b.float() < v
    return torch.where(wrong, _bf16_step(b, torch.ones_like(wrong)), b)


# ----------------------------------------------------------------------------------------------
# Metadata and codes
# ----------------------------------------------------------------------------------------------
def _grouped(x2d: Tensor, group_size: int, fill: float) -> Tensor:
    n, d = x2d.shape
    g = -(-d // group_size)
    pad = g * group_size - d
    if pad:
        x2d = torch.nn.functional.pad(x2d, (0, pad), value=fill)
    return x2d.view(n, g, group_size)


def group_metadata(x2d: Tensor, levels: Tensor, group_size: int) -> Tuple[Tensor, Tensor]:
    """Per-group (lo, step) in bfloat16 for float32 ``x2d`` (N, D) and per-row ``levels`` (N,)."""
    mn = _grouped(x2d, group_size, float("inf")).amin(dim=2)
    mx = _grouped(x2d, group_size, float("-inf")).amax(dim=2)
    return _range_metadata(mn, mx, levels.to(torch.float32).unsqueeze(1))


def _range_metadata(mn: Tensor, mx: Tensor, lv: Tensor) -> Tuple[Tensor, Tensor]:
    """(lo, step) in bfloat16 for group minima/maxima ``mn``/``mx`` (N, G) and ``lv`` intervals."""
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    lo = round_down_bf16(torch.where(finite, mn, 0.0))
    lo_f = lo.float()
    step = round_up_bf16((mx.where(finite, 0.0) - lo_f) / lv)
    for _ in range(2):
        short = (lo_f + lv * step.float()) < mx.where(finite, 0.0)
        step = torch.where(short, _bf16_step(step, torch.ones_like(short)), step)
    # A denormal step would make 1 / step overflow: use at least the smallest normal float32.
    step = torch.where(step > 0, torch.clamp_min(step, MIN_STEP), step)
    bad = ~finite | ~torch.isfinite(step.float())
    nan = torch.tensor(float("nan"), dtype=torch.bfloat16, device=mn.device)
    return torch.where(bad, nan, lo), torch.where(bad, nan, step)


def _expand(meta: Tensor, d: int, group_size: int) -> Tensor:
    """(N, G) per-group values -> (N, D) per-element float32 values."""
    return meta.float().repeat_interleave(group_size, dim=1)[:, :d]


def quantize_codes(x2d: Tensor, lo: Tensor, step: Tensor, levels: Tensor, group_size: int,
                   seed: int, stochastic: bool) -> Tensor:
    """Integer codes (N, D) as uint8 from float32 x and the stored metadata."""
    n, d = x2d.shape
    lo_e = _expand(lo, d, group_size)
    step_e = _expand(step, d, group_size)
    inv = torch.where(step_e > 0, 1.0 / step_e, torch.zeros_like(step_e))
    t = (x2d - lo_e) * inv
    if stochastic:
        index = torch.arange(n * d, device=x2d.device, dtype=torch.int64).view(n, d)
        t = t + uniform_from_index(index, seed)
    else:
        t = t + 0.5
    q = torch.floor(t)
    q = torch.nan_to_num(q, nan=0.0)
    q = torch.minimum(torch.clamp_min(q, 0.0), levels.to(torch.float32).unsqueeze(1))
    return q.to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------
def row_nbytes(d: int, bits: Tensor) -> Tensor:
    """Bytes one row of ``d`` codes takes at each row's width (int64, same shape as bits)."""
    return (bits.to(torch.int64) * d + 7) // 8


def row_offsets(d: int, bits: Tensor) -> Tensor:
    """Byte offset of each row in the packed buffer: (N + 1,) int64, last entry = total bytes."""
    sizes = row_nbytes(d, bits)
    return torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])


def _pack_rows(codes: Tensor, b: int) -> Tensor:
    """(k, D) uint8 codes of width b -> (k, ceil(D*b/8)) packed bytes, LSB first."""
    per = 8 // b
    k, d = codes.shape
    nb = (d * b + 7) // 8
    pad = nb * per - d
    c = torch.nn.functional.pad(codes, (0, pad)) if pad else codes
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * b
    return (c.view(k, nb, per).to(torch.int32) << shifts).sum(-1).to(torch.uint8)


def _unpack_rows(packed: Tensor, b: int, d: int) -> Tensor:
    per = 8 // b
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * b
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << b) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :d].to(torch.uint8)


def _row_byte_index(offsets: Tensor, rows: Tensor, nb: int) -> Tensor:
    return offsets[rows].unsqueeze(1) + torch.arange(nb, device=offsets.device)


def pack_codes(codes: Tensor, bits: Tensor, offsets: Tensor, total: int) -> Tensor:
    n, d = codes.shape
    out = torch.zeros(total, dtype=torch.uint8, device=codes.device)
    for b in (1, 2, 4, 8):
        rows = (bits == b).nonzero().flatten()
        if rows.numel():
            packed = _pack_rows(codes[rows], b)
            out[_row_byte_index(offsets, rows, packed.shape[1])] = packed
    return out


def unpack_codes(data: Tensor, bits: Tensor, offsets: Tensor, d: int) -> Tensor:
    n = bits.shape[0]
    codes = torch.zeros(n, d, dtype=torch.uint8, device=data.device)
    for b in (1, 2, 4, 8):
        rows = (bits == b).nonzero().flatten()
        if rows.numel():
            nb = (d * b + 7) // 8
            codes[rows] = _unpack_rows(data[_row_byte_index(offsets, rows, nb)], b, d)
    return codes


# ----------------------------------------------------------------------------------------------
# The kernel interface every backend implements
# ----------------------------------------------------------------------------------------------
def quantize(x2d: Tensor, bits: Tensor, offsets: Tensor, total: int, group_size: int, seed: int,
             stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(N, D) contiguous float tensor -> (packed uint8 data, lo bf16 (N, G), step bf16 (N, G))."""
    x = x2d.to(torch.float32)
    levels = (1 << bits.to(torch.int64)) - 1
    lo, step = group_metadata(x, levels, group_size)
    codes = quantize_codes(x, lo, step, levels, group_size, seed, stochastic)
    return pack_codes(codes, bits, offsets, total), lo, step


def dequantize(data: Tensor, lo: Tensor, step: Tensor, bits: Tensor, offsets: Tensor,
               group_size: int, out: Tensor) -> Tensor:
    """Inverse of :func:`quantize` into ``out`` (N, D): ``q * step + lo`` in float32, cast."""
    d = out.shape[1]
    q = unpack_codes(data, bits, offsets, d).to(torch.float32)
    st = _expand(step, d, group_size)
    lo_e = _expand(lo, d, group_size)
    out.copy_(q * st + lo_e)
    return out


def _channel_sums(grad: Tensor, data: Tensor, lo: Tensor, step: Tensor, bits: Tensor,
                  offsets: Tensor, group_size: int) -> Tuple[Tensor, ...]:
    """(x_hat decoded (N, C, S), grad and x_hat in float64, per channel sum g, sum g * x_hat)
    for ``grad`` (N, C, S): what batch and group norm's backward share."""
    n, c, s = grad.shape
    x = dequantize(data, lo, step, bits, offsets, group_size,
                   torch.empty(n, c * s, dtype=torch.float32, device=grad.device)).view(n, c, s)
    g64, x64 = grad.double(), x.double()
    return x, g64, x64, g64.sum((0, 2)), (g64 * x64).sum((0, 2))


def batch_norm_backward_codes(grad: Tensor, data: Tensor, lo: Tensor, step: Tensor,
                              bits: Tensor, offsets: Tensor, group_size: int, invstd: Tensor,
                              weight: Optional[Tensor], need_input: bool
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """Training batch norm's backward from the codes of x_hat: ``grad`` (N, C, S) float32, the
    codes of rows of C * S values. Per channel over its m = N * S values: gb = sum g,
    gw = sum g * x_hat, gi = (g - gb / m - x_hat * gw / m) * invstd * weight (the formula of
    ``native_batch_norm_backward`` written in x_hat). Sums in float64 here; the kernel's are
    float32 lanes added in float64, so the two agree to float rounding, not bit for bit."""
    n, c, s = grad.shape
    x, g64, x64, gb, gw = _channel_sums(grad, data, lo, step, bits, offsets, group_size)
    gi = None
    if need_input:
        m = float(n * s)
        scale = invstd if weight is None else invstd * weight
        gi = ((grad - (gb / m).float()[:, None]) - x * (gw / m).float()[:, None]) \
            * scale[:, None]
    return gi, gw.float(), gb.float()


def layer_norm_backward_codes(grad: Tensor, data: Tensor, lo: Tensor, step: Tensor,
                              bits: Tensor, offsets: Tensor, group_size: int, rstd: Tensor,
                              weight: Optional[Tensor], need_input: bool
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """Layer norm's backward from the codes of x_hat: ``grad`` (R, F) float32, R a multiple of
    the N coded rows (each of R / N * F values). Per row, with wg = g * weight:
    gi = (wg - mean(wg) - x_hat * mean(wg * x_hat)) * rstd; over rows gw = sum g * x_hat,
    gb = sum g (``native_layer_norm_backward``'s formula written in x_hat; float64 sums)."""
    r, f = grad.shape
    n = bits.shape[0]
    x = dequantize(data, lo, step, bits, offsets, group_size,
                   torch.empty(n, r // max(n, 1) * f, dtype=torch.float32,
                               device=grad.device)).view(r, f)
    g64, x64 = grad.double(), x.double()
    gb, gw = g64.sum(0), (g64 * x64).sum(0)
    gi = None
    if need_input:
        wg = g64 if weight is None else g64 * weight.double()
        gi = ((wg - wg.mean(1, keepdim=True) - x64 * (wg * x64).mean(1, keepdim=True))
              * rstd.double()[:, None]).float()
    return gi, gw.float(), gb.float()


def group_norm_backward_codes(grad: Tensor, data: Tensor, lo: Tensor, step: Tensor,
                              bits: Tensor, offsets: Tensor, group_size: int, rstd: Tensor,
                              weight: Optional[Tensor], need_input: bool, groups: int
                              ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """Group norm's backward from the codes of x_hat: ``grad`` (N, C, S) float32, ``rstd``
    (N * groups,). Per (sample, group) row, with wg = g * weight[channel]: gi = (wg - mean(wg)
    - x_hat * mean(wg * x_hat)) * rstd; per channel gw = sum g * x_hat, gb = sum g
    (``native_group_norm_backward``'s formula written in x_hat; float64 sums)."""
    n, c, s = grad.shape
    _, g64, x64, gb, gw = _channel_sums(grad, data, lo, step, bits, offsets, group_size)
    gi = None
    if need_input:
        wg = g64 if weight is None else g64 * weight.double()[:, None]
        rows, xr = wg.reshape(n, groups, -1), x64.reshape(n, groups, -1)
        gi = ((rows - rows.mean(2, keepdim=True) - xr * (rows * xr).mean(2, keepdim=True))
              * rstd.double().view(n, groups, 1)).float().view(n, c, s)
    return gi, gw.float(), gb.float()


def uniform_offsets(n: int, d: int, bits: int, device: torch.device, first: int = 0) -> Tensor:
    """:func:`row_offsets` for one width, rows back to back from row ``first``: one arange (the
    general cumsum costs five small ops)."""
    rb = (d * bits + 7) // 8
    if rb == 0:
        return torch.zeros(n + 1, dtype=torch.int64, device=device)
    return torch.arange(first * rb, (first + n + 1) * rb, rb, dtype=torch.int64, device=device)


def _uniform_layout(n: int, d: int, bits: int, first: int, device: torch.device
                    ) -> Tuple[Tensor, Tensor]:
    """One width for every row, rows back to back from row ``first``: (widths, offsets)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    return (torch.full((n,), bits, dtype=torch.uint8, device=device),
            uniform_offsets(n, d, bits, device, first))


def contract_rows(shape: Sequence[int]) -> Tuple[int, int]:
    """(N, D) of the contract's row view of a tensor of ``shape``: dim 0 is the sample, the
    rest one row; a 0-d or 1-d tensor is one row."""
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    return shape[0], math.prod(shape[1:])


def quantize_uniform(x: Tensor, bits: int, group_size: int, seed: int, stochastic: bool
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`quantize` with one width for every row (``N * ceil(D * bits / 8)`` bytes) of
    ``x``, any shape, read as the contract's rows (:func:`contract_rows`)."""
    n, d = contract_rows(x.shape)
    row_bits, offsets = _uniform_layout(n, d, bits, 0, x.device)
    return quantize(x.reshape(n, d), row_bits, offsets, n * ((d * bits + 7) // 8), group_size,
                    seed, stochastic)


def dequantize_uniform(data: Tensor, lo: Tensor, step: Tensor, bits: int, group_size: int,
                       first: int, out: Tensor) -> Tensor:
    """:func:`dequantize` of rows ``first:first + N`` of one-width codes into ``out`` (any
    contiguous shape of N rows, as :func:`quantize_uniform` reads its input)."""
    n, d = contract_rows(out.shape)
    if first < 0 or first + n > lo.shape[0] or first + n > step.shape[0]:
        raise ValueError(f"rows {first}:{first + n} are not rows of lo/step {tuple(lo.shape)}")
    row_bits, offsets = _uniform_layout(n, d, bits, first, out.device)
    dequantize(data, lo[first:first + n], step[first:first + n], row_bits, offsets,
               group_size, out.view(n, d))
    return out


def pack_mask(mask: Tensor) -> Tensor:
    """Flat bool tensor -> ceil(n / 8) bytes, element i at bit i % 8 of byte i // 8."""
    n = mask.numel()
    return _pack_rows(mask.reshape(1, n).to(torch.uint8), 1).reshape(-1)


COMPARE_KINDS = ("not_le", "gt", "between")  # kind codes 0, 1, 2 of pack_compare


def compare(x: Tensor, kind: int, lo: float, hi: float) -> Tensor:
    """The predicate of :func:`pack_compare` as a bool tensor of ``x``'s shape."""
    if kind == 0:
        return ~(x <= lo)
    if kind == 1:
        return x > lo
    return (x > lo) & (x < hi)


def pack_compare(x: Tensor, kind: int, lo: float, hi: float) -> Tensor:
    """``pack_mask`` of a comparison of a flat contiguous float tensor: kind 0 ``!(x <= lo)``,
    1 ``x > lo``, 2 ``lo < x < hi`` (``lo``/``hi`` exactly representable in ``x``'s dtype)."""
    return pack_mask(compare(x, kind, lo, hi))


def unpack_mask(packed: Tensor, numel: int) -> Tensor:
    return _unpack_rows(packed.reshape(1, -1), 1, numel).reshape(-1).bool()


# ----------------------------------------------------------------------------------------------
# Sparse codes: a mask of the nonzeros plus codes of the nonzeros only
# ----------------------------------------------------------------------------------------------
def _sparse_layout(nz: Tensor, bits: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(code index of each element within its row (N, D) int64, nonzeros per row (N,),
    row byte offsets (N + 1,)) for the nonzero mask ``nz`` and per-row widths."""
    count = nz.sum(1)
    cidx = torch.cumsum(nz.to(torch.int64), 1) - 1
    nbytes = (count * bits.to(torch.int64) + 7) // 8
    return cidx, count, torch.cat([nbytes.new_zeros(1), torch.cumsum(nbytes, 0)])


def quantize_sparse(x2d: Tensor, bits: Tensor, group_size: int, seed: int, stochastic: bool
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(N, D) float tensor -> (data uint8, lo bf16 (N, G), step bf16 (N, G), mask uint8,
    offsets int64 (N + 1)): the sparse-codes layout.

    * ``mask``: :func:`pack_mask` of ``x2d != 0`` in row-major order (NaN counts as nonzero;
      +-0.0 as zero).
    * Groups are ``group_size`` consecutive positions of a row, as in :func:`quantize`, but
      their range (``lo``, ``step``, rounded like :func:`group_metadata`) covers only their
      nonzero values; a group without nonzeros has ``lo = step = 0``; one holding NaN or +-Inf
      has ``lo = step = NaN`` and codes 0.
    * Row ``n`` packs the codes of its nonzeros only, in order, ``bits[n]`` each, LSB first, in
      ``ceil(count_n * bits[n] / 8)`` bytes from ``offsets[n]``. Codes are those of
      :func:`quantize_codes` with the groups' metadata (a value's random number is drawn at its
      position ``n * D + j``, as in :func:`quantize`).
    """
    x = x2d.to(torch.float32)
    n, d = x.shape
    nz = x != 0
    levels = ((1 << bits.to(torch.int64)) - 1).to(torch.float32).unsqueeze(1)
    inf = float("inf")
    mn = _grouped(torch.where(nz, x, inf), group_size, inf).amin(dim=2)
    mx = _grouped(torch.where(nz, x, -inf), group_size, -inf).amax(dim=2)
    empty = (mn == inf) & (mx == -inf)
    lo, step = _range_metadata(mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0), levels)
    cidx, count, offsets = _sparse_layout(nz, bits)
    q = quantize_codes(x, lo, step, levels.squeeze(1).to(torch.int64), group_size, seed,
                       stochastic)
    # compact each row's codes to its front, then pack rows of each width
    compact = torch.zeros(n, d, dtype=torch.uint8, device=x.device)
    rows = torch.arange(n, device=x.device).unsqueeze(1).expand(n, d)
    compact[rows[nz], cidx[nz]] = q[nz]
    data = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=x.device)
    for b in (1, 2, 4, 8):
        sel = (bits == b).nonzero().flatten()
        if sel.numel() == 0 or d == 0:
            continue
        packed = _pack_rows(compact[sel], b)  # (k, ceil(D * b / 8)), zero past each row's codes
        nb = (count[sel] * b + 7) // 8
        j = torch.arange(packed.shape[1], device=x.device)
        keep = j.unsqueeze(0) < nb.unsqueeze(1)
        data[(offsets[sel].unsqueeze(1) + j)[keep]] = packed[keep]
    return data, lo, step, pack_mask(nz.reshape(-1)), offsets


def dequantize_sparse(data: Tensor, lo: Tensor, step: Tensor, mask: Tensor, bits: Tensor,
                      offsets: Tensor, group_size: int, out: Tensor) -> Tensor:
    """Inverse of :func:`quantize_sparse` into ``out`` (N, D): 0 where the mask is clear, else
    ``q * step + lo`` in float32 (the k-th code of the row for its k-th nonzero), cast."""
    n, d = out.shape
    nz = unpack_mask(mask, n * d).view(n, d)
    cidx, count, _ = _sparse_layout(nz, bits)
    codes = torch.zeros(n, d, dtype=torch.uint8, device=out.device)
    padded = torch.cat([data, data.new_zeros(d + 8)])  # a row's last bytes may be read whole
    for b in (1, 2, 4, 8):
        sel = (bits == b).nonzero().flatten()
        if sel.numel() == 0 or d == 0:
            continue
        nb = (d * b + 7) // 8
        codes[sel] = _unpack_rows(padded[_row_byte_index(offsets, sel, nb)], b, d)
    q = torch.gather(codes, 1, cidx.clamp_min(0)).to(torch.float32)
    val = q * _expand(step, d, group_size) + _expand(lo, d, group_size)
    out.copy_(torch.where(nz, val, torch.zeros((), dtype=torch.float32, device=out.device)))
    return out
