"""The capture session of one training forward, and how code inside that forward finds it.

A converted root module opens one :class:`CaptureSession` when its training forward starts
and closes it when the forward ends (also when it raises). While it is open, a
:class:`contextvars.ContextVar` points at it: that is how the zoo's autograd Functions reach
the one store (``functional/_saving.compress``) and how a converted model nested inside
another converted model knows not to open a second session. Like torch's own autocast and
mode stacks the variable is scoped (set on entry, reset on exit, per thread / task), so no
setting outlives the forward and two models never share anything; what survives is only what
autograd keeps.
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional

__all__ = ["active_session", "current_observer", "observing"]

_ACTIVE: "contextvars.ContextVar[Optional[Any]]" = contextvars.ContextVar(
    "actnn_zoo_capture_session", default=None)
# A callable that saved_activation_bytes installs while it measures: the capture hooks hand it
# every tensor they keep (payloads and pass-throughs), because saved-tensor hooks do not chain
# and the capture hooks, being innermost, would otherwise hide everything from the measurement.
_OBSERVER: "contextvars.ContextVar[Optional[Callable[[Any], Any]]]" = contextvars.ContextVar(
    "actnn_zoo_capture_observer", default=None)


def active_session() -> Optional[Any]:
    """The open :class:`~actnn_zoo.capture.CaptureSession` of this thread, or None."""
    return _ACTIVE.get()


def current_observer() -> Optional[Callable[[Any], Any]]:
    return _OBSERVER.get()


class observing:
    """``with observing(fn):`` -- capture hooks pass each kept tensor to ``fn`` and keep what it
    returns alive with their own saved object (used by :mod:`actnn_zoo.memory`)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self._token: Optional[contextvars.Token] = None

    def __enter__(self) -> "observing":
        self._token = _OBSERVER.set(self.fn)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _OBSERVER.reset(self._token)
        self._token = None


def _enter(session: Any) -> contextvars.Token:
    return _ACTIVE.set(session)


def _leave(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)
