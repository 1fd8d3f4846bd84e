"""QSoftmax: nn.Softmax saving its output compressed (see functional.softmax for the small
bias this leaves in the backward)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.softmax import softmax
from ._base import QModule

__all__ = ["QSoftmax"]


class QSoftmax(QModule, nn.Softmax):
    """nn.Softmax saving the compressed output."""

    _FLOAT_MODULE = nn.Softmax

    def __init__(self, dim: Optional[int] = None, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Softmax.__init__(self, dim)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self.quantizing() and input.requires_grad:
            return softmax(input, self.dim, self.qconfig, self.bits_for(input))
        return nn.Softmax.forward(self, input)
