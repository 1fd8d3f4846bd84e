"""Pooling Functions: max-pools save the argmax position inside each window, bit-packed;
average pools (and every other op that is linear in its input) save nothing but shapes.

Max-pool: torch saves the input and int64 indices (8 bytes per output value). The argmax
only needs to be located inside its window, which takes ``ceil(log2(window volume))`` bits
(2x2 -> 2 bits, 3x3 -> 4 bits, 3x3x3 -> 5 bits; a 1-element window -> nothing). The codes are
stored as that many bit planes, each packed at 1 bit per value with :func:`pack_mask`, so any
width costs exactly ``ceil(nbits * numel_out / 8)`` bytes. Backward rebuilds torch's flat
indices from (window start + code) and hands them to torch's public max-pool backward op.
Adaptive max-pool windows vary in size; codes are laid out on the largest window.

Average pools: torch's AvgPool/AdaptiveAvgPool backward keeps the whole input alive only to
read its shape. Their backward does not depend on the input values, so ``grad_in`` is taken
as the vector-Jacobian product of the same op at a zero input of the right shape (exact and
public; it costs one extra forward on zeros in backward).
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import pack_mask, unpack_mask
from ._saving import load, save
from ._autocast import autocast_on, no_autocast
from .activation import _autocast_state, from_memory_order, memory_perm, to_memory_order

__all__ = ["MaxPoolFunction", "ShapeOnlyFunction", "max_pool1d", "max_pool2d", "max_pool3d",
           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool1d",
           "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "adaptive_avg_pool3d", "code_bits", "pack_codes", "unpack_codes", "WindowCodeMaxPool2d"]

IntOrTuple = Union[int, Sequence[int]]

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_ADAPTIVE_MAX_POOL = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d,
                      3: F.adaptive_max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _ntuple(v: Optional[IntOrTuple], nd: int, name: str) -> Tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * nd
    t = tuple(int(i) for i in v)
    if len(t) == 1:
        return t * nd
    if len(t) != nd:
        raise ValueError(f"{name} must be an int or a tuple of {nd} ints, got {v!r}")
    return t


# ----------------------------------------------------------------------------------------------
# Argmax-in-window codes
# ----------------------------------------------------------------------------------------------
def code_bits(volume: int) -> int:
    """Bits needed to tell ``volume`` window positions apart: ceil(log2(volume))."""
    return max(volume - 1, 0).bit_length()


def _code_dtype(nbits: int) -> torch.dtype:
    return torch.uint8 if nbits <= 8 else torch.int32


def pack_codes(codes: Tensor, nbits: int) -> Tensor:
    """Non-negative integer codes < 2**nbits -> ``ceil(nbits * numel / 8)`` bytes (bit planes)."""
    flat = codes.reshape(-1)
    if nbits == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    planes = torch.empty(nbits, flat.numel(), dtype=torch.bool, device=codes.device)
    for j in range(nbits):
        planes[j] = torch.bitwise_and(flat, 1 << j).bool()  # (ne(., 0) is far slower on CPU)
    return pack_mask(planes)


def unpack_codes(packed: Tensor, nbits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_codes`: codes of length ``numel`` (uint8 up to 8 bits, else
    int32)."""
    codes = torch.zeros(numel, dtype=_code_dtype(nbits), device=packed.device)
    if nbits == 0:
        return codes
    planes = unpack_mask(packed, (nbits, numel))
    for j in range(nbits):
        codes.add_(planes[j], alpha=1 << j)
    return codes


def _starts(kind: str, out_sizes: Sequence[int], in_sizes: Sequence[int],
            stride: Sequence[int], padding: Sequence[int], device: torch.device) -> List[Tensor]:
    """First input coordinate of each output window, per spatial dim."""
    starts = []
    for j, o in enumerate(out_sizes):
        r = torch.arange(o, device=device, dtype=torch.int64)
        if kind == "max":
            starts.append(r * stride[j] - padding[j])
        else:  # adaptive: floor(o * I / O)
            starts.append(torch.div(r * in_sizes[j], o, rounding_mode="floor"))
    return starts


def _bshape(nd: int, j: int, size: int) -> List[int]:
    shape = [1] * nd
    shape[j] = size
    return shape


