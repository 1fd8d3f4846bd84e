"""``compressor: division``: DIVISION's dual-precision compression of feature maps.

DIVISION (Wang, Zha, Chen, Kang, Hu; "DIVISION: Memory Efficient Training via Dual Activation
Precision", ICLR 2023) keeps a feature map's low-frequency part (the mean over B x B blocks,
B = 8) in 16 bits and its high-frequency residual at 2 bits with one range per (sample,
channel) map: most of a feature map's energy is in the low part, so the residual's range, and
with it the rounding noise, is much smaller than the map's.

What we do differently (``division_reference.py`` has the exact rules):

* any map size (ragged edge blocks are averaged over their own values; DIVISION pads or skips
  maps that are not multiples of B), 1-D, 2-D and 3-D maps: tensors (N, C, L), (N, C, H, W)
  and (N, C, D, H, W);
* unbiased given the stored low part: the residual is taken against the *rounded* bf16 low part
  and the codes against the stored range, whereas DIVISION rounds after quantizing;
* maps that are one block (a map no larger than B in every dim) store no low part: the residual
  range equals the map's range then, so it would only cost bits;
* exact on constant maps (the range's lower bound is kept in float32);
* one fused kernel per call (pool, residual, range, codes; ``cpp_ext/division_cpu.cpp``);
* per-sample residual widths (1, 2, 4 or 8, a tensor or :class:`SampleBits`), so the
  precision strategies drive it like the plain quantizer.

Which tensors use it: :func:`compress` (the path of every Q-layer, ``functional/_saving.py``,
and of the capture store, tier 3) sends tensors with 3 to 5 dims, read as (N, C, *spatial), to
DIVISION when the layer's ``compressor`` is 'division' and a map holds at least
``MIN_MAP_VALUES`` (48) values; every other tensor (2-D activations, masks, a tier-3 tensor
stored in channels-last order, maps of fewer values) goes to the plain per-group quantizer. A
map's own range costs 48 bits (float32 lower bound, bf16 step): more than one bit per value
below 48 values (3 bits on a 4x4 map, against 0.125 for a 256-value group), and such a map is
one block, so DIVISION has no low part to keep there either (DIVISION's own code skips maps
smaller than its block).
A tensor of 3 to 5 dims that is not a feature map (attention's (B, heads, T, head_dim)) is
still compressed correctly and unbiased, with blocks over its trailing dims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import division_reference
from .api import (SUPPORTED_DTYPES, Bits, _capacity, _row_bits, check_sample_bits, dequantize,
                  dequantize_saved, draw_seed, masked_grad)
from .backend import kernels
from .reference import row_offsets, uniform_offsets
from .sparse import dequantize_sparse
from .tensor import CompressedPayload, MaskedPayload, QuantizedTensor, SparseQuantizedTensor

COMPRESSORS = ("quant", "division")
DEFAULT_BLOCK = 8
MAX_BLOCK = 64
SPATIAL_DIMS = (1, 2, 3)
# Smallest map (values per (sample, channel)) compressed with DIVISION (module doc).
MIN_MAP_VALUES = 48


def check_block(block: object, name: str = "division_block") -> int:
    """A block size: an integer in [1, MAX_BLOCK]."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"{name} must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    return block


