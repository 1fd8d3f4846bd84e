"""What a precision strategy observes on a Q-layer, and how to observe it without touching the
layers: which tensor each layer compresses, its per-sample range statistic, the op's factor.

The per-sample statistic is ``sum over groups g of len_g * range_g^2`` of the tensor the layer
compresses (row n = sample n, groups of ``group_size`` as in the quantization contract). The
stochastic-rounding variance of a value in group g at b bits is at most
``(range_g / (2^b - 1))^2 / 4``, so the statistic divided by (2^b - 1)^2 is proportional to the
bound on the sample's total quantization variance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional._saving import produce_bounds
from ..functional.activation import activation_derivative
from ..functional.softmax import softmax_dim
from ..nn import activation as qact
from ..nn import conv as qconv
from ..nn import norm as qnorm
from ..nn.linear import QLinear
from ..nn.rmsnorm import QRMSNorm
from ..nn.softmax import QSoftmax
from ..nn.third_party import QHFConv1D, QLayerNorm2d
from ..quant.api import SampleBits, as_rows, no_graph
from ..quant.backend import kernels
from .base import set_sample_bits

__all__ = ["LayerStats", "LayerKind", "layer_kind", "range_statistic", "sample_grad_sq",
           "saved_statistic", "saved_tensor", "chunked_statistic"]


@dataclass
class LayerStats:
    """Observations of one Q-layer, kept on ``module.precision_stats``.

    A layer may run several times in one training forward (weight sharing, a recurrent
    cell): each call saves its own compressed tensor, so each call counts. ``calls``: how many
    calls compressed in the last training forward; ``samples``: the rows they compressed,
    all calls together (stacked in call order); ``values``: the values they compressed;
    ``numel``: values per row (``values // samples``: exact when every call has the same row
    size). Host ints, from shapes; 0 before the first. ``range_sq``: (samples,) float32
    per-row statistic of that forward, on the layer's device. ``grad_sq``: 0-d tensor, the
    squared norm of the layer's output gradient per row from the last recorded backward,
    ``sample_grad_sq`` (samples,) the same for each row (each call's rows get that call's
    output gradient). ``bits``: the (samples,) widths the strategy chose for that forward
    (None when the layer used its ``qconfig.bits``).
    """

    numel: int = 0
    samples: int = 0
    range_sq: Optional[Tensor] = None
    grad_sq: Optional[Tensor] = None
    sample_grad_sq: Optional[Tensor] = None
    bits: Optional[Tensor] = None
    calls: int = 0
    values: int = 0


def count_call(stats: LayerStats, first: bool, samples: int, numel: int) -> None:
    """Add one call's saved size to ``stats``: the first call of a step restarts the totals, a
    later call of the same layer in that step (weight sharing, recurrence) adds to them, so a
    layer called twice weighs twice in the budget."""
    if first:
        stats.calls = stats.values = stats.samples = 0
    stats.calls += 1
    stats.values += samples * numel
    stats.samples += samples
    stats.numel = stats.values // max(1, stats.samples)


def set_width(module: nn.Module, stats: LayerStats, width: int, samples: int,
              device: torch.device, cache: Optional[SampleBits]) -> Optional[SampleBits]:
    """Give every sample of this call ``width`` bits. The layer's own ``qconfig.bits`` needs no
    per-sample widths; another width reuses ``cache`` while the batch size, device and width
    are unchanged (no allocation per step). Returns the cache to keep."""
    if width == module.qconfig.bits:  # type: ignore[attr-defined]
        set_sample_bits(module, None)
        stats.bits = None
        return cache
    if (cache is None or cache.bits.shape[0] != samples or cache.bits.device != device
            or cache.max_sum != samples * width):
        cache = SampleBits(torch.full((samples,), width, dtype=torch.uint8, device=device),
                           samples * width)
    set_sample_bits(module, cache)  # this thread's forward (base.set_sample_bits)
    stats.bits = cache.bits
    return cache


def range_statistic(t: Tensor, group_size: int) -> Tensor:
    """(N,) float32: per sample, ``sum_g len_g * (max_g - min_g)^2`` over its groups.

    Groups holding NaN/Inf count 0: they dequantize to NaN whatever their width. One pass of
    the compiled extension on the CPU and, in a CUDA build, on CUDA (``cpp_ext/widths_cpu.cpp``,
    ``widths_cuda.cu``: the same values on both; equal to the torch version up to float
    rounding), elsewhere two torch reductions.
    """
    rows = as_rows(no_graph(t))
    kernel = (getattr(kernels(rows.device), "range_statistic", None)
              if rows.is_contiguous() else None)
    if kernel is not None and rows.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return kernel(rows, group_size)
    return _range_statistic_torch(rows, group_size)


def _range_statistic_torch(rows: Tensor, group_size: int) -> Tensor:
    """:func:`range_statistic` of (N, D) rows as torch reductions (any device)."""
    n, d = rows.shape
    full = d - d % group_size
    out: Optional[Tensor] = None
    if full:
        groups = (rows if full == d else rows[:, :full]).reshape(n, full // group_size,
                                                                 group_size)
        out = _squared_ranges(groups).sum(1).mul_(float(group_size))
    if full < d:
        tail = _squared_ranges(rows[:, full:]).mul_(float(d - full))
        out = tail if out is None else out.add_(tail)
    assert out is not None
    return out


def _squared_ranges(x: Tensor) -> Tensor:
    """(max - min)^2 over the last dim, float32, non-finite -> 0."""
    # amax and amin, not aminmax: on CPU the fused kernel does not vectorise (16x slower).
    r = x.amax(-1) - x.amin(-1)
    r = r.float().square_() if r.dtype != torch.float32 else r.square_()
    return torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)


def sample_grad_sq(grad: Tensor, samples: int) -> Tensor:
    """(samples,) float32: each sample's squared output-gradient norm (one entry, the whole
    norm, when the output has no batch dim of that size). Stays on grad's device."""
    g = no_graph(grad)  # a hook's gradient has no graph unless create_graph: no detach op
    # accumulate in float32 (float64 for a float64 model: vector_norm does not narrow)
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    if samples > 1 and g.dim() > 0 and g.shape[0] == samples:
        norms = torch.linalg.vector_norm(g.reshape(samples, -1), dim=1, dtype=acc)
        return (norms if acc == torch.float32 else norms.float()).square()
    return torch.linalg.vector_norm(g, dtype=acc).float().square().reshape(1).expand(
        max(samples, 1)) / max(samples, 1)