def _indices_to_codes(idx: Tensor, in_sizes: Sequence[int], starts: List[Tensor],
                      dilation: Sequence[int], window: Sequence[int]) -> Tensor:
    """torch's flat spatial indices -> position inside the window (row-major over ``window``)."""
    nd = len(in_sizes)
    coords: List[Tensor] = [idx] * nd
    rem = idx
    for j in reversed(range(1, nd)):
        coords[j] = torch.remainder(rem, in_sizes[j])
        rem = torch.div(rem, in_sizes[j], rounding_mode="floor")
    coords[0] = rem
    code: Optional[Tensor] = None
    for j in range(nd):
        rel = coords[j] - starts[j].view(_bshape(nd, j, starts[j].numel()))
        if dilation[j] != 1:
            rel = torch.div(rel, dilation[j], rounding_mode="floor")
        code = rel if code is None else code * window[j] + rel
    return code


def _codes_to_indices(code: Tensor, in_sizes: Sequence[int], starts: List[Tensor],
                      dilation: Sequence[int], window: Sequence[int]) -> Tensor:
    nd = len(in_sizes)
    rels: List[Tensor] = [code] * nd
    rem = code
    for j in reversed(range(1, nd)):
        rels[j] = torch.remainder(rem, window[j])
        rem = torch.div(rem, window[j], rounding_mode="floor")
    rels[0] = rem
    flat: Optional[Tensor] = None
    for j in range(nd):
        c = starts[j].view(_bshape(nd, j, starts[j].numel())) + rels[j] * dilation[j]
        flat = c if flat is None else flat * in_sizes[j] + c
    return flat


def _permuted(shape: Sequence[int], perm: Optional[Tuple[int, ...]]) -> Tuple[int, ...]:
    return tuple(shape) if perm is None else tuple(shape[p] for p in perm)


def _prod(s: Sequence[int]) -> int:
    p = 1
    for v in s:
        p *= int(v)
    return p


def _window_offsets(in_sizes: Sequence[int], dilation: Sequence[int],
                    window: Sequence[int]) -> List[int]:
    """Flat-index offset of each window position from the window's first position, in code
    (row-major) order."""
    offs = [0]
    for j in range(len(in_sizes)):
        step = dilation[j] * _prod(in_sizes[j + 1:])
        offs = [o + k * step for o in offs for k in range(window[j])]
    return offs


def _window_base(starts: List[Tensor], in_sizes: Sequence[int], lead: int) -> Tensor:
    """Flat index of each window's first position (may lie in the padding), shaped to
    broadcast against torch's indices (``lead`` leading batch/channel dims)."""
    nd = len(in_sizes)
    base: Optional[Tensor] = None
    for j in range(nd):
        sj = starts[j].view(_bshape(nd, j, starts[j].numel()))
        base = sj if base is None else base * in_sizes[j] + sj
    return base.view((1,) * lead + tuple(base.shape))


