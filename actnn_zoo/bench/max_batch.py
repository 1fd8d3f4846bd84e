"""The largest batch whose training step fits a memory cap (benchmark harness)."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from .peak import PeakReport, measure_step_memory
from .steps import StepSpec, build_step, spec_peak_memory

__all__ = ["MaxBatchResult", "find_max_batch"]


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