# ----------------------------------------------------------------------------- layer kinds
def _conv_batched(mod: nn.Module, x: Tensor) -> Tensor:
    """Convs compress an unbatched input as a batch of one (nn/conv.py's _run)."""
    return x.unsqueeze(0) if x.dim() == mod._DIMS + 1 else x  # type: ignore[attr-defined]


def _channels_last(mod: nn.Module, x: Tensor) -> Tensor:
    """QLayerNorm2d normalises NCHW input over C as NHWC rows (nn/third_party.py)."""
    return x.permute(0, 2, 3, 1) if x.dim() == 4 else x


def _conv_fan(mod: nn.Module, rows: Tensor) -> float:
    """Weights each input value meets in the weight gradient, kernel area x input channels per
    group (transposed: divided by the stride's area), over ActNN's 4."""
    fan = math.prod(mod.kernel_size) * mod.in_channels / mod.groups  # type: ignore[attr-defined]
    if isinstance(mod, qconv._QConvTransposeNd):
        fan /= math.prod(mod.stride)  # type: ignore[attr-defined]
    return float(fan) / 4.0


def _linear_fan(mod: nn.Module, rows: Tensor) -> float:
    """Input features (Hugging Face's ``Conv1D``: ``nx``) over ActNN's 4."""
    if isinstance(mod, QHFConv1D):
        return float(mod.nx) / 4.0
    return float(mod.in_features) / 4.0  # type: ignore[attr-defined]


def _norm_fan(mod: nn.Module, rows: Tensor) -> float:
    """Channels (BatchNorm, GroupNorm) or normalised features (LayerNorm, RMSNorm), as ActNN
    weighs BatchNorm: their noise reaches the earlier layers' weight gradients through
    grad_input."""
    if isinstance(mod, (qnorm.QLayerNorm, QLayerNorm2d, QRMSNorm)):
        return float(math.prod(mod.normalized_shape))
    if isinstance(mod, qnorm.QGroupNorm):
        return float(mod.num_channels)
    return float(mod.num_features)  # type: ignore[attr-defined]


