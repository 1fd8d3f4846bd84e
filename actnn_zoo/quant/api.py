"""quantize / dequantize and mask packing: argument checks, then one backend call.

Debug checks: the CUDA kernels trust per-sample widths and row offsets that live on the GPU
(reading them back would synchronise every call) and clip what they store instead, so invalid
widths give silently wrong values there, where the CPU kernels raise. ``validate=True`` on
:func:`quantize` / :func:`dequantize`, or the environment variable ``ACTNN_ZOO_DEBUG=1`` (read
at each call, so it can be set while a program runs), checks them on the host first on any
device, at the cost of one synchronisation per call.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from . import reference
from .backend import extension, kernels
from .seeds import draw_seed
from .hadamard import check_transform, check_transform_group, hadamard_
from .tensor import QuantizedTensor

SUPPORTED_BITS = (1, 2, 4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDING = ("stochastic", "nearest")


def check_bits(bits: object, name: str = "bits") -> int:
    """Validate one bit width; returns it as int."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


@dataclass(frozen=True)
class SampleBits:
    """Per-sample widths plus a host-side bound on their sum.

    With a plain bits tensor, :func:`quantize` must read the widths back to validate them and
    to size its output (a device synchronisation on CUDA). A precision strategy knows the sum's
    bound on the host, so with this wrapper quantize sizes the buffer from ``max_sum`` and reads
    nothing back. ``bits``: (N,) uint8, every entry 1, 2, 4 or 8; ``max_sum`` >= bits.sum().
    Both promises are checked on CPU (free there) and trusted on other devices, where the
    kernels still clip every store to the buffer.
    """

    bits: Tensor
    max_sum: int

    def __post_init__(self) -> None:
        if not isinstance(self.bits, Tensor) or self.bits.dtype != torch.uint8 \
                or self.bits.dim() != 1:
            raise TypeError("SampleBits.bits must be a 1-d uint8 tensor")
        if isinstance(self.max_sum, bool) or not isinstance(self.max_sum, int) \
                or self.max_sum < 0:
            raise ValueError(f"SampleBits.max_sum must be a non-negative int, "
                             f"got {self.max_sum!r}")

    @property
    def shape(self) -> torch.Size:
        return self.bits.shape

    @classmethod
    def made(cls, bits: Tensor, max_sum: int) -> "SampleBits":
        """One the library made itself (a solver's uint8 (N,) widths, an int bound), without
        the constructor's type checks: a strategy makes one per layer per step."""
        new = object.__new__(cls)
        object.__setattr__(new, "bits", bits)
        object.__setattr__(new, "max_sum", max_sum)
        return new


Bits = Union[int, Tensor, SampleBits]


def check_group_size(group_size: object, name: str = "group_size") -> int:
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
            or group_size % 8):
        raise ValueError(f"{name} must be a positive multiple of 8, got {group_size!r}")
    return group_size


_grad_enabled = torch.is_grad_enabled
# Whether the CPU's kernels are the compiled ones (read once: a loaded library, not
# configuration); see quantize_saved.
_CPU_KERNELS = kernels("cpu")
_CPU_COMPILED = _CPU_KERNELS is not reference


def no_graph(t: Tensor) -> Tensor:
    """``t`` for a kernel to read: detached where an op on it would be recorded, else itself.
    A detach is an operator call (~1-2 us of dispatch), and inside an autograd Function's
    forward or a precision hook under no_grad -- where the quantizers run in training -- no op
    is recorded anyway."""
    return t.detach() if t.requires_grad and _grad_enabled() else t


def stat_vector(t: Tensor) -> Tensor:
    """A norm's statistic as the kernels take it: float32, flat, contiguous (no operator call
    where it already is one)."""
    t = no_graph(t)
    if t.dtype != torch.float32:
        t = t.float()
    if t.dim() != 1:
        t = t.reshape(-1)
    return t.contiguous()


def as_rows(x: Tensor) -> Tensor:
    """The (N, D) row view of the contract: dim 0 is the sample; 0-d and 1-d are one row."""
    if x.dim() <= 1:
        return x.reshape(1, x.numel())
    return x.reshape(x.shape[0], x.shape[1:].numel())