def check_compressor(value: object, name: str = "compressor") -> str:
    if value not in COMPRESSORS:
        raise ValueError(f"{name} must be one of {COMPRESSORS}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class DivisionTensor(CompressedPayload):
    """A feature map compressed by DIVISION.

    ``data``: residual codes, row n (sample n, all its C maps) at byte ``offsets[n]``; ``low``:
    bfloat16 block means (N, C, *blocks), or an empty tensor when every map is one block;
    ``lo`` float32 and ``step`` bfloat16 (N, C): the residual's range per map. Per-sample
    widths keep ``row_bits`` and ``offsets`` as :class:`QuantizedTensor` does.
    """

    data: Tensor
    low: Tensor
    lo: Tensor
    step: Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: Optional[int]
    block: int
    row_bits: Optional[Tensor] = None
    offsets: Optional[Tensor] = None

    @property
    def has_low(self) -> bool:
        return self.low.numel() > 0

    def tensors(self) -> Tuple[Tensor, ...]:
        base = (self.data, self.low, self.lo, self.step)
        return base + (self.row_bits, self.offsets) if self.mixed else base

    def spec(self) -> tuple:
        return (self.shape, self.dtype, self.bits, self.block, self.mixed)

    @classmethod
    def rebuild(cls, spec: tuple, tensors: Tuple[Tensor, ...]) -> "DivisionTensor":
        shape, dtype, bits, block, mixed = spec
        if mixed:
            data, low, lo, step, row_bits, offsets = tensors
        else:
            (data, low, lo, step), row_bits, offsets = tensors, None, None
        return cls(data, low, lo, step, shape, dtype, bits, block, row_bits, offsets)

    def __repr__(self) -> str:
        width = "mixed" if self.mixed else f"{self.bits}"
        return (f"DivisionTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={width}, "
                f"block={self.block}, low={self.has_low}, nbytes={self.nbytes})")


Payload = Union[QuantizedTensor, DivisionTensor, SparseQuantizedTensor, MaskedPayload]


def as_5d(shape: torch.Size) -> Tuple[int, int, int, int, int]:
    """(N, C, *spatial) with 1 to 3 spatial dims -> (N, C, D1, D2, D3), leading 1s."""
    n, c, *s = shape
    s = [1] * (3 - len(s)) + list(s)
    return (n, c, s[0], s[1], s[2])


def has_low_part(shape: torch.Size, block: int) -> bool:
    """Whether some map has more than one block (else no low part is stored)."""
    return any(s > block for s in shape[2:])


def division_quantize(x: Tensor, bits: Bits = 2, block: int = DEFAULT_BLOCK,
                      seed: Optional[int] = None, rounding: str = "stochastic",
                      validate: Optional[bool] = None) -> DivisionTensor:
    """Compress a feature map (N, C, L), (N, C, H, W) or (N, C, D, H, W) with DIVISION.

    ``bits``: the residual's width, 1, 2, 4 or 8, or one per sample (a 1-d integer tensor or
    :class:`SampleBits`). ``block``: the low part's block edge B. ``seed`` / ``rounding`` /
    ``validate`` as in :func:`actnn_zoo.quant.quantize`. ``division_dequantize`` of the result
    is unbiased given the stored low part, and exact where a map is constant.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() - 2 not in SPATIAL_DIMS:
        raise ValueError(f"division compresses (N, C, L), (N, C, H, W) or (N, C, D, H, W) "
                         f"feature maps, got a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    block = check_block(block, "block")
    if rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    if seed is None:
        seed = draw_seed() if rounding == "stochastic" else 0
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    n = x.shape[0]
    d = x.shape[1:].numel()
    row_bits, uniform = _row_bits(bits, n, x.device)
    check_sample_bits(bits, validate)
    offsets = row_offsets(d, row_bits) if uniform is None \
        else uniform_offsets(n, d, uniform, x.device)
    has_low = has_low_part(x.shape, block)
    shape5 = as_5d(x.shape)
    if x.numel() == 0:
        nb = division_reference.block_counts(shape5[2:], block)
        data = torch.empty(0, dtype=torch.uint8, device=x.device)
        low = torch.empty((n, x.shape[1], *nb) if has_low else (0,), dtype=torch.bfloat16,
                          device=x.device)
        lo = torch.empty(n, x.shape[1], dtype=torch.float32, device=x.device)
        step = torch.empty(n, x.shape[1], dtype=torch.bfloat16, device=x.device)
    else:
        total = _capacity(bits, offsets, n, d) if uniform is None \
            else n * ((d * uniform + 7) // 8)
        fn = _kernel(x.device, "division_quantize")
        data, low, lo, step = fn(x.detach().contiguous().view(shape5), row_bits, offsets, total,
                                 block, has_low, seed & 0xFFFFFFFF, rounding == "stochastic")
    if has_low:
        low = low.view(*x.shape[:2], *low.shape[2 + 3 - (x.dim() - 2):])
    if uniform is None:
        return DivisionTensor(data, low, lo, step, x.shape, x.dtype, None, block, row_bits,
                              offsets)
    return DivisionTensor(data, low, lo, step, x.shape, x.dtype, uniform, block)


def division_dequantize(q: DivisionTensor) -> Tensor:
    """Reconstruct ``low + residual`` in ``q``'s shape and dtype (contiguous)."""
    if not isinstance(q, DivisionTensor):
        raise TypeError(f"division_dequantize expects a DivisionTensor, got {type(q).__name__}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    n = q.shape[0]
    d = q.shape[1:].numel()
    if q.mixed:
        row_bits, offsets = q.row_bits, q.offsets
    else:
        row_bits = torch.full((n,), q.bits, dtype=torch.uint8, device=q.device)
        offsets = uniform_offsets(n, d, q.bits, q.device)
    shape5 = as_5d(q.shape)
    low = q.low.reshape(*shape5[:2], *division_reference.block_counts(shape5[2:], q.block)) \
        if q.has_low else q.low
    _kernel(q.device, "division_dequantize")(q.data, low, q.lo, q.step, row_bits, offsets,
                                             q.block, q.has_low, out.view(shape5))
    return out


def _kernel(device: torch.device, name: str):
    """The compiled kernel, or the reference when the backend is the reference or the build
    predates these kernels (the same results, slower)."""
    fn = getattr(kernels(device), name, None)
    return fn if fn is not None else getattr(division_reference, name)


# ----------------------------------------------------------------------------------------------
# The one compression entry point the layers and the capture store share
# ----------------------------------------------------------------------------------------------
def uses_division(x: Tensor, compressor: str, maps: Optional[bool] = None) -> bool:
    """Whether :func:`compress_payload` sends ``x`` to DIVISION: the compressor is 'division',
    ``x`` is laid out as feature maps (N, C, *spatial) and its maps hold at least
    ``MIN_MAP_VALUES`` values.

    ``maps`` is what the saving layer knows of the layout. True: channels-first maps (a conv's
    or batch norm's input), 3 to 5 dims qualify. False: features last (a Linear's input, a
    layer norm's, attention's q/k/v, a softmax over its last dim), never: DIVISION's block
    means over (T, C) or (T, E) would average unrelated features, and its per-(sample,
    channel) range would span a whole sequence (on the text transformer that cost 6x uniform's
    gradient variance and half the compression). None, unknown (element-wise layers, tensors
    captured by tier 3): 4 and 5 dims qualify, read as images and volumes; a 3-D tensor is
    as likely (B, T, C) as (N, C, L) and takes the group quantizer."""
    if compressor != "division" or maps is False:
        return False
    lowest = 3 if maps else 4
    return lowest <= x.dim() <= 5 and x.shape[2:].numel() >= MIN_MAP_VALUES


def decompress(payload: Payload) -> Tensor:
    """Dequantize any payload kind."""
    if type(payload) is QuantizedTensor:  # the common case first: one check per saved input
        if payload.transform == "none":
            return dequantize_saved(payload)
        return dequantize(payload)
    if isinstance(payload, DivisionTensor):
        return division_dequantize(payload)
    if isinstance(payload, SparseQuantizedTensor):
        return dequantize_sparse(payload)
    if isinstance(payload, MaskedPayload):  # a dropout's output: its input's codes, masked
        kept = masked_grad(dequantize(payload.source), payload.mask, payload.scale, 0.0)
        return kept.reshape(payload.view_shape)
    return dequantize(payload)