class _Positions:
    """Converts torch's flat argmax indices to window positions and back.

    Fast path: ``index - window_start`` takes one of ``volume`` distinct offsets, so a
    lookup table turns it into the position (one subtraction and one gather each way).
    When two positions share an offset (a dilated/padded window wider than the input) the
    per-dimension coordinates are computed instead.

    Everything here depends only on the pooling geometry, so :func:`_positions` builds it once
    per geometry and device (a dozen small ops that were a max-pool's largest fixed cost per
    call); nothing writes to these tensors afterwards.
    """

    def __init__(self, kind: str, in_sizes: Tuple[int, ...], out_sizes: Tuple[int, ...],
                 stride: Tuple[int, ...], padding: Tuple[int, ...],
                 dilation: Tuple[int, ...], window: Tuple[int, ...], nbits: int,
                 device: torch.device) -> None:
        self.in_sizes, self.dilation, self.window = in_sizes, dilation, window
        self.starts = _starts(kind, out_sizes, in_sizes, stride, padding, device)
        self.offs = _window_offsets(in_sizes, dilation, window)
        self.fast = len(set(self.offs)) == len(self.offs)
        self.dtype = _code_dtype(nbits)
        self.device = device
        self.base = _window_base(self.starts, self.in_sizes, 0)  # (*out_sizes)
        self.offsets = self._device_offsets()
        self.table = torch.zeros(max(self.offs) + 1, dtype=self.dtype, device=device)
        self.table[self.offsets] = torch.arange(len(self.offs), device=device).to(self.dtype)

    def _device_offsets(self) -> Tensor:
        """``self.offs`` as an int64 tensor built on the device from aranges: a host list
        copied to a GPU (``torch.tensor(offs, device=...)``) would synchronise."""
        offs = torch.zeros(1, dtype=torch.int64, device=self.device)
        for j in range(len(self.in_sizes)):
            step = self.dilation[j] * _prod(self.in_sizes[j + 1:])
            ks = torch.arange(self.window[j], dtype=torch.int64, device=self.device) * step
            offs = (offs.unsqueeze(1) + ks).reshape(-1)
        return offs

    def window_base(self, lead: int) -> Tensor:
        """Each window's first flat index, broadcastable against ``lead`` batch/channel dims."""
        return self.base.view((1,) * lead + tuple(self.base.shape))

    def encode(self, idx: Tensor, perm: Optional[Tuple[int, ...]]) -> Tensor:
        """Codes in memory order (contiguous)."""
        if not self.fast:
            codes = _indices_to_codes(idx, self.in_sizes, self.starts, self.dilation,
                                      self.window)
            return to_memory_order(codes.to(self.dtype), perm).contiguous()
        base = self.window_base(idx.dim() - len(self.in_sizes))
        delta = to_memory_order(idx, perm) - to_memory_order(base, perm)
        return torch.take(self.table, delta)

    def decode(self, codes: Tensor, perm: Optional[Tuple[int, ...]], lead: int) -> Tensor:
        """torch's flat indices (logical order) from memory-order codes."""
        if not self.fast:
            return _codes_to_indices(from_memory_order(codes, perm).long(), self.in_sizes,
                                     self.starts, self.dilation, self.window)
        base = to_memory_order(self.window_base(lead), perm)
        idx = torch.take(self.offsets, codes.long()).add_(base)
        return from_memory_order(idx, perm)


@lru_cache(maxsize=64)
def _positions(kind: str, in_sizes: Tuple[int, ...], out_sizes: Tuple[int, ...],
               stride: Tuple[int, ...], padding: Tuple[int, ...], dilation: Tuple[int, ...],
               window: Tuple[int, ...], nbits: int, device: torch.device) -> _Positions:
    """The :class:`_Positions` of one pooling geometry on one device, built once (a memo of
    constant index tensors, like torch's own caches of kernels: same key, same tensors)."""
    return _Positions(kind, in_sizes, out_sizes, stride, padding, dilation, window, nbits,
                      device)


def _max_pool_backward(grad: Tensor, shape_only: Tensor, idx: Tensor, kind: str, nd: int,
                       window: Tuple[int, ...], stride: Tuple[int, ...],
                       padding: Tuple[int, ...], dilation: Tuple[int, ...],
                       ceil_mode: bool) -> Tensor:
    """torch's own public backward op, given torch's indices (1-d through the 2-d op on an
    unsqueezed view, as torch's max_pool1d / adaptive_max_pool1d do)."""
    aten = torch.ops.aten
    if nd == 1:
        grad, shape_only, idx = grad.unsqueeze(-2), shape_only.unsqueeze(-2), idx.unsqueeze(-2)
        window, stride = (1,) + window, (1,) + stride
        padding, dilation = (0,) + padding, (1,) + dilation
    if kind == "adaptive":
        op = aten.adaptive_max_pool3d_backward if nd == 3 else aten.adaptive_max_pool2d_backward
        grad_in = op(grad, shape_only, idx)
    else:
        op = (aten.max_pool3d_with_indices_backward if nd == 3
              else aten.max_pool2d_with_indices_backward)
        grad_in = op(grad, shape_only, list(window), list(stride), list(padding),
                     list(dilation), ceil_mode, idx)
    return grad_in.squeeze(-2) if nd == 1 else grad_in


