"""Tier 2's ``TorchFunctionMode``: routes functional calls of a training forward to handlers.

Public API (``torch.overrides.TorchFunctionMode``; the extension reads the thread's mode stack
through torch's C++ API, ``cpp_ext/stacks.cpp``). While the mode runs a handler, torch
takes the mode off the stack, so the torch calls a handler (or a Function's forward) makes are
not routed again; inside any autograd Function's forward grad mode is off and the mode passes
every call through, so the zoo's Q-layers and other custom Functions are never routed twice.
Unlisted calls cost one dict lookup -- but every one of them, tensor attribute reads included,
is a Python call into the mode (~1-2 us), and a Q-layer's own glue and autograd Function make
about a hundred such calls per layer. A Q-layer therefore runs with the mode off the stack
(:func:`call_unrouted`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .._compile import _dynamo_compiling
from .._torch_private import inside_checkpoint
from ..quant.backend import extension
from .handlers import Handler

__all__ = ["CaptureMode", "call_unrouted", "call_unrouted_python", "in_routed_segment",
           "routed_segment"]

# Without the extension, call_unrouted's probe: ``_PROBE.dim()`` reaches the innermost torch
# function mode through torch's C++ dispatch (~1.5 us); the capture mode answers it with itself
# when _innermost_by_probe asked it directly, any other mode or none with the int torch computes.
_PROBE = torch.empty(0)
_DIM = torch.Tensor.dim
_grad_enabled = torch.is_grad_enabled


# Set while a checkpointed segment runs under checkpoint_context's forward context: its
# recomputation routes (the context's recompute mode), so its forward must route too.
_ROUTED_SEGMENT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "actnn_zoo_routed_segment", default=False)


def in_routed_segment() -> bool:
    """Whether a checkpointed segment entered under :func:`routed_segment` is running."""
    return _ROUTED_SEGMENT.get()


@contextlib.contextmanager
def routed_segment() -> Iterator[None]:
    """Route inside the checkpointed segment this context is entered for (see above)."""
    token = _ROUTED_SEGMENT.set(True)
    try:
        yield
    finally:
        _ROUTED_SEGMENT.reset(token)


class CaptureMode(TorchFunctionMode):
    """``in_segments``: route also inside a ``torch.utils.checkpoint`` segment. The forward's
    mode does not (unless the segment runs under :func:`routed_segment`): a segment keeps
    nothing of its forward, and its recomputation in backward runs after the session closed,
    as plain torch ops, which must save what the forward saved (else ``CheckpointError``)."""

    def __init__(self, session: Any, table: Mapping[Callable, Handler],
                 in_segments: bool = False) -> None:
        super().__init__()
        self.session = session
        self.table = table
        self._lookup = table.get  # bound once: the mode's every call looks up
        self.in_segments = in_segments
        # the store told whether the last call the mode saw ran under no_grad (see below)
        self._store = getattr(session, "store", None)

    def __torch_function__(self, func: Callable, types: Tuple, args: Tuple = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        # Every torch call and tensor attribute read of the forward lands here: the unlisted
        # ones (almost all) take the shortest path, one table lookup and the call.
        if _dynamo_compiling():  # (one Python frame: the mode sees every torch call)
            # torch.compile traces a region of the forward (a compiled submodule of a converted
            # model, the session opened by the eager root): the mode steps aside there, as no
            # session opens when the whole model is compiled -- the region's Q-layers save
            # through their traced forms. Traced, the table lookup and the handlers' host work
            # broke the graph at every call (a two-block MLP compiled into 4 graphs with 61
            # breaks, the plain model into one).
            return func(*args, **kwargs) if kwargs else func(*args)
        grad = _grad_enabled()
        store = self._store
        if store is not None:
            # A custom autograd Function's forward runs under no_grad, and it saves right
            # after: a save that follows calls under no_grad, with no grad-enabled call in
            # between, is a custom Function's (a re-entrant checkpoint saving its segment's
            # inputs, DeepSpeed's or Megatron's as well as torch's): tier 3 keeps it exact.
            store.after_no_grad = not grad
        handler = self._lookup(func)
        if handler is None or not grad:
            if func is _DIM and args[0] is _PROBE:  # call_unrouted's probe (never listed)
                # asked by _innermost_by_probe itself (the mode is innermost), not handed on by
                # a mode above this one (whose frame would be the caller): answer with the mode
                return self if sys._getframe(1).f_code is _PROBE_CODE else func(*args)
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if not self.in_segments and not _ROUTED_SEGMENT.get() and inside_checkpoint():
            return func(*args, **kwargs)
        return handler(self.session, func, args, kwargs)


def call_unrouted_python(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the capture mode off the stack when it is the innermost
    torch function mode; otherwise plainly. :data:`call_unrouted` is this function, or with
    the extension the same steps in one compiled call (``_C.call_without_mode``): every
    Q-layer call of a session goes through here, and this function's Python (five frames with
    the mode's ``__exit__`` and ``__enter__``) cost about two microseconds of it.

    Only for code that must not be routed (a Q-layer that saves through its own Function):
    nothing inside is routed or pays the mode's per-call cost. The innermost mode is read from
    the thread's mode stack (``_C.innermost_function_mode``; without the extension, asked
    through ``_PROBE.dim()``, which torch hands to the innermost mode only, and which the
    capture mode answers with itself); a capture mode is taken off the stack (``__exit__``)
    while ``fn`` runs and put back
    (``__enter__``) after, also when ``fn`` raises -- what torch's own override protocol does
    around a mode's handler, without its Python (~4.5 us a call before, ~1.6 with the probe,
    ~0.5 reading the stack). A mode the user entered inside the forward (a ``torch.device``
    context, a counting mode) is innermost then and must keep seeing the layer's calls, so
    ``fn`` runs plainly. Tensor subclasses among the arguments are not consulted here: their
    ``__torch_function__`` still sees every torch call ``fn`` makes.
    """
    mode = _innermost()
    if not isinstance(mode, CaptureMode):
        return fn(*args, **kwargs)
    mode.__exit__(None, None, None)
    try:
        return fn(*args, **kwargs)
    finally:
        mode.__enter__()


def _innermost_by_probe() -> Any:
    """The innermost torch function mode when it is a capture mode (else an int): the probe
    above, for builds without the extension's stack reader."""
    return _PROBE.dim()


_PROBE_CODE = _innermost_by_probe.__code__
# The innermost torch function mode (or None), read from the thread's mode stack by the
# extension (cpp_ext/stacks.cpp); without it, the probe.
_innermost: Callable[[], Any] = (getattr(extension(), "innermost_function_mode", None)
                                 or _innermost_by_probe)

# call_unrouted(fn, *args, **kwargs): call_unrouted_python's steps (the innermost mode popped
# when it is a CaptureMode, pushed back after fn, also when fn raises), in C
# (cpp_ext/stacks.cpp); call_unrouted_python itself without the extension
_call_without_mode = getattr(extension(), "call_without_mode", None)
call_unrouted: Callable[..., Any] = (
    functools.partial(_call_without_mode, CaptureMode) if _call_without_mode is not None
    else call_unrouted_python)
