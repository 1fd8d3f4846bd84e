"""The interface every bit-allocation strategy implements, and the uniform strategy.

A strategy is attached to one converted model by :func:`actnn_zoo.convert_model` (kept as
``model.actnn_zoo_precision``) and detached by ``restore_model`` or a re-conversion. It may
register hooks on the model and callbacks around its Q-layers' calls (:meth:`_watch`,
:class:`LayerWatch`), keeps all its state on itself and on the layers
(``module.precision_stats``), and acts only by setting ``module.sample_bits`` (the per-sample
widths the layer's next training forward passes to its Function) or, for one width per layer
(gact), the layer's ``qconfig.bits``, which it restores when detached. Layers and Functions do not
know which strategy runs, so new strategies (GACT, AC-GC, DIVISION) plug in here.

Threads. Several threads may run one converted model at once (``nn.DataParallel``'s replicas
share the modules' state, or a user's own threads). What a strategy hands a layer for one
forward (the widths made for that forward's batch) is therefore kept per thread: it sets them
with :func:`set_sample_bits`, which writes the layer's ``sample_bits`` (the last widths, for
reports) and this thread's slot (:class:`ThreadWidths`), the only one ``QModule.bits_for``
reads while a strategy is attached. A pre-hook and the forward it prepares run on one thread,
so a forward always uses its own widths. What a strategy accumulates across steps is shared
by the threads and changed only under the strategy's lock (:attr:`PrecisionStrategy.lock`,
one per model); the root's per-forward flags (its step, whether it records) are per thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .._compile import EagerHook
from .._torch_private import tensor_version

if TYPE_CHECKING:
    from ..config import QuantConfig
    from ..nn._base import QModule

__all__ = ["TrackedLayer", "PrecisionStrategy", "UniformStrategy", "PRECISION_ATTR",
           "WIDTHS_ATTR", "WATCH_ATTR", "LayerWatch", "ThreadWidths", "ThreadState",
           "set_sample_bits", "hand_derivative", "compresses_now"]

PRECISION_ATTR = "actnn_zoo_precision"
# the Q-layer attribute holding a strategy's per-thread widths (QModule.bits_for reads it)
WIDTHS_ATTR = "_az_thread_bits"
# the Q-layer attribute holding a strategy's callbacks around its calls (QModule.__call__)
WATCH_ATTR = "_az_watch"

_nn_call = nn.Module.__call__


class LayerWatch:
    """A strategy's callbacks around one Q-layer's eager calls, run by the layer itself
    (``QModule.__call__`` calls this object in place of ``nn.Module.__call__``): ``pre(module,
    args)`` before the call, ``post(module, args, output)`` after it returned (not when it
    raised), as a forward pre-hook and forward hook would.

    Why not module hooks: a module with hooks takes ``nn.Module``'s slow call path, which with
    the hooks' wrappers cost 4.5-7 us a call (a linear, conv or batch norm in a chain of 24,
    the same layers with hooks against with this, in one process), paid by every watched
    layer in every forward. The callbacks run around the whole
    call, so the layer's own hooks (the user's) run inside: they see the input the strategy
    saw, and the strategy sees the output they leave. While ``torch.compile`` traces the
    layer, ``QModule.__call__`` does not call this (the strategies' work is host code, see
    :class:`~actnn_zoo._compile.EagerHook`). A plain object with slots: ``copy.deepcopy`` and
    pickle copy the callbacks' strategy state with the model, as they copy module hooks."""

    __slots__ = ("pre", "post")

    def __init__(self, pre: Any, post: Any = None) -> None:
        self.pre = pre
        self.post = post

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.pre(module, args)
        out = _nn_call(module, *args, **kwargs)
        if self.post is not None:
            self.post(module, args, out)
        return out


class _WatchHandle:
    """Removes a :class:`LayerWatch` from its layer (a hook handle's ``remove``), unless
    something replaced it meanwhile."""

    __slots__ = ("module", "watch")

    def __init__(self, module: nn.Module, watch: LayerWatch) -> None:
        self.module, self.watch = module, watch

    def remove(self) -> None:
        if self.module.__dict__.get(WATCH_ATTR) is self.watch:
            del self.module.__dict__[WATCH_ATTR]


