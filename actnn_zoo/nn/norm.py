"""QBatchNorm1d/2d/3d, QSyncBatchNorm, QLayerNorm, QGroupNorm: normalizations that save their
input compressed.

Saves: compress(x) + the exact statistics (BatchNorm: per-channel mean and invstd; LayerNorm /
GroupNorm: per-row mean and rstd) + the weight Parameter. Forward computes the real op on the
uncompressed input (``aten::native_*_norm``, the kernel torch's functional op ends in), and
updates running statistics exactly as torch does (momentum, momentum=None cumulative average,
num_batches_tracked). Backward: dequantize x, then ``aten::native_*_norm_backward``
(QSyncBatchNorm: two all-reduced sums, like nn.SyncBatchNorm). Eval / no_grad /
qconfig.enabled=False: plain torch forward.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.norm import (NormalizedBatchNorm, NormalizedLayerNorm, SyncBatchNormFunction,
                               batch_norm_train, group_norm_train, layer_norm_train)
from ._base import QModule
from .linear import use_function


def _verify_batch_size(size: Sequence[int]) -> None:
    """The check F.batch_norm / F.group_norm make in training (same message)."""
    size_prods = size[0]
    for s in size[2:]:
        size_prods *= s
    if size_prods == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input "
                         f"size {torch.Size(size)}")


def _check_input_rank(layer: QModule, input: Tensor) -> None:
    """The input-rank check of torch's BatchNorm classes, same messages, from the Q class's
    ``_INPUT_RANKS`` (torch's own check, ``_check_input_dim``, is private)."""
    ranks = layer._INPUT_RANKS
    if (input.dim() >= 2) if ranks == "2+" else (input.dim() in ranks):
        return
    want = {"2+": "at least 2D", (2, 3): "2D or 3D"}.get(ranks, f"{ranks[0]}D")
    raise ValueError(f"expected {want} input (got {input.dim()}D input)")


class _QBatchNorm(QModule):
    """forward for QBatchNorm1d/2d/3d and QSyncBatchNorm (mirrors nn.modules.batchnorm).

    ``_INPUT_RANKS``: the input ranks the torch class accepts ("2+": two or more)."""

    _INPUT_RANKS: Union[Tuple[int, ...], str]

    def _momentum_factor(self) -> float:
        """The exponential average factor of this training step (bumps num_batches_tracked)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _running(self):
        if self.track_running_stats:
            return self.running_mean, self.running_var
        return None, None

    def _compiled_forward(self, input: Tensor, width: Tuple[int, int]) -> Tensor:
        """Training forward while torch.compile traces: saves the normalized input
        (:class:`~actnn_zoo.functional.norm.NormalizedBatchNorm`) as codes at ``width`` (bits,
        group size), and updates the running statistics as torch does."""
        _check_input_rank(self, input)
        factor = self._momentum_factor()
        _verify_batch_size(input.size())
        out, mean, var = NormalizedBatchNorm.apply(input, self.weight, self.bias, self.eps,
                                                   *width)
        if self.track_running_stats and self.running_mean is not None:
            m = input.numel() // input.shape[1]
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(
                    (var * (m / max(m - 1, 1))).to(self.running_var.dtype), alpha=factor)
        return out

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight, self.bias):
            width = self.graph_saves()
            if width is not None and not isinstance(self, nn.SyncBatchNorm):
                return self._compiled_forward(input, width)  # traced by torch.compile
            return super().forward(input)
        _check_input_rank(self, input)
        factor = self._momentum_factor()
        running_mean, running_var = self._running()
        _verify_batch_size(input.size())
        return batch_norm_train(input, self.weight, self.bias, running_mean, running_var,
                                factor, self.eps, self.qconfig, self.bits_for(input))


class QBatchNorm1d(_QBatchNorm, nn.BatchNorm1d):
    """nn.BatchNorm1d that saves its normalized input compressed plus the exact per-channel
    statistics (running statistics updated as torch does); see :class:`QBatchNorm2d`."""

    _FLOAT_MODULE = nn.BatchNorm1d
    _INPUT_RANKS = (2, 3)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None,
                 *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._init_q(qconfig)


class QBatchNorm2d(_QBatchNorm, nn.BatchNorm2d):
    """nn.BatchNorm2d that saves its normalized input compressed plus the exact per-channel
    statistics, not its full input.

    Compressing the normalized input rather than the raw one keeps channels of very different
    scales at the same relative precision, so the 2-bit input gradient stays close to fp32's;
    the running statistics are updated exactly as torch does."""

    _FLOAT_MODULE = nn.BatchNorm2d
    _INPUT_RANKS = (4,)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None,
                 *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._init_q(qconfig)


class QBatchNorm3d(_QBatchNorm, nn.BatchNorm3d):
    """nn.BatchNorm3d that saves its normalized input compressed plus the exact per-channel
    statistics; see :class:`QBatchNorm2d`."""

    _FLOAT_MODULE = nn.BatchNorm3d
    _INPUT_RANKS = (5,)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None,
                 *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._init_q(qconfig)


class QSyncBatchNorm(_QBatchNorm, nn.SyncBatchNorm):
    """Statistics over the process group when torch.distributed is initialised with more than
    one rank (CPU/gloo included, unlike nn.SyncBatchNorm); otherwise exactly QBatchNorm."""

    _FLOAT_MODULE = nn.SyncBatchNorm
    _INPUT_RANKS = "2+"

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         process_group, device, dtype)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight, self.bias):
            return super(_QBatchNorm, self).forward(input)
        _check_input_rank(self, input)
        if input.size(1) == 0:  # torch's message (its check is private)
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        factor = self._momentum_factor()
        running_mean, running_var = self._running()
        group, world = None, 1
        if dist.is_available() and dist.is_initialized():
            group = self.process_group if self.process_group else dist.group.WORLD
            world = dist.get_world_size(group)
        if world == 1:
            _verify_batch_size(input.size())
            return batch_norm_train(input, self.weight, self.bias, running_mean, running_var,
                                    factor, self.eps, self.qconfig, self.bits_for(input))
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                           running_var, factor, self.eps, group, world,
                                           self.qconfig, self.bits_for(input))


class QLayerNorm(QModule, nn.LayerNorm):
    """nn.LayerNorm that saves its normalized input compressed plus the exact per-row
    statistics, not its full input: every transformer block has two, each saving a tensor as
    large as the residual stream."""

    _FLOAT_MODULE = nn.LayerNorm

    def __init__(self, normalized_shape: Union[int, List[int], torch.Size], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias  # (each read is an nn.Module.__getattr__ call)
        if not use_function(self, input, weight, bias):
            width = self.graph_saves()
            if width is None:
                return super().forward(input)
            return NormalizedLayerNorm.apply(input, tuple(self.normalized_shape), weight,
                                             bias, self.eps, *width)  # torch.compile's
        return layer_norm_train(input, self.normalized_shape, weight, bias, self.eps,
                                self.qconfig, self.bits_for(input))


class QGroupNorm(QModule, nn.GroupNorm):
    """nn.GroupNorm that saves its normalized input compressed plus the exact per-(sample,
    group) statistics, so that groups of different scales keep the same relative
    precision."""

    _FLOAT_MODULE = nn.GroupNorm

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device=None, dtype=None, *,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight, self.bias):
            return super().forward(input)
        if input.dim() < 2:
            raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received "
                               f"{input.dim()}")
        _verify_batch_size([input.size(0) * input.size(1) // self.num_groups, self.num_groups]
                           + list(input.size()[2:]))
        return group_norm_train(input, self.num_groups, self.weight, self.bias, self.eps,
                                self.qconfig, self.bits_for(input))
