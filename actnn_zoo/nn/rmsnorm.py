"""QRMSNorm: nn.RMSNorm (and, converted from them, HF LlamaRMSNorm-style and T5LayerNorm
RMSNorms) saving its normalized input compressed plus the exact per-row rstd
(``functional/rmsnorm.py``). Eval / no_grad / qconfig.enabled=False: the original forward.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.rmsnorm import RMS_STYLES, RMSNormFunction
from ._base import QModule
from .linear import use_function

__all__ = ["QRMSNorm"]


class QRMSNorm(QModule, nn.RMSNorm):
    """nn.RMSNorm saving compress(x * rstd) and rstd.

    ``rms_style`` says whose formula the compressing forward reproduces: ``"torch"``
    (``F.rms_norm``) for nn.RMSNorm, ``"llama"`` / ``"t5"`` for the Hugging Face classes
    (``actnn_zoo.nn.third_party``), whose output rounding differs from ``F.rms_norm``'s.
    """

    _FLOAT_MODULE = nn.RMSNorm
    rms_style: str = "torch"

    def __init__(self, normalized_shape: Union[int, List[int], torch.Size],
                 eps: Optional[float] = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight):
            return self.plain_forward(nn.RMSNorm, input)
        if self.rms_style not in RMS_STYLES:
            raise ValueError(f"QRMSNorm.rms_style must be one of {RMS_STYLES}, "
                             f"got {self.rms_style!r}")
        return RMSNormFunction.apply(input, self.weight, tuple(self.normalized_shape), self.eps,
                                     self.rms_style, self.qconfig, self.bits_for(input))
