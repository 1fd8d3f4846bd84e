"""Q-activations: drop-in subclasses of the torch activations.

In training with autograd recording they run a Function that saves a 1-bit mask (ReLU,
ReLU6, LeakyReLU, Hardtanh) or the compressed derivative (GELU, SiLU, Sigmoid, Tanh, ELU,
Softplus, Hardswish, Hardsigmoid, Mish); otherwise (eval, ``no_grad``, ``qconfig.enabled=False``, or an input that does not
require grad, where nothing is saved anyway) exactly the torch forward.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from torch import Tensor, nn

from .._session import ZeroCodeSlot
from ..config import LayerQConfig
from ..functional import activation as A
from ._base import QModule

__all__ = ["QReLU", "QReLU6", "QLeakyReLU", "QHardtanh", "QGELU", "QSiLU", "QSigmoid", "QTanh",
           "QELU", "QSoftplus", "QHardswish", "QHardsigmoid", "QMish"]


class _QAct(QModule):
    def _active(self, x: Tensor) -> bool:
        """Compress only when something is saved: training forward that autograd records."""
        return self.quantizing() and x.requires_grad

    def _derivative(self, x: Tensor) -> Optional[Tensor]:
        """f'(x) that a precision strategy made from this very ``x`` in its pre-hook (to choose
        the per-sample widths) and handed on, so that it is not computed twice; else None.
        Taken once: the hand-off holds a tensor the size of ``x`` until this call."""
        slot = self.__dict__.get("_az_thread_bits")  # precision.base.WIDTHS_ATTR
        return None if slot is None else slot.take_derivative(x)

    def _traced(self, op: str, x: Tensor, params: Tuple = (), inplace: bool = False
                ) -> Optional[Tensor]:
        """A smooth activation's traced form while torch.compile traces a training forward
        (``f'(x)`` kept as codes at the graph's width), else None."""
        width = self.graph_saves() if x.requires_grad else None
        if width is None:
            return None
        out = A.TracedDerivativeActivation.apply(x, op, params, *width)
        return x.copy_(out) if inplace else out


class QReLU(_QAct, nn.ReLU):
    """nn.ReLU saving a 1-bit mask (torch saves the full output); with ``qconfig.relu_codes``
    (the default) nothing of its own on the CPU in a converted model where the next layer
    compresses the output: that layer stores it as sparse codes, whose mask ReLU's backward
    reads (:class:`~actnn_zoo._session.ZeroCodeSlot`, learned over one forward)."""

    _FLOAT_MODULE = nn.ReLU

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.ReLU.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            slot = None
            if self.qconfig.relu_codes and input.is_cpu:  # sparse kernels
                slot = self.__dict__.get("_zero_codes")
                if slot is None:
                    slot = self._zero_codes = ZeroCodeSlot()
            return A.relu(input, self.inplace, slot)
        if input.requires_grad and self.graph_saves() is not None:
            return A.BoolMaskReLU.apply(input, self.inplace)  # traced by torch.compile
        return nn.ReLU.forward(self, input)


class QHardtanh(_QAct, nn.Hardtanh):
    """nn.Hardtanh saving a 1-bit inside-the-range mask."""

    _FLOAT_MODULE = nn.Hardtanh

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False,
                 min_value: Optional[float] = None, max_value: Optional[float] = None,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Hardtanh.__init__(self, min_val, max_val, inplace, min_value, max_value)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.hardtanh(input, self.min_val, self.max_val, self.inplace)
        return nn.Hardtanh.forward(self, input)


class QReLU6(_QAct, nn.ReLU6):
    """nn.ReLU6 (= Hardtanh(0, 6)) saving a 1-bit mask."""

    _FLOAT_MODULE = nn.ReLU6

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.ReLU6.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.hardtanh(input, self.min_val, self.max_val, self.inplace)
        return nn.ReLU6.forward(self, input)


class QLeakyReLU(_QAct, nn.LeakyReLU):
    """nn.LeakyReLU saving a 1-bit sign mask (in place also with a negative slope, which
    torch's result-based in-place backward rejects)."""

    _FLOAT_MODULE = nn.LeakyReLU

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        nn.LeakyReLU.__init__(self, negative_slope, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.leaky_relu(input, self.negative_slope, self.inplace)
        return nn.LeakyReLU.forward(self, input)


class QGELU(_QAct, nn.GELU):
    """nn.GELU ('none' or 'tanh') saving the compressed derivative."""

    _FLOAT_MODULE = nn.GELU

    def __init__(self, approximate: str = "none", qconfig: Optional[LayerQConfig] = None) -> None:
        nn.GELU.__init__(self, approximate)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.gelu(input, self.approximate, self.qconfig, self.bits_for(input),
                          self._derivative(input))
        traced = self._traced("gelu", input, (self.approximate,))
        return self.plain_forward(nn.GELU, input) if traced is None else traced


class QSiLU(_QAct, nn.SiLU):
    """nn.SiLU saving the compressed derivative (also in place)."""

    _FLOAT_MODULE = nn.SiLU

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.SiLU.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.silu(input, self.inplace, self.qconfig, self.bits_for(input),
                          self._derivative(input))
        traced = self._traced("silu", input, (), self.inplace)
        return self.plain_forward(nn.SiLU, input) if traced is None else traced


class QSigmoid(_QAct, nn.Sigmoid):
    """nn.Sigmoid saving compressed y (1 - y)."""

    _FLOAT_MODULE = nn.Sigmoid

    def __init__(self, *args: Any, qconfig: Optional[LayerQConfig] = None, **kwargs: Any) -> None:
        nn.Sigmoid.__init__(self, *args, **kwargs)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.sigmoid(input, self.qconfig, self.bits_for(input), self._derivative(input))
        traced = self._traced("sigmoid", input)
        return nn.Sigmoid.forward(self, input) if traced is None else traced


class QTanh(_QAct, nn.Tanh):
    """nn.Tanh saving compressed 1 - y^2."""

    _FLOAT_MODULE = nn.Tanh

    def __init__(self, *args: Any, qconfig: Optional[LayerQConfig] = None, **kwargs: Any) -> None:
        nn.Tanh.__init__(self, *args, **kwargs)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.tanh(input, self.qconfig, self.bits_for(input), self._derivative(input))
        traced = self._traced("tanh", input)
        return nn.Tanh.forward(self, input) if traced is None else traced


class QELU(_QAct, nn.ELU):
    """nn.ELU saving the compressed derivative (also in place, any alpha)."""

    _FLOAT_MODULE = nn.ELU

    def __init__(self, alpha: float = 1.0, inplace: bool = False,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        nn.ELU.__init__(self, alpha, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.elu(input, self.alpha, self.inplace, self.qconfig, self.bits_for(input),
                         self._derivative(input))
        traced = self._traced("elu", input, (float(self.alpha),), self.inplace)
        return nn.ELU.forward(self, input) if traced is None else traced


class QSoftplus(_QAct, nn.Softplus):
    """nn.Softplus saving the compressed derivative."""

    _FLOAT_MODULE = nn.Softplus

    def __init__(self, beta: float = 1.0, threshold: float = 20.0,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Softplus.__init__(self, beta, threshold)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.softplus(input, self.beta, self.threshold, self.qconfig,
                              self.bits_for(input), self._derivative(input))
        traced = self._traced("softplus", input, (float(self.beta), float(self.threshold)))
        return nn.Softplus.forward(self, input) if traced is None else traced


class QHardswish(_QAct, nn.Hardswish):
    """nn.Hardswish saving the compressed derivative (also in place)."""

    _FLOAT_MODULE = nn.Hardswish

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Hardswish.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.hardswish(input, self.inplace, self.qconfig, self.bits_for(input),
                               self._derivative(input))
        traced = self._traced("hardswish", input, (), self.inplace)
        return nn.Hardswish.forward(self, input) if traced is None else traced


class QHardsigmoid(_QAct, nn.Hardsigmoid):
    """nn.Hardsigmoid saving the compressed derivative (1/6 or 0; also in place)."""

    _FLOAT_MODULE = nn.Hardsigmoid

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Hardsigmoid.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.hardsigmoid(input, self.inplace, self.qconfig, self.bits_for(input),
                                 self._derivative(input))
        traced = self._traced("hardsigmoid", input, (), self.inplace)
        return nn.Hardsigmoid.forward(self, input) if traced is None else traced


class QMish(_QAct, nn.Mish):
    """nn.Mish saving the compressed derivative (also in place)."""

    _FLOAT_MODULE = nn.Mish

    def __init__(self, inplace: bool = False, qconfig: Optional[LayerQConfig] = None) -> None:
        nn.Mish.__init__(self, inplace)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        if self._active(input):
            return A.mish(input, self.inplace, self.qconfig, self.bits_for(input),
                          self._derivative(input))
        traced = self._traced("mish", input, (), self.inplace)
        return self.plain_forward(nn.Mish, input) if traced is None else traced
