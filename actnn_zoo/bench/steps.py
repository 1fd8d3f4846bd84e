"""Picklable training steps on the reference models, and their timing.

Part of the benchmark harness (:mod:`actnn_zoo.bench`): a :class:`StepSpec` names a model of
:mod:`actnn_zoo.models`, a batch size and a training mode (fp32, converted, checkpointed);
:func:`build_step` turns it into a zero-argument step, in this process or in the child process
that :func:`spec_peak_memory` starts.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from .peak import PeakReport, peak_memory, run_steps

__all__ = ["MODES", "PHASES", "StepSpec", "apply_mode", "build_step", "clone_for_mode",
           "spec_peak_memory", "interleaved_step_times"]

MODES = ("fp32", "bits", "checkpoint")
PHASES = ("step", "forward", "no_grad")


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
        from ..models import set_checkpointing

        return set_checkpointing(model, True)
    if mode == "bits":
        from ..convert import convert_model  # written concurrently; imported only when needed

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
    from ..models import build_model, example_batch, workload

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
    Every other round runs them in reverse order, so that no mode always follows the same one:
    a mode's first steps pay for the caches the one before it left (on GPT-2's 1-thread step a
    conversion timed right after the plain model averaged ~0.9 ms more over 6-step chunks than
    after another conversion; per-step medians, as ``scripts/bench_host_cost.py`` takes them,
    moved less than this machine's run-to-run spread).
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU time,
    which other processes on a shared machine do not inflate (meaningful with one torch
    thread on the CPU, where the stepping thread does all the work).
    """
    dev = torch.device(device)
    for step in steps.values():
        run_steps(step, warmup, dev)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    per_round = max(1, n // max(1, rounds))
    order = list(steps.items())
    for r in range(max(1, rounds)):
        for name, step in order if r % 2 == 0 else reversed(order):
            times[name] += run_steps(step, per_round, dev, clock)
    return times


def clone_for_mode(model: nn.Module, mode: str, bits: Optional[int] = 2, config: Any = None,
                   strategy: Optional[str] = None) -> nn.Module:
    """A deep copy of ``model`` prepared for ``mode`` (the original stays as it was)."""
    return apply_mode(copy.deepcopy(model), mode, bits, config, strategy)