class ThreadWidths(threading.local):
    """One Q-layer's per-sample widths for the forward each thread runs (``bits``: a
    :class:`~actnn_zoo.quant.SampleBits`, a tensor or None; None in a thread that set none).

    Two threads running one model call the same layer: widths in the layer's ``sample_bits``
    alone could be overwritten by the other thread between a pre-hook and the forward it
    prepared (a batch of 32 then met widths made for 64 samples, or for other samples of the
    same size). ``copy.deepcopy`` and pickle give an empty slot: widths belong to a forward.
    """

    bits: Union[Tensor, Any, None] = None  # class default: what a new thread sees
    # (input, its version, f'(input)): a derivative the strategy made for this forward's
    # input (hand_derivative), taken by the layer (take_derivative)
    derivative: Optional[Tuple[Tensor, int, Tensor]] = None

    def hand_derivative(self, x: Tensor, derivative: Optional[Tensor]) -> None:
        """The layer's next forward on this thread may use ``derivative`` (made from ``x``
        as it is now) instead of computing it again; None withdraws an earlier one."""
        self.derivative = None if derivative is None else (x, tensor_version(x), derivative)

    def take_derivative(self, x: Tensor) -> Optional[Tensor]:
        """The handed derivative when it was made from this very ``x``, unchanged since (the
        same object at the same version); else None. Either way the hand-off is cleared."""
        held = self.derivative
        if held is None:
            return None
        self.derivative = None
        return held[2] if held[0] is x and held[1] == tensor_version(x) else None

    def __reduce__(self):
        return (type(self), ())


class ThreadState(threading.local):
    """A strategy's state of the forward running on one thread. Class attributes are the
    defaults a thread sees before it sets its own (reading them raises nothing, which a
    plain ``threading.local`` with ``getattr(..., default)`` would do, at about 0.5 us)."""

    forward: Any = None  # the root training forward running on this thread (per strategy)
    step: Optional[int] = None  # its step number
    running: Optional[Dict[Any, Any]] = None  # see PrecisionStrategy.running
    counted: Optional[List[bool]] = None  # root forwards open on this thread: counted or not
    rec: Any = None  # a recording this thread's forward makes (gact)
    probe_pass: bool = False  # this thread runs a probe's passes (gact)
    streams: Optional[List[Any]] = None  # seed streams this thread opened (gact)


_grad_enabled = torch.is_grad_enabled  # bound once: read in every watched layer call


def compresses_now(module: nn.Module, x: Any) -> bool:
    """Whether the Q-layer's call about to run on ``x`` compresses: a tensor, training, enabled,
    grad on. ``QModule.quantizing()`` without its compile test: the strategies' callbacks run
    in eager calls only (:class:`LayerWatch`, :class:`~actnn_zoo._compile.EagerHook`), and the
    test cost two more Python frames per watched layer call."""
    return (isinstance(x, Tensor) and module.training
            and module.qconfig.enabled  # type: ignore[attr-defined]
            and _grad_enabled())


def set_sample_bits(module: nn.Module, bits: Union[Tensor, Any, None]) -> None:
    """Hand ``module``'s forward now running on this thread ``bits`` (None: its qconfig's
    width): this thread's slot, and ``module.sample_bits`` (what the last forward of any
    thread got, for reports and tests). Plain attributes, no ``nn.Module.__setattr__``."""
    object.__setattr__(module, "sample_bits", bits)
    slot = module.__dict__.get(WIDTHS_ATTR)
    if slot is not None:
        slot.bits = bits


def hand_derivative(module: nn.Module, x: Tensor, derivative: Optional[Tensor]) -> None:
    """Hand ``module``'s forward now running on this thread the f'(x) the strategy made from
    its input ``x`` (``stats.saved_statistic``): the layer uses it instead of making it again
    (``ThreadWidths.take_derivative``). Nothing for None or a layer without a slot."""
    slot = module.__dict__.get(WIDTHS_ATTR)
    if slot is not None and derivative is not None:
        slot.hand_derivative(x, derivative)


