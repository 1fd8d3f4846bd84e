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
  drawn from torch's generator), so each value is kept with probability ``1 / stride``;
* those values quantized at 1 bit, stochastically (the library's own unbiased quantizer).

``stride * v_hat`` on the kept values and 0 elsewhere is then an unbiased estimate of every
``v_i``, and the correction ``c_i * estimate_i`` that backward adds makes the gradient exactly
unbiased (up to the 2^-24 resolution of the random numbers). Its own noise is small beside the
rounding noise of the gradient (``tests/test_bias.py`` measures both). Cost at the default
``stride`` of 8: 1/8 bit per value plus the 1-bit group metadata, about 0.14 bit per value
(+7% on a 2-bit tensor), and a forward pass over ``1 / stride`` of the values.

Applies to plain stochastic codes (:class:`~actnn_zoo.quant.QuantizedTensor` without a
rotation or exact-zero coding); other payloads (DIVISION, the Hadamard rotation, whose errors
are correlated within a group, round-to-nearest) get no correction (docs/design.md, "Which
Functions are unbiased").
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..quant import QuantizedTensor, dequantize, quantize

__all__ = ["VARIANCE_STRIDE", "VARIANCE_BITS", "add_at", "norm_stride", "sample_variance",
           "variance_estimate", "variance_indices", "variance_nbytes"]

#: One value in this many has its rounding variance saved (see the module docstring).
VARIANCE_STRIDE = 8
#: Width of the saved variances (stochastic, so their estimate stays unbiased).
VARIANCE_BITS = 1
_VARIANCE_GROUP = 256


def variance_indices(offset: int, stride: int, numel: int, device: torch.device) -> Tensor:
    """The flat logical indices whose variance is kept: ``offset, offset + stride, ...``."""
    return torch.arange(offset, numel, stride, dtype=torch.int64, device=device)


def _plain(q: object, rounding: str) -> bool:
    return (rounding == "stochastic" and isinstance(q, QuantizedTensor)
            and q.transform == "none")


Sample = Tuple[int, int]  # (offset, stride) of the kept values


def sample_variance(q: object, values: Callable[[Tensor], Tensor], rounding: str,
                    stride: int = VARIANCE_STRIDE
                    ) -> Tuple[Optional[Sample], Optional[QuantizedTensor]]:
    """((offset, stride), 1-bit codes of the rounding variances at ``variance_indices(offset,
    stride, ...)``) for a payload ``q``, or (None, None) when ``q`` gets no correction (see the
    module docstring). ``values(idx)``: the float32 values that were quantized, at flat logical
    indices ``idx`` of ``q.shape`` (computed the way the quantizer got them). The offset is
    uniform in ``[0, stride)`` even when that passes the end: each value is kept with
    probability exactly ``1 / stride``. The codes always hold ``ceil(numel / stride)`` values
    (zeros past the kept ones), so what is saved does not depend on the draw
    (:func:`variance_nbytes`)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if not _plain(q, rounding) or q.numel() == 0:
        return None, None
    numel = q.numel()
    dev = q.lo.device
    offset = int(torch.randint(0, stride, (1,)).item())
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
    v = (values(idx).float() - lo) * (1.0 / step)
    f = v - torch.floor(v)
    inside = (v > 0) & (v < levels) & torch.isfinite(v)  # at a clamp the code is deterministic
    var = torch.zeros(_slots(numel, stride), dtype=torch.float32, device=dev)
    var[:idx.numel()] = torch.where(inside, step * step * (f * (1.0 - f)), torch.zeros_like(v))
    codes = quantize(var, VARIANCE_BITS, _VARIANCE_GROUP, rounding="stochastic")
    return (offset, stride), codes


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


def variance_estimate(sample: Optional[Sample], codes: Optional[QuantizedTensor], numel: int
                      ) -> Optional[Tuple[Tensor, Tensor]]:
    """(flat logical indices, unbiased estimates ``stride * v_hat`` of the rounding variance
    there), the rest of the tensor's estimate being 0; None where :func:`sample_variance` kept
    nothing."""
    if sample is None or codes is None:
        return None
    offset, stride = sample
    idx = variance_indices(offset, stride, numel, codes.device)
    return idx, dequantize(codes).float()[:idx.numel()].mul_(float(stride))


def add_at(out: Tensor, idx: Tensor, vals: Tensor) -> Tensor:
    """``out`` with ``vals`` added at flat logical indices ``idx`` (any memory layout)."""
    out.put_(idx, vals.to(out.dtype), accumulate=True)
    return out
