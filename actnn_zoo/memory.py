"""Measuring what compression buys: saved-activation bytes, peak memory, largest batch.

Three measurements, each chosen so that fp32, compressed and checkpointed training are
compared on equal terms:

* :func:`saved_activation_bytes` counts what autograd keeps for backward after one forward
  (``saved_tensors_hooks`` see every saved tensor, including the packed uint8 codes of the
  Q-layers), one count per distinct storage, parameters and buffers excluded, attributed to the
  innermost module that was running.
* :func:`peak_memory` runs a few training steps and reports the peak over the memory held
  before the first step: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak resident
  set of a fresh child process, so that nothing allocated earlier in the caller hides it.
* :func:`find_max_batch` bisects the batch size under a memory cap with those peaks.

Why VmHWM and not ``ru_maxrss`` on CPU: Linux carries the pre-``exec`` peak of the forking
process into the child's ``ru_maxrss`` (measured: a child of a 2 GB parent reports 1.9 GB
before allocating anything), which would mask every step smaller than the parent. The
per-address-space high-water mark ``VmHWM`` in ``/proc/self/status`` starts fresh at ``exec``
and can be reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``. ``ru_maxrss``
is only the fallback where ``/proc`` is missing.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

__all__ = [
    "SavedReport", "saved_activation_bytes", "compression_ratio", "PeakReport", "peak_memory",
    "measure_step_memory", "StepSpec", "apply_mode", "build_step", "spec_peak_memory",
    "interleaved_step_times",
    "MaxBatchResult", "find_max_batch", "MODES", "PHASES", "current_rss", "peak_rss",
    "reset_peak_rss",
]

MiB = 2 ** 20
OUTSIDE = "(outside modules)"
ROOT = "(model)"
MODES = ("fp32", "bits", "checkpoint")
PHASES = ("step", "forward", "no_grad")


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


# ---------------------------------------------------------------------- peak memory ----
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> Optional[int]:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> Tuple[int, str]:
    """Peak resident set of this address space in bytes, and which counter gave it."""
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm, "VmHWM"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (maxrss if sys.platform == "darwin" else maxrss * 1024), "ru_maxrss"


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    """Return memory freed during setup to the OS (glibc ``malloc_trim``), so the baseline is
    what is really in use and the steps cannot silently reuse freed-but-resident pages."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class PeakReport:
    """Peak memory of a few training steps.

    ``delta_bytes`` = ``peak_bytes - baseline_bytes``: the memory the measured steps needed
    beyond what was resident after setup and warm-up (activations, gradients, transient
    buffers; optimizer state is already in the baseline unless ``warmup=0``). ``headroom_bytes`` > 0 means the peak counter could not be reset and a
    delta below it is only a lower bound.
    """

    delta_bytes: int = 0
    baseline_bytes: int = 0
    peak_bytes: int = 0
    device: str = "cpu"
    method: str = ""
    step_seconds: List[float] = field(default_factory=list)
    headroom_bytes: int = 0
    error: Optional[str] = None

    @property
    def delta_mib(self) -> float:
        return self.delta_bytes / MiB

    @property
    def ok(self) -> bool:
        return self.error is None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step_memory(step_fn_factory: Callable[..., Callable[[], Any]], *args: Any,
                        steps: int = 2, device: str = "cpu", warmup: int = 1) -> PeakReport:
    """Build a step with ``step_fn_factory(*args)``, run ``warmup`` steps, take the baseline,
    run ``steps`` more in THIS process and report their peak over that baseline.

    The warm-up puts one-time costs in the baseline (optimizer state, oneDNN/OpenMP
    initialisation, caches: tens of MiB on CPU whatever the batch), so the delta is what one
    step needs on top of the state that persists between steps. ``warmup=0`` measures from
    before the first step instead.

    On CPU call it in a fresh process (that is what :func:`peak_memory` does); in a process that
    already allocated and freed memory the result is only meaningful if the counter resets.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        step = step_fn_factory(*args)
        _run_steps(step, warmup, dev)
        _sync(dev)
        gc.collect()
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        times = _run_steps(step, steps, dev)
        peak = torch.cuda.max_memory_allocated(dev)
        return PeakReport(peak - baseline, baseline, peak, str(dev), "cuda.max_memory_allocated",
                          times)
    step = step_fn_factory(*args)
    _run_steps(step, warmup, dev)
    gc.collect()
    _release_free_heap()
    baseline = current_rss()
    reset = reset_peak_rss()
    before, method = peak_rss()
    if baseline is None:  # no /proc: the best we have is the peak so far
        baseline = before
    times = _run_steps(step, steps, dev)
    peak, method = peak_rss()
    headroom = 0 if reset else max(0, before - baseline)
    if reset:
        method += " reset after warm-up"
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        method += f", MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    return PeakReport(max(0, peak - baseline), baseline, peak, str(dev), method, times, headroom)


def _run_steps(step: Callable[[], Any], steps: int, dev: torch.device,
               clock: Callable[[], float] = time.perf_counter) -> List[float]:
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        _sync(dev)
        times.append(clock() - t0)
    return times


_CHILD_CODE = ("import sys; from actnn_zoo.memory import child_entry; "
               "child_entry(sys.argv[1], sys.argv[2])")


def child_entry(in_path: str, out_path: str) -> None:
    """Entry point of the measuring child: unpickle (factory, args, steps, device, warmup),
    measure, pickle the PeakReport (or one carrying the error) to ``out_path``."""
    with open(in_path, "rb") as f:
        factory, args, steps, device, warmup = pickle.load(f)
    try:
        report = measure_step_memory(factory, *args, steps=steps, device=device, warmup=warmup)
    except Exception as exc:  # MemoryError, a model that fails to build, a missing converter
        report = PeakReport(device=device, error=f"{type(exc).__name__}: {exc}")
    with open(out_path, "wb") as f:
        pickle.dump(report, f)


def _child_env(exact_allocator: bool) -> Dict[str, str]:
    env = dict(os.environ)
    if exact_allocator:
        # glibc raises its mmap threshold after the first large free and then serves tensors
        # from heap arenas it never returns: RSS then tracks fragmentation more than tensors.
        # A fixed 64 KiB threshold maps every large tensor on its own and unmaps it on free.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    paths = [p or os.getcwd() for p in sys.path]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


def peak_memory(step_fn_factory: Callable[..., Callable[[], Any]], *args: Any, steps: int = 2,
                device: str = "cpu", warmup: int = 1, timeout: Optional[float] = 1800.0,
                exact_allocator: bool = True) -> PeakReport:
    """Peak memory of ``steps`` training steps built by ``step_fn_factory(*args)``.

    GPU: in this process with ``torch.cuda.max_memory_allocated`` (reset before the steps).
    CPU: in a fresh ``python`` child, so ``step_fn_factory`` must be importable at top level of
    a module (not ``__main__``) and ``args`` picklable, e.g. :func:`build_step` and a
    :class:`StepSpec`. A child that fails or is killed gives a report with ``error`` set.
    ``exact_allocator`` runs the child with ``MALLOC_MMAP_THRESHOLD_=65536`` so that its RSS
    follows the live tensors (measured on the CNN at batch 2048: fp32 268 MiB, checkpointing
    160 MiB; with glibc's default 423 and 386 MiB, the gap being retained heap fragments).
    """
    if torch.device(device).type == "cuda":
        return measure_step_memory(step_fn_factory, *args, steps=steps, device=device,
                                   warmup=warmup)
    with tempfile.TemporaryDirectory(prefix="az_peak_") as tmp:
        in_path, out_path = Path(tmp, "in.pkl"), Path(tmp, "out.pkl")
        in_path.write_bytes(pickle.dumps((step_fn_factory, args, steps, device, warmup)))
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD_CODE, str(in_path), str(out_path)],
                                  env=_child_env(exact_allocator), capture_output=True,
                                  text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return PeakReport(device=device, error=f"timed out after {timeout} s")
        if out_path.exists():
            with open(out_path, "rb") as f:
                return pickle.load(f)
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return PeakReport(device=device,
                          error=f"child exited with {proc.returncode}: {' | '.join(tail)}")


# ------------------------------------------------------------- step specifications ----
@dataclass(frozen=True)
class StepSpec:
    """A picklable description of one training step on a reference model (``models.py``).

    ``mode``: "fp32" (plain), "bits" (``convert_model(model, config, bits=..., strategy=...)``;
    ``bits=None`` keeps the config's default) or "checkpoint" (per-stage
    ``torch.utils.checkpoint``).

    ``phase``: what one "step" runs. "step": forward, loss, backward and the optimizer update.
    "forward": forward and loss as in training (autograd records, the store fills), then the
    graph is dropped: the peak of the forward alone. "no_grad": forward and loss under
    ``torch.no_grad()``, nothing saved: what the forward's own ops hold at once, a floor under
    the step peak of any method that runs the model's forward as written, however it keeps
    what backward needs (docs/design.md, "The floor of the step's peak").
    """

    model: str
    batch_size: int
    mode: str = "fp32"
    bits: Optional[int] = 2
    config: Any = None
    strategy: Optional[str] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    steps: int = 2
    warmup: int = 1
    seed: int = 0
    device: str = "cpu"
    lr: float = 0.01
    phase: str = "step"

    def __post_init__(self) -> None:
        if self.mode not in MODES:  # before any child process is started with it
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    def with_batch(self, batch_size: int) -> "StepSpec":
        return dataclasses.replace(self, batch_size=batch_size)

    @property
    def label(self) -> str:
        if self.mode == "bits":
            width = f"{self.bits}-bit" if self.bits else "converted"
            label = width if self.strategy in (None, "uniform") else f"{width} {self.strategy}"
        else:
            label = self.mode
        if self.phase == "no_grad":
            return "floor" if self.mode == "fp32" else f"{label} no-grad forward"
        return f"{label} forward" if self.phase == "forward" else label


def apply_mode(model: nn.Module, mode: str, bits: Optional[int] = 2, config: Any = None,
               strategy: Optional[str] = None) -> nn.Module:
    """Prepare ``model`` for training in ``mode`` (see :class:`StepSpec`); returns the model."""
    if mode == "fp32":
        return model
    if mode == "checkpoint":
        from .models import set_checkpointing

        return set_checkpointing(model, True)
    if mode == "bits":
        from .convert import convert_model  # written concurrently; imported only when needed

        overrides: Dict[str, Any] = {}
        if bits is not None:
            overrides["bits"] = bits
        if strategy is not None:
            overrides["strategy"] = strategy
        return convert_model(model, config, **overrides)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def build_step(spec: StepSpec) -> Callable[[], Tensor]:
    """Model, synthetic batch and SGD optimizer for ``spec``; returns a zero-arg training step
    (or the part of one that ``spec.phase`` names).

    Top-level and driven by a picklable spec, so it is the factory :func:`peak_memory` runs in
    a child process and :func:`find_max_batch` reuses.
    """
    from .models import build_model, example_batch, workload

    dev = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, **spec.model_kwargs).to(dev).train()
    model = apply_mode(model, spec.mode, spec.bits, spec.config, spec.strategy)
    x, y = example_batch(spec.model, spec.batch_size, spec.model_kwargs, spec.seed)
    x, y = x.to(dev), y.to(dev)
    loss_fn = workload(spec.model).loss
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)

    def step() -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    def forward() -> Tensor:
        return loss_fn(model(x), y).detach()  # the graph and its saved tensors go with loss

    def forward_no_grad() -> Tensor:
        with torch.no_grad():
            return loss_fn(model(x), y)

    return {"step": step, "forward": forward, "no_grad": forward_no_grad}[spec.phase]


def spec_peak_memory(spec: StepSpec, timeout: Optional[float] = 1800.0,
                     exact_allocator: bool = True) -> PeakReport:
    """:func:`peak_memory` of :func:`build_step` for ``spec`` (child process on CPU)."""
    return peak_memory(build_step, spec, steps=spec.steps, device=spec.device,
                       warmup=spec.warmup, timeout=timeout, exact_allocator=exact_allocator)


def interleaved_step_times(steps: Dict[str, Callable[[], Any]], n: int = 30, warmup: int = 3,
                           rounds: int = 3, device: str = "cpu",
                           clock: Callable[[], float] = time.perf_counter
                           ) -> Dict[str, List[float]]:
    """Per-step seconds for each named step function, ``n`` timed steps each after ``warmup``.

    The modes are timed round-robin in ``rounds`` chunks, so a machine that gets busier or
    quieter during the measurement shifts every mode alike and the ratios stay meaningful.
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU time,
    which other processes on a shared machine do not inflate (meaningful with one torch
    thread on the CPU, where the stepping thread does all the work).
    """
    dev = torch.device(device)
    for step in steps.values():
        _run_steps(step, warmup, dev)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    per_round = max(1, n // max(1, rounds))
    for _ in range(max(1, rounds)):
        for name, step in steps.items():
            times[name] += _run_steps(step, per_round, dev, clock)
    return times


# ------------------------------------------------------------------- largest batch ----
@dataclass
class MaxBatchResult:
    """Largest batch that fit, and every (batch, report, fitted) tried on the way."""

    batch_size: int
    cap_bytes: Optional[int]
    tries: List[Tuple[int, PeakReport, bool]] = field(default_factory=list)
    hit_limit: bool = False


def _gpu_try(spec: StepSpec) -> PeakReport:
    try:
        return measure_step_memory(build_step, spec, steps=spec.steps, device=spec.device,
                                   warmup=spec.warmup)
    except torch.cuda.OutOfMemoryError as exc:
        return PeakReport(device=spec.device, error=f"OutOfMemoryError: {str(exc)[:200]}")
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _out_of_memory(error: Optional[str]) -> bool:
    """Whether a failed try's error is running out of memory (what the search probes for),
    including a child the kernel's out-of-memory killer ended (SIGKILL)."""
    return error is not None and ("OutOfMemoryError" in error or "MemoryError" in error
                                  or "out of memory" in error.lower()
                                  or error.startswith("child exited with -9"))


def find_max_batch(spec: StepSpec, cap_bytes: Optional[int], start: int = 16,
                   limit: int = 1 << 20, rel_tol: float = 0.05,
                   measure: Optional[Callable[[StepSpec], PeakReport]] = None,
                   on_try: Optional[Callable[[int, PeakReport, bool], None]] = None
                   ) -> MaxBatchResult:
    """Largest batch size whose step peak stays within ``cap_bytes``: doubling from ``start``,
    then bisection until the bracket is within ``rel_tol`` (each try is a fresh child on CPU).

    On GPU with ``cap_bytes=None`` a batch fits when it does not raise an out-of-memory error.
    A try that fails for any other reason raises RuntimeError naming the batch and the error:
    counted as "too big" it would end the search at a wrong batch size without a word.
    """
    cuda = torch.device(spec.device).type == "cuda"
    if cap_bytes is None and not cuda:
        raise ValueError("a memory cap is needed on CPU")
    if measure is None:
        measure = _gpu_try if cuda else spec_peak_memory
    result = MaxBatchResult(0, cap_bytes)

    def fits(b: int) -> bool:
        report = measure(spec.with_batch(b))
        ok = report.ok and (cap_bytes is None or report.delta_bytes <= cap_bytes)
        result.tries.append((b, report, ok))
        if on_try is not None:
            on_try(b, report, ok)
        if not report.ok and not _out_of_memory(report.error):
            raise RuntimeError(f"{spec.label}: the step at batch {b} failed: {report.error}")
        return ok

    lo, hi = 0, None
    b = max(1, start)
    while b <= limit:
        if not fits(b):
            hi = b
            break
        lo, b = b, b * 2
    if hi is None:
        result.batch_size, result.hit_limit = lo, True
        return result
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    result.batch_size = lo
    return result


def clone_for_mode(model: nn.Module, mode: str, bits: Optional[int] = 2, config: Any = None,
                   strategy: Optional[str] = None) -> nn.Module:
    """A deep copy of ``model`` prepared for ``mode`` (the original stays as it was)."""
    return apply_mode(copy.deepcopy(model), mode, bits, config, strategy)


def describe(reports: Sequence[Tuple[str, SavedReport]]) -> str:
    """A side-by-side summary line per labelled report (MiB, tensors, dtypes)."""
    return "\n".join(f"{label:<14} {r.mib:>9.3f} MiB {r.num_tensors:>5} tensors  "
                     f"{','.join(r.dtypes)}" for label, r in reports)