class MaxPoolFunction(torch.autograd.Function):
    """Max pooling (fixed windows, ``kind='max'``, or adaptive, ``kind='adaptive'``) that saves
    only the bit-packed position of each maximum inside its window.

    Backward rebuilds torch's flat indices and calls torch's public backward op
    (``max_pool{2,3}d_with_indices_backward`` / ``adaptive_max_pool{2,3}d_backward``), so the
    gradients are torch's bit for bit, in every dtype, overlapping windows included, with
    torch's (deterministic) accumulation on each device. Those ops read only the shape of
    their ``self`` argument; it is given as a stride-0 expanded scalar, which costs no memory
    on CPU (and the gradient comes back in contiguous layout).
    """

    @staticmethod
    def forward(ctx, x: Tensor, kind: str, nd: int, pool: Callable, probe: Callable,
                stride: Tuple[int, ...], padding: Tuple[int, ...], dilation: Tuple[int, ...],
                window: Tuple[int, ...], ceil_mode: bool, return_indices: bool):
        out, idx = pool(x)
        if autocast_on(x):
            # torch's autocast casts some pooling ops (e.g. CPU max_pool3d without indices)
            # but not their with-indices variants: take the dtype torch's layer would give.
            ref = probe(x.new_zeros((1,) * (nd + 2)))
            out = out.to(ref[0].dtype if isinstance(ref, tuple) else ref.dtype)
        in_sizes = tuple(x.shape[x.dim() - nd:])
        out_sizes = tuple(out.shape[out.dim() - nd:])
        if kind == "adaptive":
            window = tuple(_adaptive_window(i, o) for i, o in zip(in_sizes, out_sizes))
        elif _has_empty_window(in_sizes, out_sizes, stride, padding, dilation, window):
            raise NotImplementedError(
                "max-pool windows that contain no input element (padding plus dilation leave "
                "a window empty) are not supported: torch itself outputs -inf there with an "
                "out-of-range index, and its backward writes out of bounds")
        nbits = code_bits(_prod(window))
        perm = memory_perm(idx)
        if nbits:
            pos = _positions(kind, in_sizes, out_sizes, stride, padding, dilation, window,
                             nbits, x.device)
            packed = pack_codes(pos.encode(idx, perm), nbits)
        else:
            packed = torch.empty(0, dtype=torch.uint8, device=x.device)
        ctx.meta = (kind, nd, in_sizes, out_sizes, stride, padding, dilation, window, ceil_mode,
                    nbits)
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.out_shape = out.shape
        ctx.perm = perm
        save(ctx, packed)
        if return_indices:
            ctx.mark_non_differentiable(idx)
            return out, idx
        return out

    @staticmethod
    def backward(ctx, grad: Tensor, *unused: Tensor):
        (packed,) = load(ctx)
        kind, nd, in_sizes, out_sizes, stride, padding, dilation, window, ceil_mode, nbits = \
            ctx.meta
        perm = ctx.perm
        codes = unpack_codes(packed, nbits, _prod(ctx.out_shape))
        codes = codes.view(_permuted(ctx.out_shape, perm))
        pos = _positions(kind, in_sizes, out_sizes, stride, padding, dilation, window, nbits,
                         grad.device)
        idx = pos.decode(codes, perm, len(ctx.out_shape) - nd)
        del codes
        shape_only = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(ctx.x_shape)
        grad_in = _max_pool_backward(grad, shape_only, idx, kind, nd, window, stride, padding,
                                     dilation, ceil_mode)
        return (grad_in.to(ctx.x_dtype),) + (None,) * 10


