"""What runs eagerly under ``torch.compile``: host bookkeeping dynamo should not trace."""
from __future__ import annotations

import functools
from typing import Any, Callable, Tuple, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# Bound once: the wrappers below run around every saved tensor and hook call, and the name
# lookups ``torch.compiler.is_compiling`` cost as much as the call (dynamo knows the function by
# identity, so tracing still sees ``is_compiling()`` as True).
_is_compiling = torch.compiler.is_compiling
# True only while dynamo traces (dynamo folds the call; eagerly it returns False in one frame,
# where is_compiling() takes two). For eager() below it decides the same as is_compiling(): the
# two differ only under torch.export's non-strict tracing and inside a compilation, where no
# dynamo frame callback runs, so the disabled wrapper and a plain call do the same.
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def eager(fn: F) -> F:
    """``fn``, run eagerly when called while ``torch.compile`` traces.

    Why: the capture store's bookkeeping (storage addresses, weak references, the extension's
    kernels) is host code; traced by dynamo it would recompile for every dtype and shape it
    meets. It runs under compile only where a session opened outside the compiled region (a
    compiled submodule of a converted model). Outside compilation ``fn`` is called directly:
    the disabled wrapper swaps dynamo's frame callback twice per call, a cost every saved
    tensor would pay."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _dynamo_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


class EagerHook:
    """A hook (usually a bound method of a precision strategy's per-layer state) that runs in
    eager calls only: while ``torch.compile`` traces, it does nothing.

    Why: a strategy's work is host code (range statistics read back, per-sample widths from
    the extension's allocation kernel, step counters); called from a traced frame it broke
    the graph at every Q-layer (a converted ResNet-50 compiled into 38 graphs), and the
    traced layers could not use per-sample widths anyway: they save at one width per layer
    (:func:`graph_width`). Eager steps before and after compiled ones run the strategy as
    usual.

    A class rather than a closure so that ``copy.deepcopy`` of a model copies the hook's
    target with it (a function object is copied by reference, so a closure would keep calling
    the original model's strategy)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return None
        return self.fn(*args, **kwargs)

    def __getstate__(self) -> Any:  # deepcopy / pickle: the target only
        return self.fn

    def __setstate__(self, fn: Callable[..., Any]) -> None:
        self.__init__(fn)

    def __repr__(self) -> str:
        return f"EagerHook({self.fn!r})"


# The attribute actnn_zoo.compile sets on every module of a model it compiles (an InlineSwitch).
INLINE_ATTR = "_az_inline_saves"


class InlineSwitch:
    """On while :func:`actnn_zoo.compile`'s compiled call runs, off otherwise.

    One object shared by the modules of one compiled model: while it is on, torch.compile
    traces their plain torch forwards and the compression happens in the graph
    (:mod:`actnn_zoo.compiled`). Off, a plain ``torch.compile`` of the same model (or an eager
    call) runs the Q-layers' own Functions as before. ``torch.compile`` guards on the value, so
    each setting has its own graph."""

    __slots__ = ("on", "bits", "group_size")

    def __init__(self, bits: int = 2, group_size: int = 256) -> None:
        self.on = False
        self.bits, self.group_size = bits, group_size  # for layers that quantize themselves


def inline_switch(module: Any) -> Any:
    """The module's :class:`InlineSwitch` (None: not under :func:`actnn_zoo.compile`), read
    from its ``__dict__`` (where ``actnn_zoo.compile`` puts it): traced, ``getattr`` of a
    missing attribute goes through ``nn.Module.__getattr__``, and dynamo guards on each dict it
    looks in -- five guards a layer on every compiled step's cache lookup, not one."""
    return module.__dict__.get(INLINE_ATTR)


def inline_compiling(module: Any) -> bool:
    """True while ``torch.compile`` traces ``module`` for :func:`actnn_zoo.compile` (its
    saves are compressed by the graph, so the module runs its plain torch forward and every
    host-side hook of the library steps aside)."""
    if not _is_compiling():
        return False
    switch = inline_switch(module)
    return switch is not None and switch.on


def graph_width(module: Any) -> Tuple[int, int]:
    """(bits, group size) at which a Q-layer traced by ``torch.compile`` saves what it
    quantizes itself: :func:`actnn_zoo.compile`'s setting while its switch is on, else the
    layer's own ``qconfig`` (a plain ``torch.compile`` of a converted model). One width per
    layer: a graph cannot take the strategies' per-sample widths (:class:`EagerHook`)."""
    switch = inline_switch(module)
    if switch is not None and switch.on:
        return switch.bits, switch.group_size
    return module.qconfig.bits, module.qconfig.group_size