def _row_bits(bits: Bits, n: int, device: torch.device) -> Tuple[Tensor, Optional[int]]:
    if isinstance(bits, SampleBits):
        if bits.bits.shape[0] != n:
            raise ValueError(f"bits has {bits.bits.shape[0]} entries but the tensor has {n} "
                             f"samples")
        if bits.bits.device != device:
            raise ValueError(f"bits is on {bits.bits.device}, the tensor on {device}")
        return bits.bits, None
    if isinstance(bits, Tensor):
        if bits.dtype.is_floating_point or bits.dtype == torch.bool or bits.dim() != 1:
            raise TypeError(f"bits as a tensor must be a 1-d integer tensor, got {bits.dtype} "
                            f"of shape {tuple(bits.shape)}")
        if bits.shape[0] != n:
            raise ValueError(f"bits has {bits.shape[0]} entries but the tensor has {n} samples")
        ok = (bits == 1) | (bits == 2) | (bits == 4) | (bits == 8)
        if not bool(ok.all()):
            raise ValueError(f"bits entries must be in {SUPPORTED_BITS}")
        return bits.to(device=device, dtype=torch.uint8), None
    b = check_bits(bits)
    return torch.full((n,), b, dtype=torch.uint8, device=device), b


DEBUG_ENV = "ACTNN_ZOO_DEBUG"


_ASCII_SPACE = " \t\n\r\v\f"