def _has_empty_window(in_sizes: Sequence[int], out_sizes: Sequence[int],
                      stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                      window: Sequence[int]) -> bool:
    """Whether some output window holds no input element along some dimension.

    A window starting inside the input is never empty, and torch makes the last window start
    inside the input or the left padding, so only windows starting in the left padding (and,
    defensively, the last one) need checking.
    """
    for i, o, s, p, d, k in zip(in_sizes, out_sizes, stride, padding, dilation, window):
        for j in set(range(min(o, -(-p // s)))) | ({o - 1} if o else set()):
            if not any(0 <= j * s - p + t * d < i for t in range(k)):
                return True
    return False


def _adaptive_window(i: int, o: int) -> int:
    """Largest adaptive window along one dim: max over k of ceil((k+1)i/o) - floor(ki/o)."""
    if o == 0:
        return 1
    return max(-(-(k + 1) * i // o) - (k * i) // o for k in range(o))


def _max_pool(nd: int, x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple],
              padding: IntOrTuple, dilation: IntOrTuple, ceil_mode: bool,
              return_indices: bool):
    fn = _MAX_POOL[nd]
    if stride is None or (not isinstance(stride, int) and len(stride) == 0):
        stride = kernel_size
    pool = partial(fn, kernel_size=kernel_size, stride=stride, padding=padding,
                   dilation=dilation, ceil_mode=ceil_mode, return_indices=True)
    probe = partial(fn, kernel_size=1, return_indices=return_indices)
    return MaxPoolFunction.apply(
        x, "max", nd, pool, probe, _ntuple(stride, nd, "stride"),
        _ntuple(padding, nd, "padding"), _ntuple(dilation, nd, "dilation"),
        _ntuple(kernel_size, nd, "kernel_size"), bool(ceil_mode), return_indices)


def max_pool1d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
               return_indices: bool = False):
    """``F.max_pool1d`` saving ceil(log2(kernel)) bits per output value."""
    return _max_pool(1, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool2d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
               return_indices: bool = False):
    """``F.max_pool2d`` saving ceil(log2(kH * kW)) bits per output value."""
    return _max_pool(2, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool3d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
               return_indices: bool = False):
    """``F.max_pool3d`` saving ceil(log2(kD * kH * kW)) bits per output value."""
    return _max_pool(3, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _adaptive_max_pool(nd: int, x: Tensor, output_size, return_indices: bool):
    fn = _ADAPTIVE_MAX_POOL[nd]
    pool = partial(fn, output_size=output_size, return_indices=True)
    probe = partial(fn, output_size=1, return_indices=return_indices)
    ones = (1,) * nd
    return MaxPoolFunction.apply(x, "adaptive", nd, pool, probe, ones, (0,) * nd, ones, ones,
                                 False, return_indices)


def adaptive_max_pool1d(x: Tensor, output_size, return_indices: bool = False):
    """``F.adaptive_max_pool1d`` saving ceil(log2(largest window)) bits per output value."""
    return _adaptive_max_pool(1, x, output_size, return_indices)


def adaptive_max_pool2d(x: Tensor, output_size, return_indices: bool = False):
    """``F.adaptive_max_pool2d``; windows vary in size, codes are laid out on the largest
    window (e.g. 7 -> 3 gives windows of 3 rows, so 3x3 -> 4 bits)."""
    return _adaptive_max_pool(2, x, output_size, return_indices)


def adaptive_max_pool3d(x: Tensor, output_size, return_indices: bool = False):
    return _adaptive_max_pool(3, x, output_size, return_indices)


# ----------------------------------------------------------------------------------------------
# Linear ops whose backward needs only shapes
# ----------------------------------------------------------------------------------------------
def memory_format_of(x: Tensor) -> torch.memory_format:
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


class ShapeOnlyFunction(torch.autograd.Function):
    """``op(x)`` for an ``op`` linear in ``x`` whose vjp does not read ``x`` (average pools,
    interpolation). Saves no tensor: backward is ``vjp(op, zeros_like(x))(grad)``, run under
    the autocast state of the forward so the dtypes match; differentiable again (it is
    linear in ``grad``)."""

    @staticmethod
    def forward(ctx, x: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.op = op
        ctx.x_spec = (x.shape, x.dtype, x.device, memory_format_of(x))
        ctx.autocast = _autocast_state(x.device.type)
        save(ctx)
        return op(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device, fmt = ctx.x_spec
        enabled, ac_dtype = ctx.autocast
        create_graph = torch.is_grad_enabled()
        z = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt).zero_()
        with torch.enable_grad():
            z.requires_grad_(True)
            with (torch.autocast(device.type, dtype=ac_dtype) if enabled
                  else no_autocast(device.type)):
                y = ctx.op(z)
            (grad_in,) = torch.autograd.grad(y, z, grad, create_graph=create_graph)
        return grad_in, None


def _avg_pool(nd: int, x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple],
              padding: IntOrTuple, ceil_mode: bool, count_include_pad: bool,
              divisor_override: Optional[int]) -> Tensor:
    fn = _AVG_POOL[nd]
    kwargs = dict(kernel_size=kernel_size, stride=stride, padding=padding, ceil_mode=ceil_mode,
                  count_include_pad=count_include_pad)
    if nd != 1:  # torch's avg_pool1d has no divisor_override
        kwargs["divisor_override"] = divisor_override
    return ShapeOnlyFunction.apply(x, partial(fn, **kwargs))


def avg_pool1d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    """``F.avg_pool1d`` saving nothing but shapes."""
    return _avg_pool(1, x, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def avg_pool2d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Optional[int] = None) -> Tensor:
    """``F.avg_pool2d`` saving nothing but shapes (a real average, unlike ActNN's)."""
    return _avg_pool(2, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def avg_pool3d(x: Tensor, kernel_size: IntOrTuple, stride: Optional[IntOrTuple] = None,
               padding: IntOrTuple = 0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Optional[int] = None) -> Tensor:
    return _avg_pool(3, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


def adaptive_avg_pool1d(x: Tensor, output_size) -> Tensor:
    return ShapeOnlyFunction.apply(x, partial(F.adaptive_avg_pool1d, output_size=output_size))


def adaptive_avg_pool2d(x: Tensor, output_size) -> Tensor:
    """``F.adaptive_avg_pool2d`` saving nothing but shapes."""
    return ShapeOnlyFunction.apply(x, partial(F.adaptive_avg_pool2d, output_size=output_size))


def adaptive_avg_pool3d(x: Tensor, output_size) -> Tensor:
    return ShapeOnlyFunction.apply(x, partial(F.adaptive_avg_pool3d, output_size=output_size))


def _pack_bytes(code: Tensor, width: int) -> Tensor:
    """Small non-negative integers (< 2**width, width 1, 2, 4 or 8) packed ``8 // width`` per
    byte, in plain torch ops (flattened, zero-padded to whole bytes)."""
    per = 8 // width
    flat = code.reshape(-1).to(torch.uint8)
    flat = F.pad(flat, (0, (-flat.numel()) % per)).view(-1, per)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=code.device)
    return (flat << shifts).sum(1, dtype=torch.uint8)


def _unpack_bytes(packed: Tensor, width: int, shape: List[int]) -> Tensor:
    """Inverse of :func:`_pack_bytes`: int64 codes of ``shape``."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    codes = (packed.view(-1, 1) >> shifts) & ((1 << width) - 1)
    n = 1
    for s in shape:
        n *= s
    return codes.reshape(-1)[:n].view(shape).long()


class WindowCodeMaxPool2d(torch.autograd.Function):
    """2-d max pooling that saves each maximum's position inside its window (1, 2, 4 or 8 bits:
    2 for 2x2 windows, 4 for 3x3), in traceable ops: the form :func:`actnn_zoo.compile`
    traces (torch's op saves its input and int64 indices, 8 bytes per output value, which a
    compiled graph cannot compress).

    The forward is torch's (``F.max_pool2d`` with indices); backward rebuilds torch's flat
    indices from (window start + position) and calls torch's public backward op, so the
    gradient is torch's. Windows of at most 256 positions."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: Tuple[int, int],  # type: ignore[override]
                stride: Tuple[int, int], padding: Tuple[int, int],
                dilation: Tuple[int, int], ceil_mode: bool) -> Tensor:
        out, idx = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode,
                                return_indices=True)
        w_in = x.shape[-1]
        oh = torch.arange(out.shape[-2], device=x.device).view(-1, 1)
        ow = torch.arange(out.shape[-1], device=x.device).view(1, -1)
        row = idx // w_in - (oh * stride[0] - padding[0])
        col = idx % w_in - (ow * stride[1] - padding[1])
        code = (row // dilation[0]) * kernel[1] + col // dilation[1]
        width = next(b for b in (1, 2, 4, 8) if kernel[0] * kernel[1] <= 1 << b)
        ctx.save_for_backward(_pack_bytes(code, width))
        ctx.meta = (list(x.shape), list(out.shape), width, x.dtype, kernel, stride, padding,
                    dilation, ceil_mode)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        shape, out_shape, width, dtype, kernel, stride, padding, dilation, ceil_mode = ctx.meta
        c = _unpack_bytes(packed, width, out_shape)
        oh = torch.arange(grad.shape[-2], device=grad.device).view(-1, 1)
        ow = torch.arange(grad.shape[-1], device=grad.device).view(1, -1)
        row = oh * stride[0] - padding[0] + (c // kernel[1]) * dilation[0]
        col = ow * stride[1] - padding[1] + (c % kernel[1]) * dilation[1]
        idx = row * shape[-1] + col
        like = torch.zeros((), dtype=dtype, device=grad.device).expand(shape)
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, like, list(kernel), list(stride), list(padding), list(dilation), ceil_mode,
            idx)
        return grad_x, None, None, None, None, None
