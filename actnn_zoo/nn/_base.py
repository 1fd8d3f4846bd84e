"""QModule: what every quantized layer shares (its qconfig, conversion from/to torch layers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Tuple, Type, Union

import torch
from torch import Tensor, nn

from .._compile import graph_width
from .._session import active_session
from .._torch_private import clone_module_state
from ..capture.mode import call_unrouted
from ..config import LayerQConfig
from ..quant import Bits, SampleBits

SOURCE_ATTR = "_az_source"
_Q_ATTRS = ("qconfig", "sample_bits", "precision_stats", SOURCE_ATTR)


@dataclass(frozen=True)
class FloatSource:
    """The class a Q-layer was converted from when it is not the Q class's ``_FLOAT_MODULE``.

    ``cls``: a subclass of ``_FLOAT_MODULE`` with the same forward, or a third-party class
    (``actnn_zoo.nn.third_party``). ``added``: the attribute names the conversion set on the
    Q-layer that ``cls`` instances do not have (``eps`` for an HF RMSNorm, which calls it
    ``variance_epsilon``); :meth:`QModule.to_float` drops them again, so a round trip gives
    back exactly the attributes the original had.
    """

    cls: type
    added: Tuple[str, ...] = ()


def same_forward(cls: type, base: type) -> bool:
    """True when ``cls`` (a subclass of ``base``) computes exactly what ``base`` does: it does
    not override ``forward`` (``cls.forward is base.forward``). A subclass that overrides it
    may compute anything; converting it like ``base`` would silently change the model."""
    return isinstance(cls, type) and issubclass(cls, base) and cls.forward is base.forward


# Bound once (every Q-layer call runs QModule.__call__): the lookups cost as much as the calls.
_nn_call = nn.Module.__call__
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Under a capture session, a layer that saves through its own Function runs with the
        # capture mode off the stack: nothing it does needs routing, and the mode would cost a
        # Python call per torch call and attribute read (capture/mode.py, call_unrouted).
        # A precision strategy's callbacks around the call (precision.base.LayerWatch, in
        # place of module hooks) run in eager calls only.
        if _is_compiling():
            return _nn_call(self, *args, **kwargs)
        call = self.__dict__.get("_az_watch")  # precision.base.WATCH_ATTR
        # quantizing(), inlined: not compiling is known here (three calls less per layer call)
        if (active_session() is not None and self.training and self.qconfig.enabled
                and _grad_enabled()):
            return call_unrouted(_nn_call if call is None else call, self, *args, **kwargs)
        if call is None:
            return _nn_call(self, *args, **kwargs)
        return call(self, *args, **kwargs)

    def quantizing(self) -> bool:
        """True when the next forward should save compressed tensors (training with grad)
        through the layer's own Function. Not while ``torch.compile`` traces it: the Functions
        do host work (strategies' widths, the capture store) that would break the graph; a
        traced layer saves through its traced form instead (:meth:`graph_saves`)."""
        return (self.training and self.qconfig.enabled and _grad_enabled()
                and not _is_compiling())

    def graph_saves(self) -> Optional[Tuple[int, int]]:
        """(bits, group size) when ``torch.compile`` traces a training forward of this layer
        with grad on: layers with a traced form (a Function of ``actnn_zoo::`` operators, whose
        outputs the graph keeps as they are) then save through it at one width
        (:func:`actnn_zoo._compile.graph_width`). None otherwise."""
        if not (_is_compiling() and self.training and self.qconfig.enabled
                and _grad_enabled()):
            return None
        return graph_width(self)

    def bits_for(self, x: Tensor) -> Bits:
        """The width(s) for input ``x``: per-sample widths when they fit its batch, else bits.

        Under a precision strategy the widths are this thread's (``precision.base``,
        ThreadWidths): another thread running the same layer sets its own, for its batch."""
        slot = self.__dict__.get("_az_thread_bits")  # precision.base.WIDTHS_ATTR
        sb = self.sample_bits if slot is None else slot.bits
        if sb is not None and x.dim() > 1 and sb.shape[0] == x.shape[0]:
            return sb
        return self.qconfig.bits

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: Optional[LayerQConfig] = None):
        """Build the Q-layer from a torch layer, sharing its Parameters and buffers (hooks are
        copied, see :func:`actnn_zoo._torch_private.clone_module_state`).

        ``mod`` is an instance of ``_FLOAT_MODULE`` or of a subclass of it that does not
        override ``forward`` (:func:`same_forward`; e.g. torch's
        ``NonDynamicallyQuantizableLinear``): both compute the same, and :meth:`to_float`
        gives back the subclass.
        """
        float_cls = getattr(cls, "_FLOAT_MODULE", None)
        if float_cls is None or not same_forward(type(mod), float_cls):
            want = float_cls.__name__ if float_cls is not None else "a supported class"
            why = (" (a subclass that overrides forward)"
                   if float_cls is not None and isinstance(mod, float_cls) else "")
            raise TypeError(f"{cls.__name__}.from_float expects {want}, "
                            f"got {type(mod).__name__}{why}")
        return cls._build_from(mod, qconfig)

    @classmethod
    def _build_from(cls, mod: nn.Module, qconfig: Optional[LayerQConfig],
                    attrs: Optional[Mapping[str, Any]] = None):
        """The Q-layer sharing ``mod``'s state, plus ``attrs`` set on it (recorded when ``mod``
        lacks them, so :meth:`to_float` removes them). No type check: callers check."""
        new = cls.__new__(cls)
        clone_module_state(mod, new, _Q_ATTRS)
        added = []
        for key, value in (attrs or {}).items():
            if key not in mod.__dict__:
                added.append(key)
            new.__dict__[key] = value
        new._init_q(qconfig)
        if type(mod) is not getattr(cls, "_FLOAT_MODULE", None):
            new.__dict__[SOURCE_ATTR] = FloatSource(type(mod), tuple(added))
        return new

    @property
    def float_source(self) -> Optional[FloatSource]:
        """Where this layer came from when that is not ``_FLOAT_MODULE`` (None otherwise)."""
        return self.__dict__.get(SOURCE_ATTR)

    def float_class(self) -> type:
        """The torch (or third-party) class :meth:`to_float` gives back."""
        src = self.float_source
        return src.cls if src is not None else self._FLOAT_MODULE

    def plain_forward(self, base: type, *args: Any) -> Any:
        """The uncompressed forward: ``base.forward`` (the torch class), or for a layer
        converted from another class the original class's forward run on this layer (it holds
        all of the original's attributes), so eval and no_grad give exactly what the original
        gave (an HF ``NewGELUActivation`` mapped to QGELU keeps its own formula there)."""
        src = self.float_source
        return (src.cls if src is not None else base).forward(self, *args)

    def to_float(self) -> nn.Module:
        """The plain torch layer again (the class converted from), sharing Parameters and
        buffers."""
        src = self.float_source
        cls = self.float_class()
        mod = cls.__new__(cls)
        clone_module_state(self, mod, _Q_ATTRS)
        for key in src.added if src is not None else ():
            mod.__dict__.pop(key, None)
        return mod

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        q = f"bits={self.qconfig.bits}, group_size={self.qconfig.group_size}"
        if self.qconfig.transform != "none":
            q += f", transform={self.qconfig.transform}"
        if not self.qconfig.enabled:
            q += ", enabled=False"
        return f"{base}, {q}" if base else q
