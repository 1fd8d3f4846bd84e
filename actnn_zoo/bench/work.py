"""How much host work a step does, counted rather than timed.

A step's host cost on a shared 2-core machine varies by 5-10% from run to run, more than most
changes to the library's per-call glue move it. What that glue costs is, to first order, how many
Python calls it makes and how many torch operators it dispatches; both are the same in every run
of the same step. :func:`host_work` counts them, so that a change to the glue can be judged by a
number that does not move when the machine gets busy (the time is still what users feel: the
benchmarks report both).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["HostWork", "host_work"]


@dataclass(frozen=True)
class HostWork:
    """Per step: Python-level calls (functions and builtins, as ``sys.setprofile`` sees them)
    and torch operators dispatched (``aten::`` events of ``torch.profiler``)."""

    python_calls: float
    aten_ops: float


def host_work(step: Callable[[], Any], steps: int = 10) -> HostWork:
    """The mean :class:`HostWork` of ``steps`` calls of ``step``, each count over its own
    ``steps`` calls. Run it after the warm-up (the first steps of a precision strategy or a
    compiled model do one-off work), over a whole number of the strategy's cycles: the default
    strategy re-allocates and records gradients once every ``update_interval`` (10) steps, so
    any 10 steps in a row do the same work."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            count[0] += 1

    previous = sys.getprofile()
    sys.setprofile(tracer)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(previous)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return HostWork(count[0] / steps, ops / steps)
