"""Pure-torch DIVISION kernels: the executable specification of ``compressor: division``.

DIVISION (Wang et al., ICLR 2023) splits a feature map into a low-frequency part, the average
over B x B blocks kept in 16 bits, and the high-frequency residual ``x - upsample(low)``,
quantized at 2 bits with one range per (sample, channel) map. This file fixes every rounding
so that the compiled kernels (``cpp_ext/division_cpu.cpp``, ``division_cuda.cu``) can match it
bit for bit; the rules differ from DIVISION's code where that made it biased or partial:

* **Layout.** ``x5`` is ``(N, C, D1, D2, D3)`` contiguous: a 1-D map ``(N, C, L)`` is passed as
  ``(N, C, 1, 1, L)``, a 2-D map as ``(N, C, 1, H, W)``. Any sizes: the blocks of a dim of
  size ``s`` are ``[kB, min((k + 1)B, s))``, so the last block of a ragged dim is shorter and
  its mean covers only its own values (DIVISION pads or skips such maps). A dim smaller than B
  is one block.
* **Low part.** Per block the sum in float64, divided by the block's element count in float64,
  rounded to float32, then to bfloat16 (round to nearest even). When every map is a single
  block (``has_low`` false, e.g. 8x8 maps at B = 8) the low part is not stored: the residual's
  per-map range equals the map's own range then, so the block mean would cost 16 bits per
  map and change nothing.
* **Residual.** ``r = x - float(low_bf16)`` in float32, computed from the *stored* low part
  (DIVISION subtracts the unrounded mean, then stores it rounded: the rounding error of the low
  part became a bias of the reconstruction).
* **Per-map metadata**, from the float32 min and max of ``r`` over the map: ``lo = min`` kept in
  float32 (exact, so a constant map has ``step = 0`` and is reconstructed exactly: with a low
  part, ``x - low`` and then ``low + r`` are exact by Sterbenz's lemma, low being within a
  bf16 rounding of x); ``step`` bfloat16, ``(max - lo) / (2^b - 1)`` rounded up, nudged up
  until ``lo + (2^b - 1) step >= max``, at least 2^-126 when positive. A map holding NaN or Inf
  gets ``lo = step = NaN`` (it reconstructs as NaN).
* **Codes** ``q = clamp(floor((r - lo) * (1 / step) + u), 0, 2^b - 1)``, ``u`` from the
  contract's counter hash of (seed, n * C * S + c * S + s) (:func:`reference.uniform_from_index`),
  packed like :mod:`actnn_zoo.quant.reference` (row n = sample n, one width per row, LSB first).
* **Reconstruction** ``x_hat = low + (lo + q * step)`` in float32. Given the stored low part,
  ``E[x_hat] = low + r = x`` up to float32 rounding: unbiased.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import (MIN_STEP, _bf16_step, pack_codes, quantize_codes, round_up_bf16,
                        unpack_codes)


def block_counts(sizes: Tuple[int, int, int], block: int) -> List[int]:
    """Blocks per spatial dim: ceil(s / block)."""
    return [-(-s // block) for s in sizes]


def _block_view(x: Tensor, block: int) -> Tuple[Tensor, List[int]]:
    """(N, C, D1, D2, D3) -> zero-padded (N, C, nb1, e1, nb2, e2, nb3, e3) with e = min(B, s)."""
    n, c, *s = x.shape
    e = [min(block, v) for v in s]
    nb = [-(-v // k) for v, k in zip(s, e)]
    pad: List[int] = []
    for v, k, m in zip(reversed(s), reversed(e), reversed(nb)):
        pad += [0, k * m - v]
    if any(pad):
        x = F.pad(x, pad)
    return x.reshape(n, c, nb[0], e[0], nb[1], e[1], nb[2], e[2]), e


def _counts(sizes: List[int], block: int, device: torch.device) -> Tensor:
    """Element count of each block, float64 (nb1, nb2, nb3)."""
    per_dim = []
    for s in sizes:
        k = torch.arange(-(-s // block), device=device, dtype=torch.float64)
        per_dim.append(torch.clamp(s - k * block, max=float(min(block, s))))
    return per_dim[0][:, None, None] * per_dim[1][None, :, None] * per_dim[2][None, None, :]


def low_part(x5: Tensor, block: int) -> Tensor:
    """Block means (N, C, nb1, nb2, nb3) bfloat16: float64 sum / count -> float32 -> bf16."""
    v, _ = _block_view(x5.to(torch.float64), block)
    sums = v.sum(dim=(3, 5, 7))
    mean = sums / _counts(list(x5.shape[2:]), block, x5.device)
    return mean.to(torch.float32).to(torch.bfloat16)


def upsample(low: Tensor, sizes: Tuple[int, ...], block: int) -> Tensor:
    """Each element gets its block's low value (float32, (N, C, D1, D2, D3))."""
    up = low.float()
    for dim, s in enumerate(sizes):
        up = up.repeat_interleave(min(block, s), dim=2 + dim).narrow(2 + dim, 0, s)
    return up


