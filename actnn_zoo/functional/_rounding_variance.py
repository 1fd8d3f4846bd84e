"""An unbiased estimate of each value's stochastic-rounding variance, for backwards that are
quadratic in a saved tensor.

Stochastic rounding gives ``E[x_hat] = x``, so a backward linear in the saved ``x_hat`` is an
unbiased estimate of the exact gradient. Softmax (``dx = y * (g - <g, y>)``) and the norms
(``x_hat * mean(g * w * x_hat)``) multiply a value by a sum that contains that same value, and
``E[x_hat_i^2] = x_i^2 + Var(x_hat_i)``: the diagonal of the product is biased by
``-c_i Var(x_hat_i)``, ``c_i`` a factor the backward knows (``g_i`` for softmax,
``rstd * w * g_i / m`` for a norm over ``m`` values). Products of *different* values are
unbiased, since each value is rounded with its own random number.

No function of one stochastically rounded value estimates ``x_i^2`` (or the variance) without
bias: given the two levels around ``x_i``, ``E[h(x_hat_i)]`` is linear in the position ``f``
of ``x_i`` between them, while ``Var(x_hat_i) = step^2 f (1 - f)`` is quadratic. So the
variance is taken in forward, where ``x`` is known: ``v_i = step^2 f_i (1 - f_i)`` with the
step and levels the quantizer used (``(x - lo) * (1 / step)`` from the stored bf16 ``lo`` and
``step``, as the kernels compute codes), and saved cheaply:

* only every ``stride``-th value (flat logical index ``r, r + stride, ...``, the offset ``r``
  drawn uniformly from torch's generator), so each value is kept with probability
  ``1 / stride``;
* those values quantized at 1 bit, stochastically (the library's own unbiased quantizer), its
  three tensors saved as one uint8 buffer ``[lo (G bf16) | step (G bf16) | bits]`` (one saved
  tensor costs the autograd and capture hooks a few microseconds; :func:`unpack_codes`).

``stride * v_hat`` on the kept values and 0 elsewhere is then an unbiased estimate of every
``v_i``, and the correction ``c_i * estimate_i`` that backward adds makes the gradient exactly
unbiased (up to the 2^-24 resolution of the random numbers). Its own noise is small beside the
rounding noise of the gradient (``tests/test_bias.py`` measures both). Cost at the default
``stride`` of 8: 1/8 bit per value plus the 1-bit group metadata, about 0.14 bit per value
(+7% on a 2-bit tensor), and a forward pass over ``1 / stride`` of the values.

Host cost: a Q-layer must cost microseconds, and the first version (about twenty small torch
ops and two ``.item()`` draws per call) added ~300 us to a tiny LayerNorm call. On the CPU
each direction is now one compiled call (``cpp_ext/variance_cpu.cpp``: the variances computed,
quantized at 1 bit and packed in one loop; the correction added in place through any strides),
and the (offset, seed) pair of a call comes from torch's default generator without a tensor
read (``draw_sample``). On CUDA (``cpp_ext/variance_cuda.cu``, not yet run on a GPU) the
forward is a kernel for the variances and the library's quantize kernel, the correction one
kernel; the per-value arithmetic of both devices is one header (``cpp_ext/variance.h``).
:func:`_sample_torch` and :func:`_correct_torch` are the torch twins, equal bit for bit
(``tests/test_rounding_variance_kernels.py``, and ``tests/test_cuda.py`` on a GPU); they run
elsewhere (float64 gradients, a build without the extension or its CUDA kernels), still
without a device synchronisation.

Applies to plain stochastic codes (:class:`~actnn_zoo.quant.QuantizedTensor` without a
rotation or exact-zero coding); other payloads (DIVISION, the Hadamard rotation, whose errors
are correlated within a group, round-to-nearest) get no correction (docs/design.md, "Which
Functions are unbiased").
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..quant import QuantizedTensor, dequantize, quantize
from ..quant.api import draw_seed
from ..quant.backend import extension, kernels

__all__ = ["VARIANCE_STRIDE", "VARIANCE_BITS", "Sample", "Stat", "add_at", "correct_",
           "draw_sample", "norm_stride", "pack_codes", "sample_variance", "unpack_codes",
           "variance_estimate", "variance_indices", "variance_nbytes"]

#: One value in this many has its rounding variance saved (see the module docstring).
VARIANCE_STRIDE = 8
#: Width of the saved variances (stochastic, so their estimate stays unbiased).
VARIANCE_BITS = 1
_VARIANCE_GROUP = 256
_MAX_KERNEL_DIMS = 16  # Strided in cpp_ext/variance_cpu.cpp

Sample = Tuple[int, int]  # (offset, stride) of the kept values
#: Which statistic (or weight) a flat logical index ``i`` reads: ``(block, period)`` ->
#: ``(i // block) % period``, no wrap when ``period`` is 0. Layer norm over ``m`` values:
#: ``(m, 0)`` for the row statistics, ``(1, m)`` for the weight; batch norm over ``c`` channels
#: of ``hw`` positions: ``(hw, c)`` for both.
Stat = Tuple[int, int]
_ONE: Stat = (1, 0)


def variance_indices(offset: int, stride: int, numel: int, device: torch.device) -> Tensor:
    """The flat logical indices whose variance is kept: ``offset, offset + stride, ...``
    (none when the offset passes the end: arange would raise for an offset beyond it)."""
    return torch.arange(min(offset, numel), numel, stride, dtype=torch.int64, device=device)


def _plain(q: object, rounding: str) -> bool:
    return (rounding == "stochastic" and isinstance(q, QuantizedTensor)
            and q.transform == "none")


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    """The compiled function ``name``, or None (no extension, an older build without it);
    cached like ``quant.backend``'s choice (a loaded library, not configuration): every call of
    a Q-layer asks."""
    ext = extension()
    return getattr(ext, name, None) if ext is not None else None


def _kernel(name: str, device: torch.device):
    """The compiled kernel ``name`` for tensors on ``device`` (the extension's, which runs CPU
    and, in a CUDA build, CUDA tensors; the meta device's shape-only stand-in), or None: the
    torch twin runs."""
    if device.type == "cpu":
        return _compiled(name)
    return getattr(kernels(device), name, None)


def draw_sample(stride: int) -> Sample:
    """(offset uniform in ``[0, stride)``, 31-bit seed of the 1-bit quantizer) for one call,
    from torch's default generator (``torch.manual_seed`` makes it reproducible). With the
    compiled extension it is read without a tensor (no ``_local_scalar_dense`` per call)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    fn = _compiled("draw_sample")
    if fn is not None:
        return fn(stride)
    return int(torch.randint(0, stride, (1,)).item()), draw_seed()


def _stat_of(idx: Tensor, stat: Stat) -> Tensor:
    block, period = stat
    s = idx // block
    return s % period if period > 0 else s


def _as_kernel_vector(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` as the kernels read a statistic or weight: contiguous, of ``dtype`` (a no-op for
    the usual float32 statistics and weights)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.detach().to(dtype).contiguous()


def _check_stat(stat: Stat, name: str) -> None:
    if stat[0] < 1 or stat[1] < 0:
        raise ValueError(f"{name} must be (block >= 1, period >= 0), got {stat}")


def sample_variance(q: object, src: Tensor, rounding: str, stride: int = VARIANCE_STRIDE, *,
                    shift: Optional[Tensor] = None, scale: Optional[Tensor] = None,
                    stat: Stat = _ONE, draw: Optional[Sample] = None
                    ) -> Tuple[Optional[Sample], Optional[Tensor]]:
    """((offset, stride), 1-bit codes of the rounding variances at ``variance_indices(offset,
    stride, ...)`` packed in one uint8 buffer (:func:`unpack_codes`)) for a payload ``q``, or
    (None, None) when ``q`` gets no correction (see the module docstring). The values that
    were quantized, at flat logical index ``i`` of
    ``q.shape``: ``src[i]`` (``src`` of ``q``'s numel, any strides), or for a norm's fused
    quantizer ``(src[i] - shift[s]) * scale[s]`` with ``s`` from ``stat`` (:data:`Stat`),
    computed as ``functional.norm._normalize`` computes it (float64 for a float64 ``src``,
    else float32). The offset is uniform in ``[0, stride)`` even when that passes the end: each
    value is kept with probability exactly ``1 / stride``. The codes always hold
    ``ceil(numel / stride)`` values (zeros past the kept ones), so what is saved does not
    depend on the draw (:func:`variance_nbytes`). ``draw``: the (offset, seed) pair, drawn by
    :func:`draw_sample` when None (tests pass one to compare kernel and twin)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if not _plain(q, rounding):
        return None, None
    numel = q.numel()
    if numel == 0:
        return None, None
    if src.numel() != numel:
        raise ValueError(f"src has {src.numel()} values for a payload of {numel}")
    if (shift is None) != (scale is None):
        raise ValueError("shift and scale must be given together")
    _check_stat(stat, "stat")
    offset, seed = draw_sample(stride) if draw is None else draw
    if not 0 <= offset < stride:
        raise ValueError(f"offset must be in [0, {stride}), got {offset}")
    fn = _kernel("rounding_variance_codes", src.device)
    if fn is not None and src.dim() <= _MAX_KERNEL_DIMS and src.dtype in _SRC_DTYPES:
        work = torch.float64 if src.dtype == torch.float64 else torch.float32
        codes = fn(q.lo, q.step, q.row_bits, q.bits or 0, q.group_size, src,
                   _as_kernel_vector(shift, work), _as_kernel_vector(scale, work), stat[0],
                   stat[1], offset, stride, seed)
    else:
        codes = _sample_torch(q, src, shift, scale, stat, offset, stride, seed)
    return (offset, stride), codes


_SRC_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _values_torch(src: Tensor, idx: Tensor, shift: Optional[Tensor], scale: Optional[Tensor],
                  stat: Stat) -> Tensor:
    """The quantized values at flat logical indices ``idx`` (float32), as
    :func:`sample_variance` describes them."""
    x = torch.take(src.detach(), idx)
    if shift is None:
        return x.float()
    work = torch.float64 if src.dtype == torch.float64 else torch.float32
    s = _stat_of(idx, stat)
    m, c = shift.detach().reshape(-1)[s], scale.detach().reshape(-1)[s]
    return ((x.to(work) - m.to(work)) * c.to(work)).float()


def _sample_torch(q: QuantizedTensor, src: Tensor, shift: Optional[Tensor],
                  scale: Optional[Tensor], stat: Stat, offset: int, stride: int,
                  seed: int) -> Tensor:
    """The torch twin of the compiled ``rounding_variance_codes`` (bit for bit): any device."""
    numel = q.numel()
    dev = q.lo.device
    idx = variance_indices(offset, stride, numel, dev)
    shape = q.shape
    n = shape[0] if len(shape) >= 2 else 1
    d = numel // n
    row, col = idx // d, idx % d
    grp = col // q.group_size
    lo = q.lo[row, grp].float()
    step = q.step[row, grp].float()
    if q.mixed:
        levels = torch.exp2(q.row_bits[row].float()) - 1.0
    else:
        levels = torch.full_like(lo, float(2 ** q.bits - 1))
    v = (_values_torch(src, idx, shift, scale, stat).to(dev) - lo) * (1.0 / step)
    f = v - torch.floor(v)
    inside = (v > 0) & (v < levels) & torch.isfinite(v)  # at a clamp the code is deterministic
    var = torch.zeros(_slots(numel, stride), dtype=torch.float32, device=dev)
    var[:idx.numel()] = torch.where(inside, step * step * (f * (1.0 - f)), torch.zeros_like(v))
    return pack_codes(quantize(var, VARIANCE_BITS, _VARIANCE_GROUP, seed=seed,
                               rounding="stochastic"))


def pack_codes(q: QuantizedTensor) -> Tensor:
    """The saved form of the 1-bit variance codes: ``[lo | step | data]`` as one uint8 tensor
    (bf16 metadata first, so that its views stay aligned)."""
    return torch.cat([q.lo.reshape(-1).view(torch.uint8), q.step.reshape(-1).view(torch.uint8),
                      q.data])


def unpack_codes(codes: Tensor, numel: int, stride: int) -> QuantizedTensor:
    """The 1-bit QuantizedTensor of ``ceil(numel / stride)`` variances that
    :func:`pack_codes` (or the compiled kernel) packed into ``codes`` (views, no copy)."""
    k = _slots(numel, stride)
    g = -(-k // _VARIANCE_GROUP)
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != variance_nbytes(
            numel, stride):
        raise ValueError(f"variance codes of {numel} values at stride {stride} are "
                         f"{variance_nbytes(numel, stride)} uint8 bytes, got "
                         f"{codes.numel()} {codes.dtype}")
    lo = codes[:2 * g].view(torch.bfloat16).view(1, g)
    step = codes[2 * g:4 * g].view(torch.bfloat16).view(1, g)
    return QuantizedTensor(codes[4 * g:], lo, step, torch.Size((k,)), torch.float32,
                           VARIANCE_BITS, _VARIANCE_GROUP)


def _slots(numel: int, stride: int) -> int:
    return -(-numel // stride)


def variance_nbytes(numel: int, stride: int) -> int:
    """Bytes :func:`sample_variance` saves for a payload of ``numel`` values: 1-bit codes of
    ``ceil(numel / stride)`` values plus a bf16 (lo, step) pair per group of 256."""
    k = _slots(numel, stride)
    return -(-k * VARIANCE_BITS // 8) + 4 * -(-k // _VARIANCE_GROUP)


def norm_stride(m: int) -> int:
    """The stride for a norm over ``m`` values. The bias falls as 1/m, and so does the
    correction's own noise relative to the gradient's, but more slowly: measured on layer norm
    at 2 bits, the correction adds about ``0.107 * stride / m^0.75`` to the variance of the
    input gradient (11% at m = 16 and stride 8, 1.3% at m = 256, 23% at m = 256 and stride
    128). ``m^0.75 / 2`` keeps that near 5% while the saved bits fall with m (0.28 bit per
    value at m <= 16, 0.017 at m = 768, 0.003 at m = 8192)."""
    return max(4, int(round(0.5 * float(m) ** 0.75)))


def variance_estimate(sample: Optional[Sample], codes: Optional[Tensor], numel: int
                      ) -> Optional[Tuple[Tensor, Tensor]]:
    """(flat logical indices, unbiased estimates ``stride * v_hat`` of the rounding variance
    there), the rest of the tensor's estimate being 0; None where :func:`sample_variance` kept
    nothing."""
    if sample is None or codes is None:
        return None
    offset, stride = sample
    idx = variance_indices(offset, stride, numel, codes.device)
    v = dequantize(unpack_codes(codes, numel, stride)).float()
    return idx, v[:idx.numel()].mul_(float(stride))


def add_at(out: Tensor, idx: Tensor, vals: Tensor) -> Tensor:
    """``out`` with ``vals`` added at flat logical indices ``idx`` (any memory layout)."""
    out.put_(idx, vals.to(out.dtype), accumulate=True)
    return out


def correct_(grad_in: Optional[Tensor], grad: Tensor, sample: Optional[Sample],
             codes: Optional[Tensor], *, scale: Optional[Tensor] = None,
             weight: Optional[Tensor] = None, stat: Stat = _ONE, weight_stat: Stat = _ONE,
             divisor: float = 1.0) -> Optional[Tensor]:
    """``grad_in`` (modified in place) plus ``(grad[i] * c_i) * estimate_i`` at the sampled
    indices: the bias ``-c_i Var(x_hat_i)`` of the quadratic term removed (module docstring).
    ``c_i = scale[s] * weight[w] / divisor``, ``s`` and ``w`` from ``stat`` and
    ``weight_stat`` (:data:`Stat`), each factor optional: softmax passes none (``c_i = 1``), a
    norm over ``m`` values its ``rstd`` / ``invstd``, its weight and ``m``. ``grad``: the
    incoming gradient, of ``grad_in``'s shape (any strides). A None ``grad_in``, ``sample`` or
    ``codes`` returns ``grad_in`` untouched."""
    if grad_in is None or sample is None or codes is None:
        return grad_in
    if tuple(grad.shape) != tuple(grad_in.shape):
        raise ValueError(f"grad {tuple(grad.shape)} and grad_in {tuple(grad_in.shape)} must "
                         "have one shape")
    _check_stat(stat, "stat")
    _check_stat(weight_stat, "weight_stat")
    offset, stride = sample
    fn = _kernel("rounding_variance_correct_", grad_in.device)
    if (fn is not None and grad_in.dtype == torch.float32 and grad.dtype == torch.float32
            and grad_in.dim() <= _MAX_KERNEL_DIMS):
        fn(grad_in, grad, codes, offset, stride,
           _as_kernel_vector(scale, torch.float32), stat[0], stat[1],
           _as_kernel_vector(weight, torch.float32), weight_stat[0], weight_stat[1],
           float(divisor))
        return grad_in
    return _correct_torch(grad_in, grad, offset, stride, codes, scale, weight, stat,
                          weight_stat, divisor)


def _correct_torch(grad_in: Tensor, grad: Tensor, offset: int, stride: int,
                   codes: Tensor, scale: Optional[Tensor], weight: Optional[Tensor],
                   stat: Stat, weight_stat: Stat, divisor: float) -> Tensor:
    """The torch twin of the compiled ``rounding_variance_correct_`` (bit for bit on float32
    gradients; a float64 one takes the product in float64): any device."""
    est = variance_estimate((offset, stride), codes, grad_in.numel())
    idx, v = est
    c: Optional[Tensor] = None
    if scale is not None:
        c = scale.detach().reshape(-1)[_stat_of(idx, stat)].float()
    if weight is not None:
        w = weight.detach().reshape(-1)[_stat_of(idx, weight_stat)].float()
        c = w if c is None else c * w
    if divisor != 1.0:
        c = (torch.ones((), device=idx.device) if c is None else c) / float(divisor)
    work = torch.float64 if grad_in.dtype == torch.float64 else torch.float32
    g = torch.take(grad.detach(), idx).to(work)
    t = g * c.to(work) if c is not None else g
    return add_at(grad_in, idx, t * v.to(work))