def _feature_fan(mod: nn.Module, rows: Tensor) -> float:
    """Elementwise activations, by analogy with norms: the feature size (dim 1 of 4-d/5-d
    conv activations, the last dim otherwise)."""
    if rows.dim() <= 1:
        return 1.0
    return float(rows.shape[1] if rows.dim() >= 4 else rows.shape[-1])


def _softmax_fan(mod: nn.Module, rows: Tensor) -> float:
    """The normalised dim's size (softmax mixes the gradient along it)."""
    if rows.dim() == 0:
        return 1.0
    return float(rows.shape[softmax_dim(rows.dim(), mod.dim)])  # type: ignore[attr-defined]


def _input_trains(mod: nn.Module, x: Tensor) -> bool:
    return x.requires_grad


_DERIV = {
    qact.QGELU: ("gelu", lambda m: (m.approximate,)),
    qact.QSiLU: ("silu", lambda m: ()),
    qact.QSigmoid: ("sigmoid", lambda m: ()),
    qact.QTanh: ("tanh", lambda m: ()),
    qact.QELU: ("elu", lambda m: (m.alpha,)),
    qact.QSoftplus: ("softplus", lambda m: (m.beta, m.threshold)),
    qact.QHardswish: ("hardswish", lambda m: ()),
    qact.QHardsigmoid: ("hardsigmoid", lambda m: ()),
    qact.QMish: ("mish", lambda m: ()),
}


def _derivative(mod: nn.Module, x: Tensor) -> Tensor:
    """f'(x), the tensor derivative activations compress (same formulas as the Function)."""
    op, params = _DERIV[type(mod)]
    y = None
    if op == "sigmoid":
        y = torch.sigmoid(x)
    elif op == "tanh":
        y = torch.tanh(x)
    return activation_derivative(op, x, y, params(mod))


def _normalized(mod: nn.Module, x: Tensor) -> Tensor:
    """The normalised input, what LayerNorm, RMSNorm and GroupNorm compress. Their
    normalisation takes each row's (or group's) scale out, so the input's own ranges would
    rank the samples wrongly: a sample of small scale is saved at the same range as any
    other, and its input gradient is the larger, by its 1 / std."""
    if isinstance(mod, QRMSNorm):
        return F.rms_norm(x, tuple(mod.normalized_shape), eps=mod.eps)
    if isinstance(mod, qnorm.QGroupNorm):
        return F.group_norm(x, mod.num_groups, eps=mod.eps)
    return F.layer_norm(x, tuple(mod.normalized_shape), eps=mod.eps)  # type: ignore[arg-type]


def _softmax_out(mod: nn.Module, x: Tensor) -> Tensor:
    return F.softmax(x, softmax_dim(x.dim(), mod.dim))  # type: ignore[attr-defined]


def same_tensor(mod: nn.Module, x: Tensor) -> Tensor:
    """The input itself: what conv, linear and norm layers compress (a strategy reads it
    through kernels that take it detached, so it needs no ``no_grad`` context)."""
    return x


@dataclass(frozen=True)
class LayerKind:
    """How one family of Q-layers compresses. ``batched(mod, x)``: the input as the Function
    sees it (rows = samples); ``saved(mod, rows)``: the tensor it compresses;
    ``compresses(mod, x)``: whether a training forward compresses at all; ``fan(mod, rows)``:
    the op factor times values per sample (``C = fan / D * S * R``, see ``actnn.py``);
    ``modelled``: the saved tensor only enters the layer's own weight gradient (conv, linear),
    where C predicts the variance it adds (within 2-3x, measured); for the other kinds the
    noise enters the input gradient and propagates through every earlier layer, which no
    local statistic predicts reliably (``actnn.py`` then gives them the plain budget)."""

    name: str
    batched: Callable[[nn.Module, Tensor], Tensor]
    saved: Callable[[nn.Module, Tensor], Tensor]
    compresses: Callable[[nn.Module, Tensor], bool]
    fan: Callable[[nn.Module, Tensor], float]
    modelled: bool = False


