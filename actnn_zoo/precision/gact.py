"""``strategy: gact`` -- one width per saved tensor from measured gradient-variance
sensitivities, in the style of GACT (Liu et al., ICML 2022).

Model (GACT, section 4). Compressing the tensor saved by Q-layer l at b bits adds about
``C_l / (2^b - 1)^2`` to the variance of the whole parameter gradient, the terms of different
tensors adding up (independent stochastic rounding). The widths ``b_l`` in {1, 2, 4, 8}
minimise ``sum_l V_l(b_l)`` subject to ``sum_l v_l b_l <= bits * sum_l v_l``, with
``V_l(b) = C_l / (2^b - 1)^2`` except where the 1-bit variance is measured (below). 8 is the
top: a Q-layer has no "keep it uncompressed" width.

Budget in bytes (ours; GACT counts values). ``v_l`` is the number of values tensor l's codes
hold, so that the constraint is "no more saved bytes than every tensor at ``bits``": the
per-group metadata (a bf16 minimum and step per group) does not depend on the width and is
the same on both sides. A ReLU output stored as sparse codes (``relu_codes``: a mask plus the
codes of its nonzeros) has ``v_l`` = its nonzeros, measured by the probe; a tensor several
conv / linear layers save (a block input read by a conv and a projection shortcut, q / k / v
projections of one input) is one payload in the capture store, so those layers are one item
of the solve (their C summed, one width, ``v`` counted once). A width reaches the layer as
its qconfig's int ``bits`` (the configured qconfig is restored on detach), not as per-sample
widths: per-sample widths add 9 bytes per row (row widths and offsets) and the store never
shares a per-sample payload. Counting values instead cost 2-3% more bytes than uniform on the
digits CNN (sparse codes downgraded as if 1 bit saved a bit per value, 4- and 8-bit rows of
32-64 values paying the per-row overhead).

Solver (:func:`greedy_widths`, GACT's): everyone starts at 8 bits; a heap holds each tensor's
next step down (8 -> 4 -> 2 -> 1) keyed by the variance it adds per bit it saves,
``(V(b') - V(b)) / (v (b - b'))``; the cheapest step is taken until the budget holds. Per
tensor these keys increase along the chain (0.0011 C/v, 0.053 C/v, 0.89 C/v per bit under the
model; a measured 1-bit variance is raised where needed to keep that order,
:func:`convex_one_bit`), so the steps are taken in globally increasing key order and the
result is a Lagrangian optimum: exactly optimal among all allocations spending at most what it
spends (tested against brute force). The last step may overshoot the budget; the bits left are
then given back by upgrades that still fit, best gain per bit first.

Guard (ours). At a budget that is itself a width (2 bits), uniform widths are a feasible
allocation; the new allocation is applied only if the model predicts at least ``min_gain``
(10%) less variance than uniform, else every free tensor keeps the budget's width. Measured
on the digits CNN (scripts/gact_vs_uniform.py), the model's prediction is within about +-10%
of the measured ratio, and allocations predicted 0.9-1.0x uniform measured 0.88x-1.07x: below
that margin the allocation is noise. ``report()["predicted_ratio"]`` is the last prediction.

Estimator of C_l (``estimator="hybrid"``, the default; GACT needs per tensor l a few extra
forward + backward passes with only tensor l compressed, on an 8-sample sub-batch every 1000
steps). The probe replays the last recorded training batch (its first ``probe_samples``
samples, with the gradient the loss sent into the model's output, so the loss need not be
known) and controls the stochastic-rounding seeds of every Q-layer separately: a forward
pre-hook seeds torch's CPU generator from (probe, layer, variant) and opens a seed stream
keyed from it (``quant/seeds.py``: inside a capture session every compressed tensor takes its
seed from the session's stream, so re-seeding the generator alone changed no rounding: every
conv / linear sensitivity came out 0, all of them went to 1 bit, 7.1x uniform's gradient
error on scripts/gact_vs_uniform.py's digits CNN); a forward hook closes it and re-seeds to a
neutral value. Two passes that
differ only in the variant of some layers differ only in those layers' rounding; dropout
modules, what tier 3 compresses and everything else random are identical. A weight gradient
is linear in each saved conv / linear input, so ``E ||g1 - g2||^2 / 2 = Var`` of what the
re-seeded tensors add. Passes per update:

* R: reference seeds;
* A: every free conv / linear tensor re-seeded. Their noise enters only their own weight
  gradient (the input gradient ``W^T g_y`` does not read the saved input, and the output
  gradient is the same in R and A), so ``||(g_R - g_A)[W_l]||^2 / 2`` is, exactly in
  expectation, tensor l's variance: all of them from one pass;
* per other free tensor (norms, smooth activations, softmax), one pass re-seeding it alone,
  the variance summed over every parameter (its noise reaches every earlier layer), and, for
  an activation's derivative above 1 bit, two passes at 1 bit (seeds 0 and 1): its 1-bit
  variance, measured.

The 1/(2^b - 1)^2 model holds for conv / linear inputs (measured 9.1x from 2 bits to 1 on the
digits CNN) but not for norms, whose backward is quadratic in what they save: their 1-bit
variance measured 12-45x their 2-bit one, three BatchNorms moved to 1 bit on the model's 9x
added 35% to the CNN's gradient variance where 18% was predicted, and with the 1-bit variance
measured (one draw on 8 samples) three LayerNorms of GPT-2 at 1 bit still cost 1.09x uniform's
weight error (heavy tails a draw misses). So norms and softmax (the same quadratic backward)
take the step to 1 bit only when nothing else is left to take down (a budget under 2 bits):
their 1-bit variance is infinite to the solver, which keeps any budget.

``2 + L_other + 2 L_act`` passes of ``probe_samples`` samples per update. ``estimator="joint"`` (3
passes: R, A and one re-seeding every other tensor, its variance attributed to the parameters
of the layer consuming it in backward) is cheaper but misses what travels further up: on
random-init GPT-2, whose LayerNorms feed layers GACT does not see, it under-rated them and
lost to uniform (docs/results.md). ``estimator="per_tensor"`` is GACT's (1 + L passes, every
tensor alone, the variance over every parameter; no 1-bit measurement).
``scripts/bench_strategies.py`` compares them.

Schedule: the batch of step ``t - 1`` is recorded when step ``t`` is an update step (step 2,
then every ``update_interval`` steps); the probe runs in the model's forward pre-hook of step
``t`` (before its forward, outside any backward), leaves the training RNG stream, the
parameters' ``.grad`` and the BatchNorm running statistics as they were, and sends its
sensitivities (and the sparse tensors' nonzero fractions) to the host with one non-blocking
copy (``readback.DeferredRead``). Step ``t + 1`` reads them, solves on the host and applies
the widths. Nothing reads the device per step. Until the first update applies every free
layer uses the config's width (``qconfig.bits``).

Limits: the model's output must be a tensor or a flat tuple / list / dict of tensors (else no
probe runs and the widths stay uniform); randomness outside torch's CPU generator or the
Q-layers' control (functional dropout on CUDA) adds to the estimate; the probe's forwards run
the model's other forward hooks too. Pinned layers keep their width and their cost is taken
off the budget. What tier 2 / 3 of capture compresses (GPT-2's Conv1D inputs, attention) is
outside GACT's control and its noise is the same under every allocation.

Threads running one model (``base``'s module doc): each root training forward takes its step
from the root's pre-hook (kept per thread) and keeps its own recording; a recording is offered
to the probe once its output gradient has arrived (so the probe of an update step may run a
step or two later, when the recorded forward was another thread's and its backward had not
run yet; in one thread too, when the recorded step had no backward: the steps while a probe
is due are recorded). A step that probes or applies widths first waits until no other forward of the
model is running and holds new ones back until it is done: the probe's passes change the
layers' seeds, widths and (restored afterwards) BatchNorm statistics, which a concurrent
forward would otherwise see. Sizes change under the strategy's lock; a probe's seed streams
are opened and closed on the thread that runs the layer.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from .._compile import EagerHook
from .._session import active_session
from ..quant.seeds import seed_stream
from .base import PrecisionStrategy, TrackedLayer, compresses_now
from .readback import DeferredRead
from .stats import LayerKind, LayerStats, count_call, layer_kind

__all__ = ["GACTStrategy", "greedy_widths", "variance_cost", "ESTIMATORS"]

WIDTHS: Tuple[int, ...] = (1, 2, 4, 8)
ESTIMATORS: Tuple[str, ...] = ("hybrid", "joint", "per_tensor")
_DOWN = {8: 4, 4: 2, 2: 1}
_UP = {1: 2, 2: 4, 4: 8}


def _v(b: int) -> float:
    return 1.0 / float((1 << b) - 1) ** 2


def variance_cost(score: Sequence[float], bits: Sequence[int],
                  one_bit: Optional[Sequence[Optional[float]]] = None) -> float:
    """``sum C_l / (2^b_l - 1)^2``: the gradient variance the model predicts (with
    ``one_bit[l]``, when not None, as tensor l's variance at 1 bit)."""
    return sum(_var(c, b, None if one_bit is None else one_bit[i])
               for i, (c, b) in enumerate(zip(score, bits)))


def _var(c: float, b: int, one: Optional[float]) -> float:
    return one if b == 1 and one is not None else c * _v(b)


def convex_one_bit(c: float, one: Optional[float]) -> Optional[float]:
    """A measured 1-bit variance, raised where needed so that the step 2 -> 1 costs at least
    as much per bit as the step 4 -> 2 (the greedy's keys then increase along each chain,
    which its optimality needs): ``max(one, C v(2) + C (v(2) - v(4)) / 2)``."""
    if one is None:
        return None
    return max(float(one), c * _v(2) + c * (_v(2) - _v(4)) / 2.0)


def greedy_widths(score: Sequence[float], size: Sequence[float], budget: float,
                  fill: bool = True, one_bit: Optional[Sequence[Optional[float]]] = None
                  ) -> List[int]:
    """GACT's greedy: widths in {1, 2, 4, 8} with ``sum size_l b_l <= budget * sum size_l``.

    ``score``: C_l >= 0; ``size``: n_l > 0 (values of tensor l); ``budget``: the average width
    (clipped to [1, 8]). Start at 8, take steps down by least variance added per bit saved (a
    heap) until the budget holds; with ``fill``, spend what the last step left on upgrades
    that fit, best gain per bit first. Without ``fill`` the result is optimal among all
    allocations that spend at most as many bits (module doc); with it, it is no worse.
    ``one_bit``: per tensor its variance at 1 bit where measured (None: ``C_l``, the model's);
    it must keep each chain's keys increasing (:func:`convex_one_bit`).
    Deterministic: ties go to the lower index.
    """
    m = len(score)
    if len(size) != m:
        raise ValueError(f"score has {m} entries, size {len(size)}")
    if one_bit is not None and len(one_bit) != m:
        raise ValueError(f"score has {m} entries, one_bit {len(one_bit)}")
    if m == 0:
        return []
    ones: List[Optional[float]] = list(one_bit) if one_bit is not None else [None] * m
    budget = min(max(float(budget), 1.0), 8.0)
    total = float(sum(size))
    allowed = budget * total * (1.0 + 1e-12)  # float slack: budget 2 must admit all-2
    bits = [8] * m
    spent = 8.0 * total
    heap = [(_step_key(score[i], size[i], 8, ones[i]), i) for i in range(m)]
    heapq.heapify(heap)
    while spent > allowed and heap:
        _, i = heapq.heappop(heap)
        b = bits[i]
        nb = _DOWN[b]
        bits[i] = nb
        spent -= size[i] * (b - nb)
        if nb > 1:
            heapq.heappush(heap, (_step_key(score[i], size[i], nb, ones[i]), i))
    if fill:
        while True:
            best, best_gain = -1, -1.0
            for i in range(m):
                b = bits[i]
                if b == 8:
                    continue
                cost = size[i] * (_UP[b] - b)
                if spent + cost > allowed:
                    continue
                gain = (_var(score[i], b, ones[i]) - _var(score[i], _UP[b], ones[i])) / cost
                if gain > best_gain:
                    best, best_gain = i, gain
            if best < 0:
                break
            b = bits[best]
            spent += size[best] * (_UP[b] - b)
            bits[best] = _UP[b]
    return bits


def _step_key(c: float, n: float, b: int, one: Optional[float] = None) -> float:
    """Variance added per bit saved by the step down from width ``b``."""
    nb = _DOWN[b]
    return (_var(c, nb, one) - _var(c, b, one)) / (n * (b - nb))


@dataclass
class _Estimate:
    """What one probe measured: the free layers probed (execution order), their C_l (0-d
    device tensors), layer index -> the layer that compressed the same tensor first, and the
    layers whose tensor is stored as sparse codes with its nonzero fraction (0-d tensors)."""

    layers: List["_Layer"]
    sensitivity: List[Tensor]
    leaders: Dict[int, int]
    sparse: List["_Layer"]
    density: List[Tensor]
    measured_1bit: List["_Layer"] = dataclasses.field(default_factory=list)
    one_bit: List[Tensor] = dataclasses.field(default_factory=list)  # their variance at 1 bit


def _half_sq(ref: List[Optional[Tensor]], other: List[Optional[Tensor]], idx: Any,
             dev: torch.device) -> Tensor:
    """``||ref - other||^2 / 2`` over the gradients ``idx`` (a 0-d float64 tensor on ``dev``):
    the variance the re-seeded tensors add, for two passes that differ only in their rounding."""
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for j in idx:
        a, b = ref[j], other[j]
        if a is None or b is None:
            continue
        total = total + torch.linalg.vector_norm((a - b).to(torch.float64)).square().to(dev)
    return total / 2.0


def _quadratic(w: "_Layer") -> bool:
    """Norms and softmax: a backward quadratic in the saved tensor (module doc)."""
    return w.kind is not None and w.kind.name in ("norm", "softmax")


def _memory(x: Tensor) -> Optional[Tuple]:
    """The memory ``x`` views (what the capture store keys a shared payload on), or None."""
    try:
        ptr = x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (x.device, ptr, x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)


@dataclass
class _Recording:
    """One training batch kept for the probe: inputs (detached clones, maybe the first
    ``k`` samples) and the gradient that reached each tensor output."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    slice_to: Optional[int]  # samples kept, None: the whole batch
    grads: List[Optional[Tensor]]
    count: int = 0  # tensor outputs
    step: int = 0  # the training step recorded


class _Layer:
    """Hooks and state for one tracked Q-layer (the strategy owns it)."""

    def __init__(self, strategy: "GACTStrategy", index: int, tl: TrackedLayer,
                 kind: Optional[LayerKind]) -> None:
        self.strategy = strategy
        self.index = index
        self.name = tl.name
        self.module = tl.module
        self.kind = kind
        self.pinned_bits = tl.pinned_bits
        self.stats = LayerStats()
        self.qconfig0 = tl.module.qconfig  # restored on detach
        self.width: int = int(tl.module.qconfig.bits)  # type: ignore[attr-defined]
        self.sensitivity: Optional[float] = None  # C_l, host, from the last applied update
        # bytes: the values coded per value of the tensor (its nonzero fraction where it is
        # stored as sparse codes, a ReLU output: mask + codes of the nonzeros), and the
        # layer that compresses the same tensor first in the forward (None: this one), whose
        # payload this layer's save shares; both from the last applied probe
        self.density = 1.0
        self.leader: Optional[int] = None
        self.one_bit: Optional[float] = None  # measured variance at 1 bit (None: the model's)
        self.quantized = False  # the last forward compressed a tensor of this layer
        self._counted: Optional[Tuple[int, bool]] = None  # the forward stats.* belong to

    @property
    def free(self) -> bool:
        return self.kind is not None and self.pinned_bits is None

    def params(self) -> List[nn.Parameter]:
        return [p for p in self.module.parameters(recurse=False) if p.requires_grad]

    def pre_hook(self, module: nn.Module, args: Tuple) -> None:
        """Before the layer runs: the probe's seed; sizes and this layer's width."""
        s = self.strategy
        if s.probing:
            s.seed_layer(self)
            s.open_stream()
        if self.kind is None:
            return
        self.quantized = False
        x = args[0] if args else None
        if not compresses_now(module, x):
            return
        if x.numel() == 0 or not self.kind.compresses(module, x):
            with s.lock:
                self.stats.samples = self.stats.numel = 0
            return
        rows = self.kind.batched(module, x)
        if rows.dim() <= 1:
            return
        n = rows.shape[0]
        # this thread's step (outside a root forward, e.g. on the autograd engine's thread,
        # the last one); a probe pass is its own forward
        step = s.local.step
        key = (s.step if step is None else step, s.probing)
        with s.lock:
            count_call(self.stats, key != self._counted, n, rows.numel() // n)
            self._counted = key
            self.quantized = True

    def set_width(self, width: int) -> None:
        """The layer's width, as its qconfig's ``bits``: an int width, not per-sample widths,
        so its payload has no per-row widths and offsets (9 bytes a row) and a tensor two
        layers save at the same width is compressed once (the capture store shares payloads
        of one memory at one int width, never per-sample ones)."""
        self.width = width
        m = self.module
        if m.qconfig.bits != width:  # type: ignore[attr-defined]
            object.__setattr__(m, "qconfig", dataclasses.replace(m.qconfig, bits=width))
        object.__setattr__(m, "sample_bits", None)
        self.stats.bits = None

    def values(self) -> float:
        """Values the last training forward compressed here, all calls."""
        return float(self.stats.numel * self.stats.samples)

    def post_hook(self, module: nn.Module, args: Tuple, output: object) -> None:
        """After the layer: back to a neutral seed, so what follows is the same in every pass."""
        if self.strategy.probing:
            self.strategy.close_stream()
            self.strategy.seed_layer(self, neutral=True)


class GACTStrategy(PrecisionStrategy):
    """``strategy: gact`` -- per-tensor widths from probed sensitivities (module doc).

    ``probe_samples``: samples of the recorded batch the probe replays (GACT: 8);
    ``estimator``: "hybrid" (2 + 3 L_other passes, the default), "joint" (3 passes) or
    "per_tensor" (GACT's, 1 + L passes);
    ``probe_repeats``: independent probes averaged per update (more passes, less noise).
    """

    name = "gact"

    def __init__(self, config, probe_samples: int = 8, estimator: str = "hybrid",
                 probe_repeats: int = 1) -> None:
        super().__init__(config)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self.budget = float(config.bits)
        self.update_interval = int(config.update_interval)
        self.probe_samples = int(probe_samples)
        self.estimator = estimator
        self.probe_repeats = int(probe_repeats)
        self.step = 0
        self.updates = 0  # allocations applied
        self.probes = 0  # probes run
        self.probe_passes = 0  # forward + backward passes the probes ran, in all
        # a probe's passes are running (their layers are seeded); no other forward of the
        # model runs meanwhile (:meth:`on_model_forward`)
        self.probing = False
        self.layers_: List[_Layer] = []
        self._model: Optional[nn.Module] = None
        # the latest recorded batch whose output gradient arrived, for the next probe; an
        # update step whose probe has not run yet (no such batch then)
        self._recording: Optional[_Recording] = None
        self._probe_due = False
        # root training forwards running now (all threads), and whether one step is probing or
        # applying widths: the others wait (``lock``'s condition)
        self._inflight = 0
        self._exclusive = False
        self._pending: Optional[Tuple[_Estimate, DeferredRead]] = None
        # seed control during a probe: base seed, the layers re-seeded in this pass
        self._seed_base = 0
        self._variant: Set[int] = set()
        self._warned = False
        # the least predicted gain over uniform widths (at an integer budget) that a new
        # allocation must promise to be applied; the last prediction (None: not compared)
        self.min_gain = 0.1
        self.predicted_ratio: Optional[float] = None

    def _new_thread_state(self) -> None:
        super()._new_thread_state()
        self._turn = threading.Condition(self.lock)  # the exclusive steps' turn (see above)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        del state["_turn"]
        state["_inflight"], state["_exclusive"] = 0, False
        return state

    @property
    def _streams(self) -> List[seed_stream]:
        """This thread's open per-layer seed streams (probe only): a stream's context is
        exited on the thread that entered it."""
        streams = self.local.streams
        if streams is None:
            streams = self.local.streams = []
        return streams

    # -- attach / detach ------------------------------------------------------------------
    def attach(self, model: nn.Module, layers: Sequence[TrackedLayer]) -> None:
        super().attach(model, layers)
        self._model = model
        for i, tl in enumerate(self.layers):
            w = _Layer(self, i, tl, layer_kind(tl.module))
            tl.module.sample_bits = None
            if w.kind is not None:
                tl.module.precision_stats = w.stats
            # every Q-layer is seeded during a probe (dropout too: same masks in every pass)
            self._watch(model, tl.module, w.pre_hook, w.post_hook)
            self.layers_.append(w)
        if any(w.kind is not None for w in self.layers_):
            self._keep(model.register_forward_pre_hook(EagerHook(self.on_model_forward),
                                                        prepend=True, with_kwargs=True))
            self._keep(model.register_forward_hook(EagerHook(self.on_model_output)))
            self._keep(model.register_forward_hook(EagerHook(self.on_model_forward_end),
                                                   always_call=True))

    def detach(self) -> None:
        for w in self.layers_:  # the widths the config gave
            object.__setattr__(w.module, "qconfig", w.qconfig0)
        super().detach()
        self.layers_ = []
        self._model = None
        self._recording = None
        self._pending = None

    # -- per step -------------------------------------------------------------------------
    def is_update_step(self, step: int) -> bool:
        """Probes run at step 2, then every ``update_interval`` steps."""
        return step == 2 or (step > 2 and (step - 2) % self.update_interval == 0)

    def on_model_forward(self, model: nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> None:
        """Count training steps; apply a finished probe; probe on update steps (or, when no
        recorded batch had its gradient yet, at the next step that has one); decide whether to
        keep this step's batch. A step that applies or probes runs alone (module doc)."""
        local = self.local
        stack = local.counted
        if stack is None:
            stack = local.counted = []
        if local.probe_pass or not (model.training and torch.is_grad_enabled()):
            stack.append(False)  # a probe's own pass, eval, no_grad: not a step
            return None
        own = sum(stack)  # this thread's forwards running already (a model calling itself)
        with self._turn:
            while self._exclusive:
                self._turn.wait()
            self.step += 1
            step = local.step = self.step
            pending, self._pending = self._pending, None
            if self.is_update_step(step):
                self._probe_due = True
            rec = self._recording if self._probe_due else None
            alone = pending is not None or rec is not None
            if alone:
                self._exclusive = True
                while self._inflight > own:
                    self._turn.wait()
            self._inflight += 1
            stack.append(True)
        if alone:
            try:
                if pending is not None:
                    self._apply(*pending)
                if rec is not None:
                    self.probe(model, rec)
            finally:
                with self._turn:
                    if rec is not None:
                        self._probe_due = False
                        if self._recording is rec:
                            self._recording = None
                    self._exclusive = False
                    self._turn.notify_all()
        record = self.is_update_step(step + 1) or self._probe_due
        local.rec = self._start_recording(args, kwargs, step) if record else None
        return None

    def on_model_forward_end(self, model: nn.Module, args: Tuple, output: object) -> None:
        """The root's forward is over (also when it raised): a step that waits to run alone
        may go on."""
        stack = self.local.counted
        if not stack or not stack.pop():
            return
        with self._turn:
            self._inflight -= 1
            self._turn.notify_all()

    def _start_recording(self, args: Tuple, kwargs: Dict[str, Any],
                         step: int) -> Optional[_Recording]:
        batch = next((a.shape[0] for a in (*args, *kwargs.values())
                      if isinstance(a, Tensor) and a.dim() > 0), None)
        if batch is None:
            return None
        k = self.probe_samples if 0 < self.probe_samples < batch else None
        # references until the output shows whether slicing is consistent; cloned there
        return _Recording(tuple(args), dict(kwargs), k if k is None else batch, [], step=step)

    def on_model_output(self, model: nn.Module, args: Tuple, output: object) -> None:
        """Keep the inputs (cloned) and have the output's gradients recorded."""
        if self.local.probe_pass:
            return
        rec = self.local.rec
        self.local.rec = None
        if rec is None or not (model.training and torch.is_grad_enabled()):
            return
        outs = _tensors(output)
        if outs is None or not outs:
            return
        batch = rec.slice_to  # the batch size, set above when slicing is wanted
        k: Optional[int] = None
        if batch is not None and all(o.dim() > 0 and o.shape[0] == batch for o in outs):
            k = self.probe_samples
        rec.slice_to = k
        rec.args = tuple(_keep(a, batch, k) for a in rec.args)
        rec.kwargs = {n: _keep(a, batch, k) for n, a in rec.kwargs.items()}
        rec.grads = [None] * len(outs)
        rec.count = len(outs)
        for j, o in enumerate(outs):
            if o.requires_grad:
                o.register_hook(_GradSink(self, rec, j, k))

    def offer(self, rec: _Recording) -> None:
        """A recorded batch's output gradient arrived: the next probe may use it (the latest
        step's, when threads record several)."""
        with self.lock:
            if self._recording is None or self._recording.step <= rec.step:
                self._recording = rec

    # -- the probe ------------------------------------------------------------------------
    def seed_layer(self, layer: _Layer, neutral: bool = False) -> None:
        """Seed torch's CPU generator for ``layer`` in the current probe pass."""
        variant = 2 if neutral else (1 if layer.index in self._variant else 0)
        torch.default_generator.manual_seed(self._seed_base + 4 * layer.index + variant)

    def open_stream(self) -> None:
        """Give the layer about to run its own rounding seeds. Inside a capture session every
        compressed tensor takes its seed from the session's stream (one generator read when
        the forward starts, then a counter: ``quant/seeds.py``), so re-seeding torch's
        generator alone changes no rounding; a stream opened here keys on the generator just
        seeded for (probe, layer, variant), and the session's own counter does not advance
        while it is open, so what runs outside the Q-layers draws the same seeds in every
        pass."""
        stream = seed_stream()
        stream.__enter__()
        self._streams.append(stream)

    def close_stream(self) -> None:
        if self._streams:
            self._streams.pop().__exit__(None, None, None)

    def probe(self, model: nn.Module, rec: Optional[_Recording] = None) -> None:
        """Estimate every free tensor's C_l from the recorded batch ``rec`` (default: the
        latest whose gradient arrived; module doc); the values go to the host with one
        non-blocking copy and apply at the next step."""
        if rec is None:
            rec = self._recording
        if rec is None or all(g is None for g in rec.grads):
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return
        buffers = [b.detach().clone() for b in model.buffers()]
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        self.probing = self.local.probe_pass = True
        try:
            with torch.random.fork_rng(devices=devices):
                start = torch.get_rng_state()
                cuda_start = [torch.cuda.get_rng_state(d) for d in devices]
                estimates: List[_Estimate] = []
                for r in range(self.probe_repeats):
                    base = (self.probes * self.probe_repeats + r) * 4 * (len(self.layers_) + 1)
                    self._seed_base = base % (2 ** 62)

                    def run(variant: Set[int]) -> List[Optional[Tensor]]:
                        torch.set_rng_state(start)
                        for d, st in zip(devices, cuda_start):
                            torch.cuda.set_rng_state(st, d)
                        self._variant = variant
                        return self._pass(model, rec, params)
                    estimates.append(self._estimate(run, params))
        finally:
            while self._streams:  # a pass that raised inside a layer left its stream open
                self.close_stream()
            self.probing = self.local.probe_pass = False
            self._variant = set()
            with torch.no_grad():
                for b, v in zip(model.buffers(), buffers):
                    b.copy_(v)
        self.probes += 1
        first = estimates[0] if estimates else None
        if first is None or not first.layers:
            return
        sens = torch.stack([torch.stack(e.sensitivity) for e in estimates]).mean(0)
        # one read for everything: sensitivities, then the sparse tensors' nonzero fractions
        parts = [sens.to(torch.float64).reshape(-1)]
        parts += [d.to(sens.device, torch.float64).reshape(1) for d in first.density]
        if first.one_bit:
            parts.append(torch.stack([torch.stack(e.one_bit) for e in estimates]).mean(0)
                         .to(sens.device, torch.float64).reshape(-1))
        values = torch.cat(parts)
        with self.lock:
            self._pending = (first, DeferredRead(values))

    def _pass(self, model: nn.Module, rec: _Recording, params: List[nn.Parameter]
              ) -> List[Optional[Tensor]]:
        """One forward + backward of the recorded batch with the recorded output gradient."""
        self.probe_passes += 1
        out = model(*rec.args, **rec.kwargs)
        outs = _tensors(out) or []
        pairs = [(o, g) for o, g in zip(outs, rec.grads)
                 if g is not None and o.requires_grad and o.shape == g.shape]
        if not pairs:
            return [None] * len(params)
        grads = torch.autograd.grad([o for o, _ in pairs], params,
                                    grad_outputs=[g for _, g in pairs], allow_unused=True)
        return list(grads)

    def _estimate(self, run, params: List[nn.Parameter]) -> "_Estimate":
        """The free tensors probed, their C_l as 0-d device tensors, and what decides their
        bytes, from passes of ``run``."""
        order: List[int] = []
        seen: Set[int] = set()
        est = _Estimate([], [], {}, [], [])
        # memory of a conv / linear input -> (the tensor, weakly, its first layer); memory of
        # ReLU outputs stored as sparse codes -> the tensor, weakly. The weak reference tells
        # whether the memory still holds that tensor: a compressed layer input is freed after
        # its layer and its memory reused by a later tensor of the same shape.
        first_saver: Dict[Tuple, Tuple["weakref.ref[Tensor]", int]] = {}
        relu_out: Dict[Tuple, "weakref.ref[Tensor]"] = {}

        def note(mod: nn.Module, args: Tuple) -> None:
            i = index.get(id(mod))
            if i is None or i in seen:
                return
            seen.add(i)
            order.append(i)
            w = self.layers_[i]
            x = args[0] if args else None
            if not (w.free and w.quantized and w.kind is not None and w.kind.modelled
                    and isinstance(x, Tensor)) or active_session() is None:
                return  # no capture session, no store: no shared payload, no sparse codes
            key = _memory(x)
            if key is None:
                return
            hit = first_saver.get(key)
            if hit is not None and hit[0]() is not None:
                est.leaders[i] = hit[1]
                return
            first_saver[key] = (weakref.ref(x), i)
            out = relu_out.get(key)
            if out is not None and out() is not None:
                est.sparse.append(w)
                est.density.append((x != 0).sum() / max(1, x.numel()))

        def relu_done(mod: nn.Module, args: Tuple, out: object) -> None:
            slot = vars(mod).get("_zero_codes")  # QReLU's ZeroCodeSlot (_session.py)
            if isinstance(out, Tensor) and slot is not None and getattr(slot, "enabled", False):
                key = _memory(out)
                if key is not None:
                    relu_out[key] = weakref.ref(out)
        index = {id(w.module): w.index for w in self.layers_}
        handles = [w.module.register_forward_pre_hook(note) for w in self.layers_]
        handles += [w.module.register_forward_hook(relu_done) for w in self.layers_
                    if isinstance(w.module, nn.ReLU)]
        try:
            ref = run(set())
        finally:
            for h in handles:
                h.remove()
        probed = [self.layers_[i] for i in order
                  if self.layers_[i].free and self.layers_[i].quantized]
        if not probed:
            return est
        est.layers = probed
        pos = {id(p): j for j, p in enumerate(params)}

        def sq(diff: List[Optional[Tensor]], which: Optional[Sequence[nn.Parameter]]) -> Tensor:
            """||g_ref - g||^2 / 2 over ``which`` (all parameters when None)."""
            idx = range(len(params)) if which is None else [pos[id(p)] for p in which
                                                              if id(p) in pos]
            return _half_sq(ref, diff, idx, params[0].device)

        levels = {w.index: float((1 << w.width) - 1) ** 2 for w in probed}
        out = est.sensitivity
        if self.estimator == "per_tensor":
            for w in probed:
                out.append(sq(run({w.index}), None) * levels[w.index])
            return est
        own = [w for w in probed if w.kind is not None and w.kind.modelled]
        other = [w for w in probed if not (w.kind is not None and w.kind.modelled)]
        res_a = run({w.index for w in own}) if own else None
        if self.estimator == "hybrid":
            for w in probed:
                if w in own:
                    assert res_a is not None
                    out.append(sq(res_a, w.params()) * levels[w.index])
                    continue
                out.append(sq(run({w.index}), None) * levels[w.index])
                if w.width > 1 and not _quadratic(w):  # 1-bit variance: two passes
                    old = w.width
                    w.set_width(1)
                    try:
                        lo0, lo1 = run(set()), run({w.index})
                    finally:
                        w.set_width(old)
                    est.measured_1bit.append(w)
                    est.one_bit.append(_half_sq(lo0, lo1, range(len(params)), params[0].device))
            return est
        res_b = run({w.index for w in other}) if other else None
        # the nearest conv / linear executed before each tensor: its backward consumer
        producer: Dict[int, Optional[_Layer]] = {}
        last: Optional[_Layer] = None
        for i in order:
            w = self.layers_[i]
            producer[i] = last
            if w.kind is not None and w.kind.modelled and w.params():
                last = w
        for w in probed:
            if w in own:
                assert res_a is not None
                out.append(sq(res_a, w.params()) * levels[w.index])
            else:
                assert res_b is not None
                p = producer.get(w.index)
                which = w.params() + (p.params() if p is not None else [])
                out.append(sq(res_b, which if which else None) * levels[w.index])
        return est

    # -- allocation -----------------------------------------------------------------------
    def _apply(self, est: "_Estimate", read: DeferredRead) -> None:
        """Read the probed sensitivities (copied to the host a step ago), solve, set widths."""
        values = read.read()
        m = len(est.layers)
        for w, c in zip(est.layers, values[:m]):
            w.sensitivity = max(c, 0.0)
        k = m + len(est.sparse)
        sparse = {w.index: d for w, d in zip(est.sparse, values[m:k])}
        one_bit = {w.index: max(v, 0.0) for w, v in zip(est.measured_1bit, values[k:])}
        for w in self.layers_:
            w.density = min(max(sparse.get(w.index, 1.0), 0.0), 1.0)
            w.leader = est.leaders.get(w.index)
            w.one_bit = one_bit.get(w.index)
        self.allocate()
        self.updates += 1

    def allocate(self) -> Dict[str, int]:
        """Widths for the free layers from their last sensitivities under the budget (pinned
        layers' bits are taken off it first); returns name -> width.

        The budget is in bytes: what every compressed tensor would cost at ``budget`` bits,
        ``budget * sum_t v_t`` with ``v_t`` the values tensor ``t``'s codes hold (its nonzeros
        for sparse codes; once for a tensor several layers share). The layers sharing a tensor
        are one item of the solve (C summed, one width), so that they keep sharing its payload.
        Per-group metadata does not depend on the width, so it is the same under every
        allocation."""
        seen = [w for w in self.layers_ if w.kind is not None and w.stats.numel > 0]
        items: Dict[int, List[_Layer]] = {}  # item (its first layer) -> layers
        for w in seen:
            lead = w.leader
            if (w.pinned_bits is None and w.sensitivity is not None and lead is not None
                    and self.layers_[lead] in seen and self.layers_[lead].free
                    and self.layers_[lead].sensitivity is not None):
                items.setdefault(lead, []).append(w)
            else:
                items.setdefault(w.index, []).insert(0, w)
        total = pinned = fixed = 0.0
        free: List[List[_Layer]] = []
        for group in items.values():
            head = group[0]
            cost = head.values() * head.density
            total += cost
            if head.pinned_bits is not None:
                pinned += head.pinned_bits * cost
            elif head.sensitivity is None:  # no sensitivity yet: keeps its width, pays for it
                fixed += head.width * cost
            else:
                free.append(group)
        if not free:
            return {}
        free_values = sum(g[0].values() * g[0].density for g in free)
        b_free = (self.budget * total - pinned - fixed) / max(free_values, 1e-30)
        if b_free < 1.0 and not self._warned:
            self._warned = True
            warnings.warn(f"actnn_zoo: layers pinned by rules use more than the {self.budget}-bit "
                          f"budget allows; the other layers get 1 bit, and the average exceeds "
                          f"the budget", UserWarning, stacklevel=2)
        score = [sum(w.sensitivity or 0.0 for w in g) for g in free]
        # norms and softmax go to 1 bit only when nothing else is left to take down
        ones = [math.inf if _quadratic(g[0]) else
                convex_one_bit(c, g[0].one_bit if len(g) == 1 else None)
                for c, g in zip(score, free)]
        sizes = [max(g[0].values() * g[0].density, 1e-30) for g in free]
        widths = greedy_widths(score, sizes, b_free, one_bit=ones)
        self.predicted_ratio = None
        flat = int(self.budget)
        if flat == self.budget and flat in WIDTHS and b_free >= flat * (1 - 1e-12):
            # uniform widths fit too: keep them unless the model predicts a clear gain
            uniform = variance_cost(score, [flat] * len(free), ones)
            if 0 < uniform < math.inf:
                self.predicted_ratio = variance_cost(score, widths, ones) / uniform
                if self.predicted_ratio > 1.0 - self.min_gain:
                    widths = [flat] * len(free)
        for g, b in zip(free, widths):
            for w in g:
                w.set_width(b)
        return {w.name: w.width for g in free for w in g}

    # -- reporting ------------------------------------------------------------------------
    def layer_budgets(self) -> Dict[str, float]:
        """name -> the width each free layer's next forward uses."""
        return {w.name: float(w.width) for w in self.layers_ if w.free}

    def sensitivities(self) -> Dict[str, float]:
        """name -> C_l from the last applied probe (layers probed so far)."""
        return {w.name: w.sensitivity for w in self.layers_
                if w.free and w.sensitivity is not None}

    def report(self) -> Dict[str, Any]:
        """Widths, sensitivities, the average width of the last forward's compressed values
        (over the values their codes hold: nonzeros of sparse codes, a shared tensor once, as
        the budget counts them) and what the probes cost (passes of ``probe_samples``
        samples)."""
        bits = values = 0.0
        for w in self.layers_:
            if w.kind is None or not w.stats.numel or not w.quantized:
                continue
            lead = self.layers_[w.leader] if w.leader is not None else None
            if lead is not None and lead.quantized and lead.width == w.width \
                    and w.pinned_bits is None and lead.pinned_bits is None:
                continue  # the payload its leader saved: counted there
            n = w.values() * w.density
            bits += (w.pinned_bits or w.width) * n
            values += n
        return {"widths": self.layer_budgets(), "sensitivities": self.sensitivities(),
                "predicted_ratio": self.predicted_ratio,
                "average_bits": bits / values if values else float("nan"),
                "probes": self.probes, "probe_passes": self.probe_passes,
                "passes_per_probe": self.probe_passes / self.probes if self.probes else 0.0}


# ----------------------------------------------------------------------------- helpers
def _tensors(output: object) -> Optional[List[Tensor]]:
    """The tensors of a model output: a tensor, or a flat tuple / list / dict of them (other
    entries skipped); None for anything else."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, Tensor)]
    if isinstance(output, Mapping):
        return [o for o in output.values() if isinstance(o, Tensor)]
    return None


def _keep(a: Any, batch: Optional[int], k: Optional[int]) -> Any:
    """A detached clone of a batched input (its first ``k`` samples when ``k``)."""
    if not isinstance(a, Tensor):
        return a
    t = a.detach()
    if k is not None and batch is not None and t.dim() > 0 and t.shape[0] == batch:
        t = t[:k]
    return t.clone()


class _GradSink:
    """Tensor hook storing (the first ``k`` samples of) an output's gradient."""

    def __init__(self, strategy: GACTStrategy, rec: _Recording, j: int,
                 k: Optional[int]) -> None:
        self.strategy, self.rec, self.j, self.k = strategy, rec, j, k

    def __call__(self, grad: Tensor) -> None:
        g = grad.detach()
        self.rec.grads[self.j] = (g[:self.k] if self.k is not None else g).clone()
        self.strategy.offer(self.rec)
