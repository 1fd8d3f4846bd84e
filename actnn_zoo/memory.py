"""Saved-activation accounting: what autograd keeps for backward, and what compression saves.

:func:`saved_activation_bytes` counts what autograd keeps for backward after one forward
(``saved_tensors_hooks`` see every saved tensor, including the packed uint8 codes of the
Q-layers), one count per distinct storage, parameters and buffers excluded, attributed to the
innermost module that was running. :func:`compression_ratio` compares two models with it.

Peak memory of whole training steps, step timing and the largest batch under a memory cap are
the benchmark harness, :mod:`actnn_zoo.bench`.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

__all__ = ["SavedReport", "saved_activation_bytes", "compression_ratio", "describe", "ROOT",
           "OUTSIDE", "MiB"]

MiB = 2 ** 20
OUTSIDE = "(outside modules)"
ROOT = "(model)"


# ------------------------------------------------------------------ saved activations ----
class _Packed:
    """What the pack hook hands autograd: the (detached) tensor and where it was saved.
    Autograd holds it for as long as the graph node that saved it lives, so a weak reference to
    it tells whether the tensor is still kept for backward when the forward is over."""

    __slots__ = ("tensor", "where", "__weakref__")

    def __init__(self, tensor: Tensor, where: str) -> None:
        self.tensor = tensor
        self.where = where


def _unpack(obj: Any) -> Tensor:
    return obj.tensor if isinstance(obj, _Packed) else obj


@dataclass
class SavedReport:
    """What one forward pass keeps for backward.

    ``total_bytes`` counts each distinct storage once (a view or a tensor saved by two ops costs
    its storage once, as in memory); storages of the model's parameters and buffers are
    excluded, and so is anything saved by a graph branch that was discarded before the forward
    ended (e.g. statistics computed with grad enabled and thrown away: ``num_discarded``).
    ``module_bytes`` attributes each storage to the innermost module whose forward was running
    when it was first saved (``"(model)"`` for the root module's own code,
    ``"(outside modules)"`` for e.g. the loss), and ``module_dtype_bytes`` splits that by dtype
    (a float32 entry in a compressed model is what is still kept uncompressed).
    """

    total_bytes: int = 0
    num_tensors: int = 0
    num_packed: int = 0
    num_duplicates: int = 0
    num_param_refs: int = 0
    num_discarded: int = 0
    dtype_bytes: Dict[str, int] = field(default_factory=dict)
    dtype_tensors: Dict[str, int] = field(default_factory=dict)
    module_bytes: Dict[str, int] = field(default_factory=dict)
    module_tensors: Dict[str, int] = field(default_factory=dict)
    module_dtype_bytes: Dict[str, Dict[str, int]] = field(default_factory=dict)
    training: bool = True
    # Bookkeeping used only while measuring (kept here so that measurements never share state).
    _stack: List[str] = field(default_factory=list, repr=False, compare=False)
    _excluded: Set[Tuple[str, int]] = field(default_factory=set, repr=False, compare=False)
    _packed: List["weakref.ref[_Packed]"] = field(default_factory=list, repr=False,
                                                  compare=False)

    @property
    def mib(self) -> float:
        return self.total_bytes / MiB

    @property
    def dtypes(self) -> List[str]:
        return sorted(self.dtype_bytes)

    def top_modules(self, n: Optional[int] = None) -> List[Tuple[str, int, int]]:
        """(module name, bytes, tensors), largest first."""
        rows = sorted(((k, v, self.module_tensors[k]) for k, v in self.module_bytes.items()),
                      key=lambda r: -r[1])
        return rows if n is None else rows[:n]

    def table(self, n: Optional[int] = 20) -> str:
        lines = [f"{'module':<44} {'KiB':>10} {'tensors':>8}"]
        for name, nbytes, count in self.top_modules(n):
            lines.append(f"{name[-44:]:<44} {nbytes / 1024:>10.1f} {count:>8}")
        lines.append(f"{'total':<44} {self.total_bytes / 1024:>10.1f} {self.num_tensors:>8}")
        return "\n".join(lines)

    # -- hooks --------------------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        self._stack.append(name)

    def _leave(self) -> None:
        if self._stack:
            self._stack.pop()

    def _pack(self, t: Tensor) -> Any:
        self.num_packed += 1
        if _storage_key(t) in self._excluded:
            self.num_param_refs += 1
            return t
        # detach(): same storage, no grad_fn. Holding ``t`` itself would close a cycle through
        # the C++ graph when an op saves its own output (tensor -> grad_fn -> holder -> tensor)
        # that the garbage collector cannot see, keeping discarded branches alive. Autograd
        # re-attaches the grad_fn on unpack, as it does for ``save_on_cpu``.
        holder = _Packed(t.detach(), self._stack[-1] if self._stack else OUTSIDE)
        self._packed.append(weakref.ref(holder))
        return holder

    def _tally(self) -> None:
        """Count what is still held for backward, once per storage, in the order saved."""
        gc.collect()  # graph branches freed only through a reference cycle
        seen: Set[Tuple[str, int]] = set()
        for ref in self._packed:
            holder = ref()
            if holder is None:
                self.num_discarded += 1
                continue
            t = holder.tensor
            key = _storage_key(t)
            try:
                nbytes = t.untyped_storage().nbytes() if key is not None else 0
            except (RuntimeError, NotImplementedError, TypeError):
                nbytes = 0
            if key is None:  # storage-less tensor subclass: count its logical size
                nbytes = t.numel() * t.element_size()
            elif nbytes > 0 and key in seen:
                self.num_duplicates += 1
                continue
            elif nbytes > 0:
                seen.add(key)
            dt = str(t.dtype).replace("torch.", "")
            self.total_bytes += nbytes
            self.num_tensors += 1
            self.dtype_bytes[dt] = self.dtype_bytes.get(dt, 0) + nbytes
            self.dtype_tensors[dt] = self.dtype_tensors.get(dt, 0) + 1
            self.module_bytes[holder.where] = self.module_bytes.get(holder.where, 0) + nbytes
            self.module_tensors[holder.where] = self.module_tensors.get(holder.where, 0) + 1
            per_dtype = self.module_dtype_bytes.setdefault(holder.where, {})
            per_dtype[dt] = per_dtype.get(dt, 0) + nbytes

    def _finish(self) -> None:
        self._stack.clear()
        self._excluded.clear()
        self._packed.clear()


def _storage_key(t: Tensor) -> Optional[Tuple[str, int]]:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def saved_activation_bytes(model: nn.Module, *inputs: Any,
                           loss_fn: Optional[Callable[[Any], Tensor]] = None,
                           preserve_state: bool = True, warmup: int = 0,
                           **kwargs: Any) -> SavedReport:
    """Bytes autograd keeps for backward after ``model(*inputs, **kwargs)`` (plus
    ``loss_fn(output)`` when given), per module and in total.

    The model runs in its current train/eval mode with grad enabled. With ``preserve_state``
    the forward leaves no trace: buffers (BatchNorm running statistics) are restored and the
    RNG state (dropout, stochastic rounding) is forked, so measuring does not perturb training.
    ``warmup``: forwards run (and measured) first and discarded. A converted model saves less
    from its second training forward on (its ReLUs learn in the first whether the next layer
    compresses their output, ``relu_codes``): ``warmup=1`` measures that steady state.
    """
    for _ in range(warmup):
        saved_activation_bytes(model, *inputs, loss_fn=loss_fn, preserve_state=preserve_state,
                               **kwargs)
    report = SavedReport(training=model.training)
    for t in list(model.parameters()) + list(model.buffers()):
        key = _storage_key(t)
        if key is not None:
            report._excluded.add(key)
    handles = []
    for name, module in model.named_modules():
        label = name or ROOT
        handles.append(module.register_forward_pre_hook(
            lambda _m, _a, label=label: report._enter(label)))
        handles.append(module.register_forward_hook(
            lambda _m, _a, _o: report._leave(), always_call=True))
    snapshot = [(b, b.detach().clone()) for b in model.buffers()] if preserve_state else []
    cuda = sorted({t.device.index or 0 for t in inputs
                   if isinstance(t, Tensor) and t.device.type == "cuda"})
    # A converted model's capture hooks are the innermost saved-tensor hooks during its
    # forward, so they hide what they keep from the hooks below: they report it to
    # ``observing`` instead. The loss runs inside the model's capture session, as under
    # ``actnn_zoo.capturing(model)``.
    from .capture import CAPTURE_ATTR, capturing, observing

    captured = CAPTURE_ATTR in vars(model)
    try:
        with torch.random.fork_rng(devices=cuda, enabled=preserve_state), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(report._pack, _unpack), \
                    observing(report._pack), \
                    (capturing(model) if captured else contextlib.nullcontext()):
                out = model(*inputs, **kwargs)
                loss = loss_fn(out) if loss_fn is not None else None
            report._tally()  # while out and loss (hence the graph) are alive
            del out, loss
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for buf, saved in snapshot:
                buf.copy_(saved)
        report._finish()
    return report


def compression_ratio(model_fp32: nn.Module, model_q: nn.Module, *inputs: Any,
                      loss_fn: Optional[Callable[[Any], Tensor]] = None) -> float:
    """Saved-activation bytes of ``model_fp32`` over those of ``model_q`` on the same inputs."""
    ref = saved_activation_bytes(model_fp32, *inputs, loss_fn=loss_fn)
    q = saved_activation_bytes(model_q, *inputs, loss_fn=loss_fn)
    return ref.total_bytes / q.total_bytes if q.total_bytes else float("inf")


def describe(reports: Sequence[Tuple[str, SavedReport]]) -> str:
    """A side-by-side summary line per labelled report (MiB, tensors, dtypes)."""
    return "\n".join(f"{label:<14} {r.mib:>9.3f} MiB {r.num_tensors:>5} tensors  "
                     f"{','.join(r.dtypes)}" for label, r in reports)
