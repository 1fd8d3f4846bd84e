"""QUpsample: nn.Upsample saving nothing but shapes for backward."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.upsample import interpolate
from ._base import QModule

__all__ = ["QUpsample"]


class QUpsample(QModule, nn.Upsample):
    """nn.Upsample (every mode) whose backward needs only shapes, so nothing is saved."""

    _FLOAT_MODULE = nn.Upsample

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest",
                 align_corners: Optional[bool] = None,
                 recompute_scale_factor: Optional[bool] = None,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Upsample.__init__(self, size, scale_factor, mode, align_corners,
                             recompute_scale_factor)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self.quantizing() and input.requires_grad:
            return interpolate(input, self.size, self.scale_factor, self.mode,
                               self.align_corners, self.recompute_scale_factor)
        return nn.Upsample.forward(self, input)