def _weight_fn(m: nn.Module, x: Tensor) -> bool:
    """conv / linear compress their input only when the weight needs a gradient (then their
    Function runs, as in nn/linear.py's use_function)."""
    return bool(m.weight.requires_grad)  # type: ignore[attr-defined]


def _norm_fn(m: nn.Module, x: Tensor) -> bool:
    """Norms read the input back for the input gradient or the weight gradient (either one
    needed also makes their Function run)."""
    if x.requires_grad:
        return True
    w = getattr(m, "weight", None)
    return w is not None and w.requires_grad


_CONV = LayerKind("conv", _conv_batched, same_tensor, _weight_fn, _conv_fan, modelled=True)
_LINEAR = LayerKind("linear", same_tensor, same_tensor, _weight_fn, _linear_fan, modelled=True)
_NORM = LayerKind("norm", same_tensor, same_tensor, _norm_fn, _norm_fan)  # BatchNorm
_ROW_NORM = LayerKind("norm", same_tensor, _normalized, _norm_fn, _norm_fan)
_NORM_2D = LayerKind("norm", _channels_last, _normalized, _norm_fn, _norm_fan)
_ACT = LayerKind("derivative", same_tensor, _derivative, _input_trains, _feature_fan)
_SOFTMAX = LayerKind("softmax", same_tensor, _softmax_out, _input_trains, _softmax_fan)

_KINDS: Tuple[Tuple[type, LayerKind], ...] = (
    (qconv._QConvNd, _CONV), (qconv._QConvTransposeNd, _CONV), (QLinear, _LINEAR),
    (QHFConv1D, _LINEAR), (qnorm._QBatchNorm, _NORM), (qnorm.QLayerNorm, _ROW_NORM),
    (QLayerNorm2d, _NORM_2D), (qnorm.QGroupNorm, _ROW_NORM), (QRMSNorm, _ROW_NORM),
    *((cls, _ACT) for cls in _DERIV), (QSoftmax, _SOFTMAX),
)


def saved_tensor(kind: LayerKind, mod: nn.Module, rows: Tensor
                 ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(the tensor ``mod`` compresses for input ``rows``, made whole; that tensor again when the
    layer may use it instead of making it, else None).

    An activation's f'(x) is made here from the input, as the layer's Function makes it: the
    layer is handed it (``ThreadWidths.hand_derivative``) instead of computing it a second
    time. Where the Function makes f'(x) a chunk of samples at a time (``compress_produced``:
    a large map, whole it would set the forward's peak) it is not made here: (None, None)."""
    if kind.saved is same_tensor:
        return rows, None
    if kind.saved is _derivative:
        if produce_bounds(rows.shape, rows.device) is not None:
            return None, None
        d = _derivative(mod, rows)
        return d, d
    return kind.saved(mod, rows), None


def saved_statistic(kind: LayerKind, mod: nn.Module, rows: Tensor, group_size: int
                    ) -> Tuple[Tensor, Optional[Tensor]]:
    """(:func:`range_statistic` of the tensor ``mod`` compresses for input ``rows``, that
    tensor when the layer may use it, else None; see :func:`saved_tensor`). An f'(x) the
    Function makes in chunks is made in the same chunks here; the statistic is per row, so it
    is the same either way."""
    saved, made = saved_tensor(kind, mod, rows)
    if saved is None:
        return chunked_statistic(mod, rows, group_size), None
    return range_statistic(saved, group_size), made


def chunked_statistic(mod: nn.Module, rows: Tensor, group_size: int) -> Tensor:
    """:func:`range_statistic` of an activation's f'(x) made in the chunks of samples its
    Function makes it in (where :func:`saved_tensor` gives None)."""
    bounds = produce_bounds(rows.shape, rows.device)
    assert bounds is not None
    return torch.cat([range_statistic(_derivative(mod, rows[a:b]), group_size)
                      for a, b in zip(bounds[:-1], bounds[1:])])


def layer_kind(module: nn.Module) -> Optional[LayerKind]:
    """The kind of a Q-layer whose Function compresses a tensor with the qconfig's width
    (``module.bits_for``), or None (masks, pooling indices, shape-only layers)."""
    for cls, kind in _KINDS:
        if isinstance(module, cls):
            return kind
    return None