def map_metadata(r: Tensor, levels: Tensor) -> Tuple[Tensor, Tensor]:
    """Per (sample, channel) map: lo float32 (N, C) and step bfloat16 (N, C)."""
    n, c = r.shape[:2]
    flat = r.reshape(n, c, -1)
    mn, mx = flat.amin(dim=2), flat.amax(dim=2)
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    lo = torch.where(finite, mn, 0.0)
    top = torch.where(finite, mx, 0.0)
    lv = levels.to(torch.float32).unsqueeze(1)
    step = round_up_bf16((top - lo) / lv)
    for _ in range(2):
        short = (lo + lv * step.float()) < top
        step = torch.where(short, _bf16_step(step, torch.ones_like(short)), step)
    step = torch.where(step > 0, torch.clamp_min(step, MIN_STEP), step)
    bad = ~finite | ~torch.isfinite(step.float())
    lo = torch.where(bad, torch.full_like(lo, float("nan")), lo)
    step = torch.where(bad, torch.full_like(step, float("nan")), step)
    return lo, step


def residual(x5: Tensor, block: int, has_low: bool) -> Tuple[Tensor, Tensor]:
    """(low bf16 or an empty tensor, r = x - upsample(low) float32)."""
    x = x5.to(torch.float32)
    if not has_low:
        return torch.empty(0, dtype=torch.bfloat16, device=x5.device), x
    low = low_part(x5, block)
    return low, x - upsample(low, tuple(x5.shape[2:]), block)


# ----------------------------------------------------------------------------------------------
# The kernel interface (compiled twins: actnn_zoo._C.division_quantize / division_dequantize)
# ----------------------------------------------------------------------------------------------
def division_quantize(x5: Tensor, bits: Tensor, offsets: Tensor, total: int, block: int,
                      has_low: bool, seed: int, stochastic: bool
                      ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(N, C, D1, D2, D3) contiguous float -> (packed codes uint8 [total], low bf16
    (N, C, nb1, nb2, nb3) or empty, lo float32 (N, C), step bf16 (N, C))."""
    n, c = x5.shape[:2]
    s = x5.shape[2:].numel()
    levels = (1 << bits.to(torch.int64)) - 1
    low, r = residual(x5, block, has_low)
    lo, step = map_metadata(r, levels)
    codes = quantize_codes(r.reshape(n, c * s), lo, step, levels, s, seed, stochastic)
    return pack_codes(codes, bits, offsets, total), low, lo, step


def division_dequantize(data: Tensor, low: Tensor, lo: Tensor, step: Tensor, bits: Tensor,
                        offsets: Tensor, block: int, has_low: bool, out: Tensor) -> Tensor:
    """Inverse of :func:`division_quantize` into ``out`` (N, C, D1, D2, D3)."""
    n, c = out.shape[:2]
    s = out.shape[2:].numel()
    q = unpack_codes(data, bits, offsets, c * s).to(torch.float32).view(n, c, s)
    r = q * step.float().unsqueeze(2) + lo.unsqueeze(2)
    r = r.view(out.shape)
    if has_low:
        r = upsample(low, tuple(out.shape[2:]), block) + r
    out.copy_(r)
    return out
