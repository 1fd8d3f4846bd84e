"""What a training step dispatches off the CPU, counted on the meta device.

On a GPU the kernels run asynchronously and a step is as fast as its host side: its Python and
one launch per torch operator and per kernel of the extension. The library's off-CPU branches
(torch programs where the CPU has one compiled call, larger chunks and attention tiles) cannot
be timed without a GPU, but they can be counted: on the meta device every torch operator runs
its shape function only and the extension's kernels are shape-only stand-ins with the CUDA
entries' allocations (:mod:`actnn_zoo.quant.meta`), so a converted model's step takes the
branches a GPU takes and computes nothing. :func:`offcpu_work` counts one step's

* torch operators (on a GPU each is a launch or at least a trip through the dispatcher), by
  name and by the library function that dispatched them;
* the extension's kernel calls (one launch each on a GPU);
* host reads: whatever would make the host wait for a GPU (``item``, ``nonzero``,
  ``is_nonzero``, ``equal``, ``masked_select``, ``unique``) and copies to the host, each with
  where it happened.

Host reads are answered with zeros (an empty ``nonzero``) so that the step runs to its end;
the values a meta step computes are meaningless anyway. Counts repeat exactly from run to run,
so a change to the off-CPU glue can be judged by them on any machine.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from .._torch_private import TorchDispatchMode
from ..quant import meta as _meta

__all__ = ["OffCpuWork", "offcpu_work", "answering_reads", "summary"]

_PACKAGE = str(Path(__file__).resolve().parents[1])
_THIS = str(Path(__file__).resolve())
_META = str(Path(_meta.__file__).resolve())
_KERNELS = frozenset(_meta.__all__)

_aten = torch.ops.aten
# operators whose result the host needs before it can go on: a sync on a GPU
_WAITS = {_aten._local_scalar_dense.default: 0, _aten.is_nonzero.default: False,
          _aten.equal.default: True}
_DATA_DEPENDENT = (_aten.nonzero.default, _aten.masked_select.default,
                   _aten._unique2.default, _aten.unique_dim.default,
                   _aten.unique_consecutive.default)


@dataclass
class OffCpuWork:
    """One step's counts (see the module docstring). ``by_place`` keys are
    ``"module.py:function"`` of the innermost library frame, or ``"outside: file:function"``."""

    ops: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_place: Counter = field(default_factory=Counter)
    kernels: int = 0
    by_kernel: Counter = field(default_factory=Counter)
    host_reads: Counter = field(default_factory=Counter)  # (operator, place) -> count

    @property
    def reads(self) -> int:
        """Host reads of the step (waits and copies to the host)."""
        return sum(self.host_reads.values())


def _place(frame: Any) -> str:
    """The innermost library frame above ``frame`` (this module's own skipped)."""
    outside: Optional[str] = None
    while frame is not None:
        name = frame.f_code.co_filename
        if (name.startswith(_PACKAGE) and name != _THIS
                and frame.f_code.co_name != "__torch_function__"):  # the capture mode passes on
            return f"{Path(name).name}:{frame.f_code.co_name}"
        if (outside is None and not name.startswith(_PACKAGE) and "/torch/" not in name
                and not name.startswith("<")):
            outside = f"outside: {Path(name).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return outside or "outside: torch"


class _Counting(TorchDispatchMode):
    def __init__(self, work: OffCpuWork, places: bool) -> None:
        super().__init__()
        self.work, self.places = work, places

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = self.work
        w.ops += 1
        w.by_op[str(func)] += 1
        place = _place(sys._getframe(1)) if self.places else None
        if place is not None:
            w.by_place[place] += 1
        if func in _WAITS:
            answer = _WAITS[func]
        elif func in _DATA_DEPENDENT:
            x = args[0]
            answer = torch.zeros(0, max(x.dim(), 1), dtype=torch.int64, device=x.device)
        elif func is _aten._to_copy.default and _to_host(args[0], kwargs.get("device")):
            answer = torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        elif func is _aten.copy_.default and _to_host(args[1], args[0].device):
            answer = args[0].zero_()
        else:
            return func(*args, **kwargs)
        w.host_reads[(str(func), place or _place(sys._getframe(1)))] += 1
        return answer


def _to_host(src: Any, dest: Any) -> bool:
    return (isinstance(src, torch.Tensor) and src.device.type == "meta" and dest is not None
            and torch.device(dest).type == "cpu")


def offcpu_work(step: Callable[[], Any], places: bool = False) -> OffCpuWork:
    """Counts of one call of ``step``, a training step of a model on the meta device (run the
    warm-up steps before, under :func:`answering_reads` when they read values). ``places``:
    also attribute each operator to the library function that dispatched it (slower)."""
    work = OffCpuWork()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == _META \
                and frame.f_code.co_name in _KERNELS:
            work.kernels += 1
            work.by_kernel[frame.f_code.co_name] += 1

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        with _Counting(work, places):
            step()
    finally:
        sys.setprofile(old)
    return work


def answering_reads() -> TorchDispatchMode:
    """A mode under which a meta step's host reads are answered (as :func:`offcpu_work` does)
    but nothing is counted: for warm-up steps."""
    return _Counting(OffCpuWork(), places=False)


def summary(work: OffCpuWork, top: int = 12) -> Dict[str, Tuple[Tuple[str, int], ...]]:
    """The largest entries of each count, for printing."""
    return {"operators": tuple(work.by_op.most_common(top)),
            "places": tuple(work.by_place.most_common(top)),
            "kernels": tuple(work.by_kernel.most_common(top)),
            "host reads": tuple((f"{op} at {place}", n)
                                for (op, place), n in work.host_reads.most_common(top))}
