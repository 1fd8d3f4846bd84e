"""Peak memory of a few training steps, in this process (GPU) or a fresh child (CPU).

Part of the benchmark harness (:mod:`actnn_zoo.bench`), not of the library: it measures what
compression buys, on equal terms for fp32, compressed and checkpointed training.

* :func:`peak_memory` runs a few training steps and reports the peak over the memory held
  before the first step: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak resident
  set of a fresh child process, so that nothing allocated earlier in the caller hides it.

Why VmHWM and not ``ru_maxrss`` on CPU: Linux carries the pre-``exec`` peak of the forking
process into the child's ``ru_maxrss`` (measured: a child of a 2 GB parent reports 1.9 GB
before allocating anything), which would mask every step smaller than the parent. The
per-address-space high-water mark ``VmHWM`` in ``/proc/self/status`` starts fresh at ``exec``
and can be reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``. ``ru_maxrss``
is only the fallback where ``/proc`` is missing.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..memory import MiB

__all__ = ["PeakReport", "peak_memory", "measure_step_memory", "current_rss", "peak_rss",
           "reset_peak_rss", "run_steps", "malloc_live_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> Optional[int]:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2() -> Optional[Callable[[], _MallInfo2]]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_live_bytes() -> Optional[int]:
    """Bytes the C allocator holds for the program now (glibc ``mallinfo2``: in-use heap
    blocks plus mmapped ones), after a garbage collection; None without glibc >= 2.33.

    Why: on the CPU, torch's tensors are malloc'd and freed at once, so the difference of
    this count around a forward is what the forward left alive -- the saved tensors, as the
    allocator sees them, whoever holds them (autograd nodes, a compiled graph's saved values,
    a library's store). RSS moves in pages and keeps freed memory."""
    fn = _mallinfo2()
    if fn is None:
        return None
    gc.collect()
    info = fn()
    return int(info.uordblks + info.hblkhd)


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
        run_steps(step, warmup, dev)
        _sync(dev)
        gc.collect()
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        times = run_steps(step, steps, dev)
        peak = torch.cuda.max_memory_allocated(dev)
        return PeakReport(peak - baseline, baseline, peak, str(dev), "cuda.max_memory_allocated",
                          times)
    step = step_fn_factory(*args)
    run_steps(step, warmup, dev)
    gc.collect()
    _release_free_heap()
    baseline = current_rss()
    reset = reset_peak_rss()
    before, method = peak_rss()
    if baseline is None:  # no /proc: the best we have is the peak so far
        baseline = before
    times = run_steps(step, steps, dev)
    peak, method = peak_rss()
    headroom = 0 if reset else max(0, before - baseline)
    if reset:
        method += " reset after warm-up"
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        method += f", MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    return PeakReport(max(0, peak - baseline), baseline, peak, str(dev), method, times, headroom)


def run_steps(step: Callable[[], Any], steps: int, dev: torch.device,
              clock: Callable[[], float] = time.perf_counter) -> List[float]:
    """Run ``step`` ``steps`` times; the seconds of each (device synchronised)."""
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        _sync(dev)
        times.append(clock() - t0)
    return times


_CHILD_CODE = ("import sys; from actnn_zoo.bench.peak import child_entry; "
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
    a module (not ``__main__``) and ``args`` picklable, e.g.
    :func:`actnn_zoo.bench.build_step` and a :class:`actnn_zoo.bench.StepSpec`. A child that fails or is killed gives a report with ``error`` set.
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
