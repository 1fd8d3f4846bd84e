"""Q-dropouts: keep a 1-bit packed keep-mask (per value, or per channel for Dropout1d/2d/3d)
instead of torch's float (CPU) or byte (CUDA) mask."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional import dropout as D
from ._base import QModule

__all__ = ["QDropout", "QDropout1d", "QDropout2d", "QDropout3d"]


class _QDropoutNd(QModule):
    _FN = staticmethod(D.dropout)
    _ELEMENTWISE = False  # whether torch.compile traces it as D.PackedMaskDropout

    def __init__(self, p: float = 0.5, inplace: bool = False,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        self._FLOAT_MODULE.__init__(self, p, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self.quantizing() and input.requires_grad:
            return self._FN(input, self.p, self.inplace)
        if self._ELEMENTWISE and input.requires_grad and 0 < self.p < 1 \
                and self.graph_saves() is not None:  # traced by torch.compile
            out = D.PackedMaskDropout.apply(input, self.p)
            return input.copy_(out) if self.inplace else out
        return self._FLOAT_MODULE.forward(self, input)


class QDropout(_QDropoutNd, nn.Dropout):
    """nn.Dropout saving a 1-bit keep-mask."""

    _FLOAT_MODULE = nn.Dropout
    _FN = staticmethod(D.dropout)
    _ELEMENTWISE = True


class QDropout1d(_QDropoutNd, nn.Dropout1d):
    """nn.Dropout1d saving the (N, C) keep-mask at 1 bit per channel."""

    _FLOAT_MODULE = nn.Dropout1d
    _FN = staticmethod(D.dropout1d)


class QDropout2d(_QDropoutNd, nn.Dropout2d):
    """nn.Dropout2d saving the (N, C) keep-mask at 1 bit per channel."""

    _FLOAT_MODULE = nn.Dropout2d
    _FN = staticmethod(D.dropout2d)


class QDropout3d(_QDropoutNd, nn.Dropout3d):
    """nn.Dropout3d saving the (N, C) keep-mask at 1 bit per channel."""

    _FLOAT_MODULE = nn.Dropout3d
    _FN = staticmethod(D.dropout3d)
