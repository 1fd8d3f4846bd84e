"""The benchmark harness: peak memory of training steps, their timing, the largest batch.

Not part of the training library (nothing under ``actnn_zoo`` below it imports it): the CLI
(``python -m actnn_zoo``), the demo and ``scripts/`` use it to measure what compression buys,
on equal terms for fp32, compressed and checkpointed training. The library's own accounting of
saved activations is :mod:`actnn_zoo.memory`.

* :mod:`.peak`: :func:`peak_memory` of a few steps (GPU in process; CPU in a fresh child, VmHWM);
* :mod:`.steps`: :class:`StepSpec`, a picklable step on a reference model, :func:`build_step`,
  :func:`spec_peak_memory`, :func:`interleaved_step_times`;
* :mod:`.max_batch`: :func:`find_max_batch` under a memory cap;
* :mod:`.work`: :func:`host_work`, the Python calls and torch operators of a step, counted.
"""
from .max_batch import MaxBatchResult, find_max_batch
from .peak import (PeakReport, current_rss, malloc_live_bytes, measure_step_memory,
                   peak_memory, peak_rss, reset_peak_rss, run_steps)
from .steps import (MODES, PHASES, StepSpec, apply_mode, build_step, clone_for_mode,
                    interleaved_step_times, spec_peak_memory)
from .work import HostWork, host_work

__all__ = ["PeakReport", "peak_memory", "measure_step_memory", "current_rss", "peak_rss",
           "reset_peak_rss", "run_steps", "malloc_live_bytes", "MODES", "PHASES", "StepSpec", "apply_mode",
           "build_step", "clone_for_mode", "spec_peak_memory", "interleaved_step_times",
           "MaxBatchResult", "find_max_batch", "HostWork", "host_work"]
