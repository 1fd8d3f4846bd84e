"""Q-pools. Max pools save the argmax position inside each window (ceil(log2(window volume))
bits per output value, instead of torch's input copy plus int64 indices); average pools save
nothing but shapes (torch's keep the whole input to read its shape)."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional import pool as P
from ._base import QModule

__all__ = ["QMaxPool1d", "QMaxPool2d", "QMaxPool3d", "QAvgPool1d", "QAvgPool2d", "QAvgPool3d",
           "QAdaptiveAvgPool1d", "QAdaptiveAvgPool2d", "QAdaptiveAvgPool3d",
           "QAdaptiveMaxPool1d", "QAdaptiveMaxPool2d", "QAdaptiveMaxPool3d"]


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


class _QPool(QModule):
    def _active(self, x: Tensor) -> bool:
        return self.quantizing() and x.requires_grad


class _QMaxPoolNd(_QPool):
    _ND = 2

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1,
                 return_indices: bool = False, ceil_mode: bool = False,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        self._FLOAT_MODULE.__init__(self, kernel_size, stride, padding, dilation,
                                    return_indices, ceil_mode)
        self._init_q(qconfig)

    def forward(self, input: Tensor):
        if self._active(input):
            return P._max_pool(self._ND, input, self.kernel_size, self.stride, self.padding,
                               self.dilation, self.ceil_mode, self.return_indices)
        if self._ND == 2 and not self.return_indices and input.requires_grad \
                and self.graph_saves() is not None:  # traced by torch.compile
            kernel, stride, padding, dilation = (_pair(v) for v in (
                self.kernel_size, self.stride or self.kernel_size, self.padding, self.dilation))
            if kernel[0] * kernel[1] <= 256:  # a position fits a byte
                return P.WindowCodeMaxPool2d.apply(input, kernel, stride, padding, dilation,
                                                   self.ceil_mode)
        return self._FLOAT_MODULE.forward(self, input)


class QMaxPool1d(_QMaxPoolNd, nn.MaxPool1d):
    """nn.MaxPool1d saving ceil(log2(kernel)) bits per output value."""

    _FLOAT_MODULE = nn.MaxPool1d
    _ND = 1


class QMaxPool2d(_QMaxPoolNd, nn.MaxPool2d):
    """nn.MaxPool2d saving ceil(log2(kH*kW)) bits per output value (2x2 -> 2, 3x3 -> 4)."""

    _FLOAT_MODULE = nn.MaxPool2d
    _ND = 2


class QMaxPool3d(_QMaxPoolNd, nn.MaxPool3d):
    """nn.MaxPool3d saving ceil(log2(kD*kH*kW)) bits per output value."""

    _FLOAT_MODULE = nn.MaxPool3d
    _ND = 3


class _QAdaptiveMaxPoolNd(_QPool):
    _ND = 2

    def __init__(self, output_size, return_indices: bool = False,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        self._FLOAT_MODULE.__init__(self, output_size, return_indices)
        self._init_q(qconfig)

    def forward(self, input: Tensor):
        if self._active(input):
            return P._adaptive_max_pool(self._ND, input, self.output_size, self.return_indices)
        return self._FLOAT_MODULE.forward(self, input)


class QAdaptiveMaxPool1d(_QAdaptiveMaxPoolNd, nn.AdaptiveMaxPool1d):
    """nn.AdaptiveMaxPool1d saving ceil(log2(largest window)) bits per output value."""

    _FLOAT_MODULE = nn.AdaptiveMaxPool1d
    _ND = 1


class QAdaptiveMaxPool2d(_QAdaptiveMaxPoolNd, nn.AdaptiveMaxPool2d):
    """nn.AdaptiveMaxPool2d saving the position inside the (largest) window, bit-packed."""

    _FLOAT_MODULE = nn.AdaptiveMaxPool2d
    _ND = 2


class QAdaptiveMaxPool3d(_QAdaptiveMaxPoolNd, nn.AdaptiveMaxPool3d):
    """nn.AdaptiveMaxPool3d saving the position inside the (largest) window, bit-packed,
    instead of torch's int64 indices."""

    _FLOAT_MODULE = nn.AdaptiveMaxPool3d
    _ND = 3


class QAvgPool1d(_QPool, nn.AvgPool1d):
    """nn.AvgPool1d saving nothing but shapes."""

    _FLOAT_MODULE = nn.AvgPool1d

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.AvgPool1d.__init__(self, kernel_size, stride, padding, ceil_mode, count_include_pad)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return P.avg_pool1d(input, self.kernel_size, self.stride, self.padding,
                                self.ceil_mode, self.count_include_pad)
        return nn.AvgPool1d.forward(self, input)


class _QAvgPoolNd(_QPool):
    _ND = 2

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: Optional[int] = None,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        self._FLOAT_MODULE.__init__(self, kernel_size, stride, padding, ceil_mode,
                                    count_include_pad, divisor_override)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return P._avg_pool(self._ND, input, self.kernel_size, self.stride, self.padding,
                               self.ceil_mode, self.count_include_pad, self.divisor_override)
        return self._FLOAT_MODULE.forward(self, input)


class QAvgPool2d(_QAvgPoolNd, nn.AvgPool2d):
    """nn.AvgPool2d (a real average: ActNN's ran max-pool) saving nothing but shapes."""

    _FLOAT_MODULE = nn.AvgPool2d
    _ND = 2


class QAvgPool3d(_QAvgPoolNd, nn.AvgPool3d):
    """nn.AvgPool3d saving nothing but shapes."""

    _FLOAT_MODULE = nn.AvgPool3d
    _ND = 3


class _QAdaptiveAvgPoolNd(_QPool):
    _FN = staticmethod(P.adaptive_avg_pool2d)

    def __init__(self, output_size, qconfig: Optional[LayerQConfig] = None) -> None:
        self._FLOAT_MODULE.__init__(self, output_size)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return self._FN(input, self.output_size)
        return self._FLOAT_MODULE.forward(self, input)


class QAdaptiveAvgPool1d(_QAdaptiveAvgPoolNd, nn.AdaptiveAvgPool1d):
    """nn.AdaptiveAvgPool1d saving nothing but shapes (torch's keeps its input alive for
    backward, which needs only the input's shape)."""

    _FLOAT_MODULE = nn.AdaptiveAvgPool1d
    _FN = staticmethod(P.adaptive_avg_pool1d)


class QAdaptiveAvgPool2d(_QAdaptiveAvgPoolNd, nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d saving nothing but shapes."""

    _FLOAT_MODULE = nn.AdaptiveAvgPool2d
    _FN = staticmethod(P.adaptive_avg_pool2d)


class QAdaptiveAvgPool3d(_QAdaptiveAvgPoolNd, nn.AdaptiveAvgPool3d):
    """nn.AdaptiveAvgPool3d saving nothing but shapes (torch's keeps its input alive for
    backward, which needs only the input's shape)."""

    _FLOAT_MODULE = nn.AdaptiveAvgPool3d
    _FN = staticmethod(P.adaptive_avg_pool3d)