@dataclass(frozen=True)
class TrackedLayer:
    """One converted Q-layer as the converter hands it to a strategy.

    ``pinned_bits`` is the width a config rule fixed for this layer (the strategy must leave
    it alone), None when the strategy may choose.
    """

    name: str
    module: "QModule"
    pinned_bits: Optional[int] = None


class PrecisionStrategy:
    """Base class: chooses the widths of a model's Q-layers.

    Subclasses set ``name`` (the ``strategy:`` value in a config) and override
    :meth:`attach`; hooks they register go through :meth:`_keep`, callbacks around a layer's
    calls through :meth:`_watch`, so that :meth:`detach` removes them. ``config.bits`` is a width for 'uniform' and an average budget for the others.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: "QuantConfig") -> None:
        self.config = config
        self.layers: List[TrackedLayer] = []
        self._handles: List[Any] = []  # each with remove(): hook handles, _WatchHandle
        self._new_thread_state()

    def _new_thread_state(self) -> None:
        # ``lock``: held while shared statistics change or are read as a whole (per model);
        # ``local``: this thread's forward (its step, flags, the call a pre-hook prepared)
        self.lock = threading.Lock()
        self.local = ThreadState()

    def __getstate__(self) -> Dict[str, Any]:  # deepcopy / pickle: no lock, no thread's state
        state = dict(self.__dict__)
        del state["lock"], state["local"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_thread_state()

    def attach(self, model: nn.Module, layers: Sequence[TrackedLayer]) -> None:
        """Start managing ``layers`` of ``model`` (the root the converter returns)."""
        self.layers = list(layers)

    def running(self) -> Dict[Any, Any]:
        """This thread's layer calls between their pre-hook and their forward hook: layer
        hook object -> what the pre-hook left for the forward hook (per thread: another
        thread runs its own calls of the same layers)."""
        running = self.local.running
        if running is None:
            running = self.local.running = {}
        return running

    def own_widths(self, module: nn.Module) -> None:
        """Give ``module`` a per-thread widths slot (:class:`ThreadWidths`): from now on its
        forward uses the widths :func:`set_sample_bits` set on the same thread."""
        module.__dict__[WIDTHS_ATTR] = ThreadWidths()

    def detach(self) -> None:
        """Remove every hook and forget per-sample widths and statistics on the layers."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for tl in self.layers:
            tl.module.__dict__.pop(WIDTHS_ATTR, None)
            tl.module.sample_bits = None
            tl.module.precision_stats = None
        self.layers = []

    def _keep(self, handle: Any) -> None:
        self._handles.append(handle)

    def _watch(self, model: nn.Module, module: nn.Module, pre: Any, post: Any = None) -> None:
        """Run ``pre(module, args)`` before and ``post(module, args, output)`` after each eager
        call of the Q-layer ``module`` (:class:`LayerWatch`); removed by :meth:`detach`. The
        root (``module is model``) gets them as forward hooks instead, so that the root's own
        per-step hook, prepended, still runs before the layer's pre-callback."""
        if module is model:
            self._keep(module.register_forward_pre_hook(EagerHook(pre)))
            if post is not None:
                self._keep(module.register_forward_hook(EagerHook(post)))
            return
        watch = LayerWatch(pre, post)
        module.__dict__[WATCH_ATTR] = watch
        self._keep(_WatchHandle(module, watch))

    # Strategies that re-allocate count the model's training forwards in ``step`` and keep
    # widths computed on the device in ``_pending`` (the arguments of ``_apply``) until the
    # next step reads them: one host read a step late instead of a sync.
    step: int
    _pending: Optional[Tuple[Any, ...]]

    def _apply(self, *pending: Any) -> None:
        raise NotImplementedError

    def _count_step(self) -> int:
        """This training forward's step number, under ``self.lock`` (threads running one
        model count their steps in one sequence), after applying the widths the last
        re-allocation computed."""
        self.step += 1
        if self._pending is not None:
            self._apply(*self._pending)
            self._pending = None
        return self.step

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(bits={self.config.bits}, "
                f"layers={len(self.layers)})")


class UniformStrategy(PrecisionStrategy):
    """Every layer at its configured width (``qconfig.bits``): no hooks, nothing per step."""

    name = "uniform"