def env_flag_python(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1/true/yes/on (surrounding ASCII
    whitespace and ASCII case ignored), read now. :data:`env_flag` is this rule, compiled."""
    value = os.environ.get(name, "").strip(_ASCII_SPACE)
    return value.isascii() and value.lower() in ("1", "true", "yes", "on")


# env_flag_python in C (getenv, ~0.1 us; os.environ.get of an unset name raises and catches a
# KeyError inside, ~0.7 us): quantize reads ACTNN_ZOO_DEBUG at every call
env_flag: Callable[[str], bool] = getattr(extension(), "env_flag", None) or env_flag_python


def debug_checks(validate: Optional[bool] = None) -> bool:
    """Whether to run the host-side checks of widths and offsets: ``validate`` when given, else
    ``ACTNN_ZOO_DEBUG`` set to 1/true/yes/on (:func:`env_flag`: read now, not cached, so a
    test or a debugging session can switch it on without restarting)."""
    if validate is not None:
        return bool(validate)
    return env_flag(DEBUG_ENV)


def _check_widths(bits: Tensor, what: str) -> None:
    """Every entry of a widths tensor in {1, 2, 4, 8} (reads it back: a sync on CUDA)."""
    ok = (bits == 1) | (bits == 2) | (bits == 4) | (bits == 8)
    if not bool(ok.all()):
        bad = sorted(set(bits[~ok].tolist()))
        raise ValueError(f"{what} entries must be in {SUPPORTED_BITS}, got {bad} "
                         f"(debug check, {DEBUG_ENV})")


def _check_layout(row_bits: Tensor, offsets: Tensor, d: int, nbytes: int, what: str) -> None:
    """Widths valid, and each row's bytes inside [0, nbytes) and after the previous row's, as
    the CPU kernels require (checked on the host: the CUDA kernels only clip)."""
    _check_widths(row_bits, what)
    if offsets.dtype != torch.int64 or offsets.shape != (row_bits.shape[0] + 1,):
        raise ValueError(f"{what}: offsets must be int64 of shape ({row_bits.shape[0] + 1},), "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    sizes = (row_bits.long() * d + 7) // 8
    off = offsets.long()
    if bool((off[:-1] < 0).any()) or bool((off[1:] < off[:-1] + sizes).any()) \
            or int(off[-1]) > nbytes:
        raise ValueError(f"{what}: row offsets do not fit the widths or the {nbytes}-byte "
                         f"buffer (debug check, {DEBUG_ENV})")


def check_sample_bits(bits: Bits, validate: Optional[bool]) -> None:
    """Debug check of :class:`SampleBits` (``validate`` / ``ACTNN_ZOO_DEBUG``): widths valid
    and summing to at most ``max_sum`` (reads them back; a no-op for other ``bits``)."""
    if isinstance(bits, SampleBits) and debug_checks(validate):
        _check_widths(bits.bits, "SampleBits.bits")
        used = int(bits.bits.long().sum())
        if used > bits.max_sum:
            raise ValueError(f"SampleBits.bits sums to {used}, more than max_sum="
                             f"{bits.max_sum} (debug check, {DEBUG_ENV})")


def quantize(x: Tensor, bits: Bits = 2, group_size: int = 256,
             seed: Optional[int] = None, rounding: str = "stochastic",
             validate: Optional[bool] = None, transform: str = "none") -> QuantizedTensor:
    """Compress ``x`` to ``bits`` per value with per-group stochastic rounding.

    ``bits`` is 1, 2, 4 or 8, or a 1-d integer tensor with one such width per sample (row),
    or :class:`SampleBits` (per-sample widths that quantize does not read back).
    ``seed`` fixes the random rounding; by default it is drawn from torch's generator, so
    ``torch.manual_seed`` makes runs reproducible. The result dequantizes to an unbiased
    estimate of ``x`` (exactly unbiased up to the 2^-24 resolution of the random numbers).
    ``validate`` (default: the ``ACTNN_ZOO_DEBUG`` environment variable) checks
    :class:`SampleBits` widths and their ``max_sum`` on the host on every device: the CUDA
    kernel would otherwise pack nothing for an invalid width and clip what overflows.
    ``transform='hadamard'`` quantizes the randomized Walsh-Hadamard transform of each full
    group instead (``group_size`` a power of two in [32, 8192]; signs from ``seed``), which
    :func:`dequantize` inverts: still unbiased, with outliers spread over their group
    (:mod:`actnn_zoo.quant.hadamard`). It costs one float32 copy of ``x`` while quantizing.
    """
    group_size, seed = check_quantize_args(x, group_size, rounding, seed)
    check_transform(transform)
    check_transform_group(transform, group_size)

    rows = as_rows(no_graph(x))
    n, d = rows.shape
    if transform == "hadamard" and n * d:
        rows = hadamard_(rows.to(torch.float32, memory_format=torch.contiguous_format,
                                 copy=True), group_size, seed)
    tseed = seed & 0xFFFFFFFF if transform != "none" else 0
    return _encode(x, rows, bits, group_size, seed, rounding == "stochastic", validate,
                   transform, tseed)


def _encode(x: Tensor, rows: Tensor, bits: Bits, group_size: int, seed: int, stochastic: bool,
            validate: Optional[bool], transform: str = "none", tseed: int = 0
            ) -> QuantizedTensor:
    """The kernel call of :func:`quantize` and :func:`quantize_saved`: ``rows``, the values of
    ``x`` (rotated already when ``transform`` says so) in any shape whose contract rows are
    ``x``'s (dim 0 the sample), at ``bits``, as a QuantizedTensor."""
    if not isinstance(bits, (Tensor, SampleBits)):
        # one width: the kernel reads the rows and lays them out itself (no view, no widths or
        # offsets tensors per call); an int in SUPPORTED_BITS is taken without check_bits' call
        uniform = bits if type(bits) is int and bits in SUPPORTED_BITS else check_bits(bits)
        if rows.numel() == 0:
            data, lo, step = _empty_codes(*reference.contract_rows(rows.shape), group_size,
                                          x.device)
        else:
            data, lo, step = (_CPU_KERNELS if x.is_cpu else kernels(x.device)).quantize_uniform(
                rows.contiguous(), uniform, group_size, seed & 0xFFFFFFFF, stochastic)
        return QuantizedTensor.made(data, lo, step, x.shape, x.dtype, uniform, group_size,
                                    None, None, transform, tseed)
    n, d = reference.contract_rows(rows.shape)
    if (type(bits) is SampleBits and n * d and x.is_cpu
            and bits.bits.shape[0] == n and bits.bits.is_cpu
            and not debug_checks(validate)):
        # the layer's per-sample widths (the actnn strategy's): layout and kernel in one call
        fused = getattr(_CPU_KERNELS, "quantize_samples", None)
        if fused is not None:
            data, lo, step, offsets = fused(rows.contiguous(), bits.bits, bits.max_sum,
                                            group_size, seed & 0xFFFFFFFF, stochastic)
            return QuantizedTensor.made(data, lo, step, x.shape, x.dtype, None, group_size,
                                        bits.bits, offsets, transform, tseed)
    row_bits, offsets, total, _ = _rows_layout(bits, n, d, x.device, validate)
    if n * d == 0:
        data, lo, step = _empty_codes(n, d, group_size, x.device)
    else:
        data, lo, step = kernels(x.device).quantize(
            (rows if rows.dim() == 2 else as_rows(rows)).contiguous(), row_bits, offsets,
            total, group_size, seed & 0xFFFFFFFF, stochastic)
    return QuantizedTensor.made(data, lo, step, x.shape, x.dtype, None, group_size,
                                row_bits, offsets, transform, tseed)


def quantize_saved(x: Tensor, bits: Bits, group_size: int, stochastic: bool) -> QuantizedTensor:
    """:func:`quantize` of a tensor a Q-layer saves, without a rotation: equal to
    ``quantize(x, bits, group_size, rounding=...)`` with the seed it would draw, code for code.

    Why a second entry: every compressed save of a training step runs through here, and the
    public function's checks of its settings (group size, rounding, transform, seed type: a
    dozen Python calls) were made once, when the ``LayerQConfig`` they come from was built.
    What the settings do not cover is still checked: ``x``'s dtype, a width given as an int,
    per-sample widths (:func:`_rows_layout`)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    seed = draw_seed() if stochastic else 0
    # The compiled CPU kernels read a contiguous x through its pointer and make any row view
    # they need under no_grad in C++, so x needs no detach there (an operator call per save of
    # an input that requires a gradient); a copy to contiguous, the reference kernels and the
    # general entries are torch ops, which would be recorded.
    rows = x if x.is_cpu and _CPU_COMPILED and x.is_contiguous() else no_graph(x)
    return _encode(x, rows, bits, group_size, seed, stochastic, None)


def dequantize_saved(q: QuantizedTensor, validate: Optional[bool] = None) -> Tensor:
    """:func:`dequantize` of a payload without a rotation (what :func:`quantize_saved`
    makes), without the public function's type check (the payload is the library's own)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel():
        _dequantize_rows_into(q, 0, q.lo.shape[0], out, validate)
    return out


