"""QModule: what every quantized layer shares (its qconfig, conversion from/to torch layers)."""
from __future__ import annotations

from typing import ClassVar, Optional, Type, Union

import torch
from torch import Tensor, nn

from ..config import LayerQConfig
from ..quant import Bits, SampleBits

_Q_ATTRS = ("qconfig", "sample_bits", "precision_stats")
_COPIED = ("_parameters", "_buffers", "_modules")


def _clone_state(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` the attributes of ``src``, sharing Parameters, buffers and submodules.

    The parameter/buffer/module containers are copied so that later additions to one module do
    not appear on the other; the objects in them are shared, so state_dict keys and values, an
    optimizer built earlier and pretrained weights all stay valid. Hook dicts are shared as they
    are, so a handle returned before conversion still removes its hook afterwards.
    """
    for key, value in src.__dict__.items():
        if key in _Q_ATTRS:
            continue
        copy = key in _COPIED and isinstance(value, dict)
        dst.__dict__[key] = value.copy() if copy else value


class QModule:
    """Mixin for Q-layers. Subclasses list the torch class they replace in ``_FLOAT_MODULE``.

    ``qconfig`` holds bits/group size/rounding; ``sample_bits`` (set by a precision strategy,
    None otherwise) gives one width per sample for the next training forward (a uint8 tensor,
    or :class:`~actnn_zoo.quant.SampleBits` whose host-side bound spares quantize a read-back);
    ``precision_stats`` is where a precision strategy keeps what it observed on this layer
    (:class:`actnn_zoo.precision.LayerStats`; None when no strategy watches the layer). Both
    stay on the Q-layer: ``to_float`` does not copy them.
    """

    _FLOAT_MODULE: ClassVar[Type[nn.Module]]
    qconfig: LayerQConfig
    sample_bits: Union[Tensor, SampleBits, None]
    precision_stats: Optional[object]

    def _init_q(self, qconfig: Optional[LayerQConfig]) -> None:
        if qconfig is None:
            qconfig = LayerQConfig()
        if not isinstance(qconfig, LayerQConfig):
            raise TypeError(f"qconfig must be a LayerQConfig, got {type(qconfig).__name__}")
        self.qconfig = qconfig
        self.sample_bits = None
        self.precision_stats = None

    def quantizing(self) -> bool:
        """True when the next forward should save compressed tensors (training with grad)."""
        return self.training and self.qconfig.enabled and torch.is_grad_enabled()

    def bits_for(self, x: Tensor) -> Bits:
        """The width(s) for input ``x``: per-sample widths when they fit its batch, else bits."""
        sb = self.sample_bits
        if sb is not None and x.dim() > 1 and sb.shape[0] == x.shape[0]:
            return sb
        return self.qconfig.bits

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: Optional[LayerQConfig] = None):
        """Build the Q-layer from a torch layer, sharing its Parameters, buffers and hooks."""
        if type(mod) is not cls._FLOAT_MODULE:
            raise TypeError(f"{cls.__name__}.from_float expects {cls._FLOAT_MODULE.__name__}, "
                            f"got {type(mod).__name__}")
        new = cls.__new__(cls)
        _clone_state(mod, new)
        new._init_q(qconfig)
        return new

    def to_float(self) -> nn.Module:
        """The plain torch layer again, sharing Parameters and buffers."""
        mod = self._FLOAT_MODULE.__new__(self._FLOAT_MODULE)
        _clone_state(self, mod)
        return mod

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        q = f"bits={self.qconfig.bits}, group_size={self.qconfig.group_size}"
        if not self.qconfig.enabled:
            q += ", enabled=False"
        return f"{base}, {q}" if base else q