def _rows_layout(bits: Bits, n: int, d: int, device: torch.device, validate: Optional[bool]
                 ) -> Tuple[Tensor, Tensor, int, Optional[int]]:
    """(row widths, row byte offsets, bytes to allocate, the one width or None) of ``n`` rows of
    ``d`` codes at ``bits``, as the general kernel entries take them. One width: the capacity
    from host ints; per-sample widths: ``_capacity`` (no device read for SampleBits; on the CPU
    the compiled ``sample_offsets`` checks its promises while it lays the rows out)."""
    row_bits, uniform = _row_bits(bits, n, device)
    check_sample_bits(bits, validate)
    if uniform is not None:
        return row_bits, kernels(device).row_offsets(d, row_bits), \
            n * ((d * uniform + 7) // 8), uniform
    checked = (getattr(kernels(device), "sample_offsets", None)
               if isinstance(bits, SampleBits) and device.type == "cpu" else None)
    if checked is not None:
        offsets = checked(d, row_bits, bits.max_sum)
    else:
        offsets = kernels(device).row_offsets(d, row_bits)
    return row_bits, offsets, _capacity(bits, offsets, n, d, checked=checked is not None), None


def _empty_codes(n: int, d: int, group_size: int, device: torch.device
                 ) -> Tuple[Tensor, Tensor, Tensor]:
    """(data, lo, step) of a tensor with no values: no bytes, (N, G) empty metadata."""
    lo = torch.empty(n, -(-d // group_size), dtype=torch.bfloat16, device=device)
    return torch.empty(0, dtype=torch.uint8, device=device), lo, torch.empty_like(lo)


def has_normalized_kernel(device: torch.device) -> bool:
    """Whether :func:`quantize_normalized` runs fused on ``device`` (the compiled CPU kernel);
    elsewhere it makes the normalized copy and quantizes that."""
    return device.type == "cpu" and getattr(kernels(device), "quantize_affine", None) is not None


def normalizes_in_kernel(x: Tensor, mean: Tensor, invstd: Tensor) -> bool:
    """Whether :func:`quantize_normalized` takes these arguments and normalizes inside the
    compiled kernel (CPU, contiguous float32/16 ``x``, statistics of a supported shape);
    otherwise a caller that can make the copy its own way (in chunks) should."""
    return (has_normalized_kernel(x.device) and x.dtype in SUPPORTED_DTYPES and x.dim() >= 2
            and x.is_contiguous() and _stat_layout(x, mean, invstd) is not None)


def _stat_layout(x: Tensor, stat: Tensor, other: Tensor) -> Optional[Tuple[int, int]]:
    """(row_stride, block) of the kernel's statistics index ``n * row_stride + p / block`` for
    statistics ``stat`` and ``other`` of one shape, broadcasting against ``x`` and varying only
    over a leading run of its dims, the sample dim optional (per channel: (1, C, 1, ...); per
    row of a layer norm: (N, ..., 1, ...); per (sample, channel)); None for any other shape."""
    if stat.dim() != x.dim() or other.shape != stat.shape:
        return None
    varying = [i for i, s in enumerate(stat.shape) if s != 1]
    stop = varying[-1] + 1 if varying else 1  # dims from stop on share one statistic
    if any(stat.shape[i] != x.shape[i] for i in range(1, stop)):
        return None
    if stat.shape[0] not in (1, x.shape[0]):
        return None
    block = max(x.shape[stop:].numel(), 1)
    return (x.shape[1:stop].numel() if stat.shape[0] == x.shape[0] else 0), block


def quantize_normalized(x: Tensor, mean: Tensor, invstd: Tensor, bits: Bits = 2,
                        group_size: int = 256, seed: Optional[int] = None,
                        rounding: str = "stochastic", validate: Optional[bool] = None
                        ) -> QuantizedTensor:
    """``quantize((x - mean) * invstd, ...)`` for a norm's statistics ``mean`` and ``invstd``:
    per channel, (1, C, 1, ...) like batch norm's, or per row, (N, ..., 1, ...) like layer
    norm's (any statistic broadcasting against ``x`` whose non-singleton dims are a run of its
    dims starting at dim 0 or 1). The normalized copy is float32, computed as torch computes it
    (subtract, then multiply, each rounded), so the result is bit for bit what :func:`quantize`
    gives that copy with the same seed (a float32 :class:`QuantizedTensor`). With the compiled
    CPU kernel (:func:`has_normalized_kernel`) the copy is never made: each group is normalized
    on the way into the quantizer. Why: norms save their normalized input
    (``functional/norm.py``), and making the copy took two passes over the map before the
    quantizer's, as long as the norm itself (docs/design.md, "The step's time").
    ``x`` must be contiguous; float32, float16 or bfloat16."""
    group_size, seed = check_quantize_args(x, group_size, rounding, seed)
    if x.dim() < 2 or not x.is_contiguous():
        raise ValueError(f"quantize_normalized needs a contiguous tensor of 2 or more dims, "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}")
    layout = _stat_layout(x, mean, invstd)
    if layout is None:
        raise ValueError(f"mean and invstd must have one shape, per channel (1, C, 1, ...) or "
                         f"per row (N, ..., 1, ...) of x {tuple(x.shape)}; got "
                         f"{tuple(mean.shape)} and {tuple(invstd.shape)}")
    if not has_normalized_kernel(x.device):
        x_hat = (x.detach().float() - mean.detach().float()).mul_(invstd.detach().float())
        return quantize(x_hat, bits, group_size, seed=seed, rounding=rounding, validate=validate)
    rows = as_rows(no_graph(x))
    n, d = rows.shape
    ker = kernels(x.device)
    one_width = (getattr(ker, "quantize_affine_uniform", None)
                 if n * d and not isinstance(bits, (Tensor, SampleBits)) else None)
    if one_width is not None:  # the kernel lays the rows out (no widths/offsets tensors)
        uniform = check_bits(bits)
        data, lo, step = one_width(rows, stat_vector(mean), stat_vector(invstd), layout[0],
                                   layout[1], uniform, group_size, seed & 0xFFFFFFFF,
                                   rounding == "stochastic")
        return QuantizedTensor(data, lo, step, x.shape, torch.float32, uniform, group_size)
    row_bits, offsets, total, uniform = _rows_layout(bits, n, d, x.device, validate)
    if n * d == 0:
        data, lo, step = _empty_codes(n, d, group_size, x.device)
    else:
        shift, scale = stat_vector(mean), stat_vector(invstd)
        data, lo, step = ker.quantize_affine(
            rows, shift, scale, layout[0], layout[1], row_bits, offsets, total, group_size,
            seed & 0xFFFFFFFF, rounding == "stochastic")
    if uniform is not None:
        return QuantizedTensor(data, lo, step, x.shape, torch.float32, uniform, group_size)
    return QuantizedTensor(data, lo, step, x.shape, torch.float32, None, group_size, row_bits,
                           offsets)


def check_quantize_args(x: Tensor, group_size: int, rounding: str,
                        seed: Optional[int]) -> Tuple[int, int]:
    """The checks every quantizer makes of its input and settings; returns (group_size, the
    seed, drawn from torch's generator when None and rounding is stochastic)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    group_size = check_group_size(group_size)
    if rounding not in ROUNDING:
        raise ValueError(f"rounding must be one of {ROUNDING}, got {rounding!r}")
    if seed is None:
        seed = draw_seed() if rounding == "stochastic" else 0
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return group_size, seed


def _capacity(bits: Bits, offsets: Tensor, n: int, d: int, checked: bool = False) -> int:
    """Bytes for the packed rows of mixed widths. A tensor of widths: exactly offsets[-1] (read
    back). SampleBits: sum_n ceil(d * b_n / 8) <= (d * max_sum + 7 n) / 8, from host ints.
    ``checked``: the offsets came from ``sample_offsets``, which checked SampleBits' promises."""
    if not isinstance(bits, SampleBits):
        return int(offsets[-1])
    total = (d * bits.max_sum + 7 * n) // 8
    if bits.bits.is_cpu and not checked:  # one small op to check them here
        counts = torch.bincount(bits.bits, minlength=9).tolist()
        if sum(counts) != sum(counts[b] for b in SUPPORTED_BITS):
            raise ValueError(f"SampleBits.bits entries must be in {SUPPORTED_BITS}")
        used = sum(b * counts[b] for b in SUPPORTED_BITS)
        if used > bits.max_sum:
            raise ValueError(f"SampleBits.bits sums to {used}, more than max_sum="
                             f"{bits.max_sum}")
    return total


def dequantize(q: QuantizedTensor, validate: Optional[bool] = None) -> Tensor:
    """Reconstruct a tensor of ``q``'s original shape and dtype (contiguous).

    ``validate`` (default: the ``ACTNN_ZOO_DEBUG`` environment variable) checks per-sample
    widths and row offsets on the host on every device before the kernel runs; without it the
    CUDA kernel decodes a row of an invalid width as zeros and clips out-of-range reads.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize expects a QuantizedTensor, got {type(q).__name__}")
    if q.transform != "hadamard":
        return dequantize_saved(q, validate)
    # the inverse rotation runs in float32 before any rounding to a 16-bit dtype
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype)
    rows = as_rows(out)
    _dequantize_rows_into(q, 0, rows.shape[0], rows, validate)
    hadamard_(rows, q.group_size, q.transform_seed, inverse=True)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def rows_out(q, start: int, stop: int, out: Optional[Tensor]) -> Tensor:
    """The buffer samples ``start:stop`` of a payload ``q`` (with a sample dimension) decode
    into: ``out`` when it is a contiguous tensor of that shape, dtype and device, a new one when
    None; a bad range or buffer raises, naming it."""
    n = q.shape[0]
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= n):
        raise ValueError(f"rows {start}:{stop} are not a range of the {n} samples")
    shape = (stop - start,) + tuple(q.shape[1:])
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.dtype != q.dtype or not out.is_contiguous() \
            or out.device != q.device:
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {shape} on "
                         f"{q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def dequantize_rows(q: QuantizedTensor, start: int, stop: int, out: Optional[Tensor] = None,
                    validate: Optional[bool] = None) -> Tensor:
    """Samples ``start:stop`` (dim 0) of ``q``, decoded: shape ``(stop - start, *q.shape[1:])``.

    Why: a backward that needs the input only for a sum over samples (a weight gradient, a
    norm's statistics) can decode a few samples at a time into one reused buffer (``out``, any
    contiguous tensor of that shape and ``q.dtype``, e.g. a view of a larger buffer) instead of
    materialising the whole tensor; the step's peak then holds a chunk, not a full map.
    Equal, value for value, to ``dequantize(q)[start:stop]``.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize_rows expects a QuantizedTensor, got {type(q).__name__}")
    if len(q.shape) < 2:
        raise ValueError(f"dequantize_rows needs a tensor with a sample dimension, got shape "
                         f"{tuple(q.shape)}")
    out = rows_out(q, start, stop, out)
    if out.numel():
        if q.transform == "hadamard":  # the signs depend on the column only: rows invert alone
            rows = torch.empty(out.shape, dtype=torch.float32, device=q.device)
            _dequantize_rows_into(q, start, stop, as_rows(rows), validate)
            out.copy_(hadamard_(as_rows(rows), q.group_size, q.transform_seed,
                                inverse=True).view(out.shape))
        else:
            _dequantize_rows_into(q, start, stop, out, validate)
    return out


def _dequantize_rows_into(q: QuantizedTensor, start: int, stop: int, out: Tensor,
                          validate: Optional[bool]) -> None:
    """The kernel call: rows ``start:stop`` of ``q`` into ``out``, contiguous, whose contract
    rows (dim 0 the sample) are those. The codes are addressed through absolute row offsets,
    so the whole ``data`` buffer is passed."""
    if not q.mixed:  # the kernel reads the rows and lays them out itself: no view, no tensors
        kernels(out.device).dequantize_uniform(q.data, q.lo, q.step, q.bits, q.group_size,
                                               start, out)
        return
    rows = out if out.dim() == 2 else as_rows(out)
    if debug_checks(validate):
        _check_layout(q.row_bits, q.offsets, rows.shape[1], q.data.numel(),
                      "QuantizedTensor.row_bits")
    if start == 0 and stop == q.lo.shape[0]:  # all rows: no slices (four operator calls)
        kernels(rows.device).dequantize(q.data, q.lo, q.step, q.row_bits, q.offsets,
                                        q.group_size, rows)
        return
    kernels(rows.device).dequantize(q.data, q.lo[start:stop], q.step[start:stop],
                                    q.row_bits[start:stop], q.offsets[start:stop + 1],
                                    q.group_size, rows)


def pack_mask(mask: Tensor) -> Tensor:
    """Any-shape boolean mask -> uint8 with 1 bit per value (element i at bit i % 8)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    flat = mask.reshape(-1).contiguous()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=mask.device)
    return kernels(mask.device).pack_mask(flat)


def pack_compare(x: Tensor, kind: str, lo: float = 0.0, hi: float = 0.0,
                 out: Optional[Tensor] = None) -> Tensor:
    """``pack_mask`` of a comparison of ``x``, made in one read of ``x`` with no bool tensor.

    ``kind``: ``"not_le"`` (``~(x <= lo)``, ReLU's backward predicate, true at NaN), ``"gt"``
    (``x > lo``, LeakyReLU's) or ``"between"`` (``(x > lo) & (x < hi)``, Hardtanh's). ``x`` is
    read in memory order when contiguous (any shape, flattened as ``x.reshape(-1)``); ``lo`` /
    ``hi`` must be exactly representable in ``x``'s dtype (the mask then equals torch's
    comparison in that dtype). Bit-identical to ``pack_mask(<the comparison>)``, which runs
    instead for other dtypes or without compiled kernels.

    ``out``: a contiguous uint8 CPU tensor of ``ceil(x.numel() / 8)`` bytes the bits are
    written into through its pointer (its version counter does not move) and returned: a ReLU
    node's buffer, filled after its forward (``functional.activation``). Compiled CPU kernels
    only.
    """
    if kind not in reference.COMPARE_KINDS:
        raise ValueError(f"pack_compare kind must be one of {reference.COMPARE_KINDS}, "
                         f"got {kind!r}")
    code = reference.COMPARE_KINDS.index(kind)
    flat = x.reshape(-1)
    fn = getattr(kernels(x.device), "pack_compare", None)
    if out is not None:
        if fn is None or not x.is_cpu or x.dtype not in _MASKED_GRAD_DTYPES:
            raise ValueError("pack_compare: out needs the compiled CPU kernel and a float input")
        return fn(flat.contiguous(), code, float(lo), float(hi), out)
    if fn is None or x.dtype not in _MASKED_GRAD_DTYPES or flat.numel() == 0:
        return pack_mask(reference.compare(flat, code, lo, hi))
    return fn(flat.contiguous(), code, float(lo), float(hi))


def unpack_mask(packed: Tensor, shape: Union[torch.Size, tuple]) -> Tensor:
    """Inverse of :func:`pack_mask`: a bool tensor of ``shape``."""
    shape = torch.Size(shape)
    numel = shape.numel()
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 7) // 8:
        raise ValueError(f"packed mask of {packed.numel()} bytes ({packed.dtype}) does not hold "
                         f"{numel} values")
    if numel == 0:
        return torch.empty(shape, dtype=torch.bool, device=packed.device)
    return kernels(packed.device).unpack_mask(packed.contiguous(), numel).view(shape)


def _masked_grad_torch(grad: Tensor, packed: Tensor, on: Optional[float],
                       off: Optional[float]) -> Tensor:
    """The unfused formula (a bool mask, then torch.where): the fallback without kernels, and
    the specification the fused kernels match bit for bit."""
    mask = unpack_mask(packed, grad.shape)
    a = grad if on is None else grad * on
    return torch.where(mask, a, 0.0 if off is None else grad * off)


_MASKED_GRAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even; inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def _float16(x: float) -> float:
    try:
        return struct.unpack("e", struct.pack("e", x))[0]
    except OverflowError:
        return math.inf


def _bfloat16(x: float) -> float:
    """A finite float32 value rounded to the nearest bfloat16 (ties to even), on its bits."""
    b = struct.unpack("I", struct.pack("f", x))[0]
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return struct.unpack("f", struct.pack("I", b << 16))[0]


_ROUND_SCALE = {torch.float32: lambda s: s, torch.float16: _float16, torch.bfloat16: _bfloat16}


def dropout_scale(dtype: torch.dtype, p: float) -> float:
    """``1 / (1 - p)`` rounded to ``dtype``, as torch's dropout computes its noise
    (``mask.to(dtype).div_(1 - p)``): the ``on`` factor :func:`masked_grad` takes for dropout.

    Host arithmetic, no tensor: that division on the CPU is a float32 division of 1 by
    ``1 - p`` rounded to float32, then rounded to ``dtype`` (float64: a double division);
    ``tests/test_quant.py`` checks every dtype against the tensor computation. Three operator
    calls and a read-back were paid per dropout backward."""
    if dtype == torch.float64:
        return 1.0 / (1 - p) if p != 1 else math.inf
    rnd = _ROUND_SCALE.get(dtype)
    d = _float32(1 - p)
    if rnd is None or d == 0:  # another dtype, or p == 1: the tensor computation itself
        return torch.ones((), dtype=dtype).div_(1 - p).item()
    return rnd(_float32(1.0 / d))


def masked_grad(grad: Tensor, packed: Tensor, on: Optional[float] = None,
                off: Optional[float] = None) -> Tensor:
    """Backward of a layer that saved a 1-bit mask, in one pass over ``grad``.

    ``packed`` is :func:`pack_mask` of a mask of ``grad``'s shape (logical order of ``grad``;
    callers with a channels_last mask pass ``grad`` permuted to the mask's memory order). Per
    element: where the bit is set ``grad`` (``on=None``) or ``grad * on``; elsewhere ``+0.0``
    (``off=None``) or ``grad * off``. ReLU/Hardtanh: (None, None); LeakyReLU: (None, slope);
    Dropout: (1/(1-p) rounded to grad's dtype, 0.0). Equal bit for bit to
    ``torch.where(unpack_mask(...), ...)`` (products rounded as torch rounds ``grad * scalar``),
    without materialising the bool mask: about half the memory traffic. Returns a contiguous
    tensor of ``grad``'s shape; without compiled kernels, for other dtypes, or when the result
    must be differentiable (backward with ``create_graph=True``) it runs that torch formula.
    """
    n = grad.numel()
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise ValueError(f"packed mask of {packed.numel()} bytes ({packed.dtype}) does not hold "
                         f"{n} values")
    fn = getattr(kernels(grad.device), "masked_grad", None)  # an older build may lack it
    if fn is None or n == 0 or grad.dtype not in _MASKED_GRAD_DTYPES \
            or (grad.requires_grad and torch.is_grad_enabled()):  # create_graph: differentiable
        return _masked_grad_torch(grad, packed, on, off)
    return fn(grad.contiguous(), packed.contiguous(), on, off)
