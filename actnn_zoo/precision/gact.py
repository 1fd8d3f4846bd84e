"""``strategy: gact`` -- one width per saved tensor from measured gradient-variance
sensitivities, in the style of GACT (Liu et al., ICML 2022).

Model (GACT, section 4). Compressing the tensor saved by Q-layer l at b bits adds about
``C_l / (2^b - 1)^2`` to the variance of the whole parameter gradient, the terms of different
tensors adding up (independent stochastic rounding). The widths ``b_l`` in {1, 2, 4, 8}
minimise ``sum_l C_l / (2^b_l - 1)^2`` subject to ``sum_l n_l b_l <= bits * sum_l n_l``
(``n_l``: values the tensor holds, so the budget is the average width over all compressed
values). 8 is the top: a Q-layer has no "keep it uncompressed" width.

Solver (:func:`greedy_widths`, GACT's): everyone starts at 8 bits; a heap holds each tensor's
next step down (8 -> 4 -> 2 -> 1) keyed by the variance it adds per bit it saves,
``C (v(b') - v(b)) / (n (b - b'))`` with ``v(b) = 1 / (2^b - 1)^2``; the cheapest step is taken
until the budget holds. Per tensor these keys increase along the chain (0.0011 C/n, 0.053 C/n,
0.89 C/n per bit), so the steps are taken in globally increasing key order and the result is a
Lagrangian optimum: exactly optimal among all allocations spending at most what it spends
(tested against brute force). The last step may overshoot the budget; the bits left are then
given back by upgrades that still fit, best gain per bit first.

Estimator of C_l (ours; GACT needs per tensor l a few extra forward + backward passes with only
tensor l compressed, on an 8-sample sub-batch every 1000 steps: hundreds of passes on BERT).
The probe replays the last recorded training batch (its first ``probe_samples`` samples, with
the gradient the loss sent into the model's output, so the loss need not be known) and controls
the stochastic-rounding seed of every Q-layer separately: a forward pre-hook seeds torch's CPU
generator from (probe, layer, variant) right before the layer quantizes, a forward hook
re-seeds it to a neutral value after it. Two passes that differ only in the variant of some
layers differ only in those layers' rounding; dropout modules, what tier 3 compresses and
everything else random are identical. A weight gradient is linear in each saved tensor, so the
difference ``g1 - g2`` is a draw of the difference of two independent noises:
``E ||g1 - g2||^2 / 2 = Var`` of what the re-seeded tensors add. Three passes on the sub-batch
per update (``estimator="joint"``):

* R: reference seeds;
* A: every free conv / linear tensor re-seeded. Their noise enters only their own weight
  gradient (the input gradient ``W^T g_y`` does not read the saved input, and the output
  gradient is the same in R and A), so ``||(g_R - g_A)[W_l]||^2 / 2`` is, exactly in
  expectation, tensor l's variance: all of them from one pass;
* B: every other free tensor re-seeded (norms, smooth activations, softmax). Their noise enters
  the input gradient and every earlier parameter; we attribute to tensor l the variance of the
  parameters of the layer that consumes it in backward: its own parameters (a norm's affine
  weight) and those of the nearest conv / linear executed before it (whose weight gradient is
  linear in the gradient that tensor produces). This is an approximation: it misses the part
  that travels further up and counts noise that deeper tensors sent through the same layer.

Then ``C_l = Var_l * (2^b_l - 1)^2`` at the width ``b_l`` the probe used. Cost per update:
3 forward + 3 backward passes of ``probe_samples`` samples, whatever the number of tensors.
``estimator="per_tensor"`` is GACT's estimator with the same seed control (the reference pass
plus one pass per free tensor re-seeding only it, the variance summed over every parameter):
``1 + L`` passes, exact up to sampling noise; ``scripts/bench_strategies.py`` compares the two.

Schedule: the batch of step ``t - 1`` is recorded when step ``t`` is an update step (step 2,
then every ``update_interval`` steps); the probe runs in the model's forward pre-hook of step
``t`` (before its forward, outside any backward), leaves the training RNG stream, the
parameters' ``.grad`` and the BatchNorm running statistics as they were, and sends its
sensitivities to the host with one non-blocking copy (``readback.DeferredRead``). Step ``t + 1``
reads them, solves on the host and applies the widths. Nothing reads the device per step.
Until the first update applies every free layer uses the config's width (``qconfig.bits``).

Limits: the model's output must be a tensor or a flat tuple / list / dict of tensors (else no
probe runs and the widths stay uniform); randomness outside torch's CPU generator or the
Q-layers' control (functional dropout on CUDA) adds to the estimate; the probe's forwards run
the model's other forward hooks too. Pinned layers keep their width and their cost is taken
off the budget.
"""
from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from .._compile import EagerHook
from ..quant import SampleBits
from ..quant.seeds import seed_stream
from .base import PrecisionStrategy, TrackedLayer
from .readback import DeferredRead
from .stats import LayerKind, LayerStats, count_call, layer_kind, set_width

__all__ = ["GACTStrategy", "greedy_widths", "variance_cost", "ESTIMATORS"]

WIDTHS: Tuple[int, ...] = (1, 2, 4, 8)
ESTIMATORS: Tuple[str, ...] = ("joint", "per_tensor")
_DOWN = {8: 4, 4: 2, 2: 1}
_UP = {1: 2, 2: 4, 4: 8}


def _v(b: int) -> float:
    return 1.0 / float((1 << b) - 1) ** 2


def variance_cost(score: Sequence[float], bits: Sequence[int]) -> float:
    """``sum C_l / (2^b_l - 1)^2``: the gradient variance the model predicts."""
    return sum(c * _v(b) for c, b in zip(score, bits))


def greedy_widths(score: Sequence[float], size: Sequence[float], budget: float,
                  fill: bool = True) -> List[int]:
    """GACT's greedy: widths in {1, 2, 4, 8} with ``sum size_l b_l <= budget * sum size_l``.

    ``score``: C_l >= 0; ``size``: n_l > 0 (values of tensor l); ``budget``: the average width
    (clipped to [1, 8]). Start at 8, take steps down by least variance added per bit saved (a
    heap) until the budget holds; with ``fill``, spend what the last step left on upgrades
    that fit, best gain per bit first. Without ``fill`` the result is optimal among all
    allocations that spend at most as many bits (module doc); with it, it is no worse.
    Deterministic: ties go to the lower index.
    """
    m = len(score)
    if len(size) != m:
        raise ValueError(f"score has {m} entries, size {len(size)}")
    if m == 0:
        return []
    budget = min(max(float(budget), 1.0), 8.0)
    total = float(sum(size))
    allowed = budget * total * (1.0 + 1e-12)  # float slack: budget 2 must admit all-2
    bits = [8] * m
    spent = 8.0 * total
    heap = [(_step_key(score[i], size[i], 8), i) for i in range(m)]
    heapq.heapify(heap)
    while spent > allowed and heap:
        _, i = heapq.heappop(heap)
        b = bits[i]
        nb = _DOWN[b]
        bits[i] = nb
        spent -= size[i] * (b - nb)
        if nb > 1:
            heapq.heappush(heap, (_step_key(score[i], size[i], nb), i))
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
                gain = score[i] * (_v(b) - _v(_UP[b])) / cost
                if gain > best_gain:
                    best, best_gain = i, gain
            if best < 0:
                break
            b = bits[best]
            spent += size[best] * (_UP[b] - b)
            bits[best] = _UP[b]
    return bits


def _step_key(c: float, n: float, b: int) -> float:
    """Variance added per bit saved by the step down from width ``b``."""
    nb = _DOWN[b]
    return c * (_v(nb) - _v(b)) / (n * (b - nb))


@dataclass
class _Recording:
    """One training batch kept for the probe: inputs (detached clones, maybe the first
    ``k`` samples) and the gradient that reached each tensor output."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    slice_to: Optional[int]  # samples kept, None: the whole batch
    grads: List[Optional[Tensor]]
    count: int = 0  # tensor outputs


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
        self.width: int = int(tl.module.qconfig.bits)  # type: ignore[attr-defined]
        self.sensitivity: Optional[float] = None  # C_l, host, from the last applied update
        self._full: Optional[SampleBits] = None  # cached uniform widths for this batch size
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
        if not isinstance(x, Tensor) or not module.quantizing():  # type: ignore[attr-defined]
            return
        if x.numel() == 0 or not self.kind.compresses(module, x):
            self.stats.samples = self.stats.numel = 0
            return
        rows = self.kind.batched(module, x)
        if rows.dim() <= 1:
            return
        n = rows.shape[0]
        key = (s.step, s.probing)  # a probe pass is its own forward
        count_call(self.stats, key != self._counted, n, rows.numel() // n)
        self._counted = key
        self.quantized = True
        if self.pinned_bits is not None:
            return
        self._full = set_width(module, self.stats, self.width, n, x.device, self._full)

    def post_hook(self, module: nn.Module, args: Tuple, output: object) -> None:
        """After the layer: back to a neutral seed, so what follows is the same in every pass."""
        if self.strategy.probing:
            self.strategy.close_stream()
            self.strategy.seed_layer(self, neutral=True)


class GACTStrategy(PrecisionStrategy):
    """``strategy: gact`` -- per-tensor widths from probed sensitivities (module doc).

    ``probe_samples``: samples of the recorded batch the probe replays (GACT: 8);
    ``estimator``: "joint" (3 passes) or "per_tensor" (GACT's, 1 + L passes);
    ``probe_repeats``: independent probes averaged per update (more passes, less noise).
    """

    name = "gact"

    def __init__(self, config, probe_samples: int = 8, estimator: str = "joint",
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
        self.probing = False
        self.layers_: List[_Layer] = []
        self._model: Optional[nn.Module] = None
        self._record_next = False  # this step's batch is kept for the next step's probe
        self._recording: Optional[_Recording] = None
        self._pending: Optional[Tuple[List[_Layer], DeferredRead]] = None
        # seed control during a probe: base seed, the layers re-seeded in this pass
        self._seed_base = 0
        self._variant: Set[int] = set()
        self._streams: List[seed_stream] = []  # open per-layer seed streams (probe only)
        self._warned = False

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
            self._keep(tl.module.register_forward_pre_hook(EagerHook(w.pre_hook)))
            self._keep(tl.module.register_forward_hook(EagerHook(w.post_hook)))
            self.layers_.append(w)
        if any(w.kind is not None for w in self.layers_):
            self._keep(model.register_forward_pre_hook(EagerHook(self.on_model_forward),
                                                        prepend=True, with_kwargs=True))
            self._keep(model.register_forward_hook(EagerHook(self.on_model_output)))

    def detach(self) -> None:
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
        """Count training steps; apply a finished probe; probe on update steps; decide whether
        to keep this step's batch."""
        if self.probing or not (model.training and torch.is_grad_enabled()):
            return None
        self.step += 1
        if self._pending is not None:
            self._apply(*self._pending)
            self._pending = None
        if self.is_update_step(self.step) and self._recording is not None:
            self.probe(model)
        self._recording = None
        self._record_next = self.is_update_step(self.step + 1)
        if self._record_next:
            self._recording = self._start_recording(args, kwargs)
        return None

    def _start_recording(self, args: Tuple, kwargs: Dict[str, Any]) -> Optional[_Recording]:
        batch = next((a.shape[0] for a in (*args, *kwargs.values())
                      if isinstance(a, Tensor) and a.dim() > 0), None)
        if batch is None:
            return None
        k = self.probe_samples if 0 < self.probe_samples < batch else None
        # references until the output shows whether slicing is consistent; cloned there
        return _Recording(tuple(args), dict(kwargs), k if k is None else batch, [])

    def on_model_output(self, model: nn.Module, args: Tuple, output: object) -> None:
        """Keep the inputs (cloned) and have the output's gradients recorded."""
        rec = self._recording
        if self.probing or not self._record_next or rec is None:
            return
        if not (model.training and torch.is_grad_enabled()):
            return
        outs = _tensors(output)
        if outs is None or not outs:
            self._recording = None
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
                o.register_hook(_GradSink(rec, j, k))

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

    def probe(self, model: nn.Module) -> None:
        """Estimate every free tensor's C_l from the recorded batch (module doc); the values
        go to the host with one non-blocking copy and apply at the next step."""
        rec = self._recording
        if rec is None or all(g is None for g in rec.grads):
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return
        buffers = [b.detach().clone() for b in model.buffers()]
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        self.probing = True
        try:
            with torch.random.fork_rng(devices=devices):
                start = torch.get_rng_state()
                cuda_start = [torch.cuda.get_rng_state(d) for d in devices]
                estimates: List[Tuple[List[_Layer], List[Tensor]]] = []
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
            self.probing = False
            self._variant = set()
            with torch.no_grad():
                for b, v in zip(model.buffers(), buffers):
                    b.copy_(v)
        self.probes += 1
        layers = estimates[0][0] if estimates else []
        if not layers:
            return
        sens = torch.stack([torch.stack(e[1]) for e in estimates]).mean(0)
        self._pending = (layers, DeferredRead(sens))

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

    def _estimate(self, run, params: List[nn.Parameter]
                  ) -> Tuple[List[_Layer], List[Tensor]]:
        """(free tensors probed, their C_l as 0-d device tensors) from passes of ``run``."""
        order: List[int] = []
        seen: Set[int] = set()

        def note(mod: nn.Module, args: Tuple) -> None:
            i = index.get(id(mod))
            if i is not None and i not in seen:
                seen.add(i)
                order.append(i)
        index = {id(w.module): w.index for w in self.layers_}
        handles = [w.module.register_forward_pre_hook(note) for w in self.layers_]
        try:
            ref = run(set())
        finally:
            for h in handles:
                h.remove()
        probed = [self.layers_[i] for i in order
                  if self.layers_[i].free and self.layers_[i].quantized]
        if not probed:
            return [], []
        pos = {id(p): j for j, p in enumerate(params)}

        def sq(diff: List[Optional[Tensor]], which: Optional[Sequence[nn.Parameter]]) -> Tensor:
            """||g_ref - g||^2 / 2 over ``which`` (all parameters when None)."""
            idx = range(len(params)) if which is None else [pos[id(p)] for p in which
                                                              if id(p) in pos]
            dev = params[0].device
            total = torch.zeros((), dtype=torch.float64, device=dev)
            for j in idx:
                a, b = ref[j], diff[j]
                if a is None or b is None:
                    continue
                total = total + torch.linalg.vector_norm(
                    (a - b).to(torch.float64)).square().to(dev)
            return total / 2.0

        levels = {w.index: float((1 << w.width) - 1) ** 2 for w in probed}
        out: List[Tensor] = []
        if self.estimator == "per_tensor":
            for w in probed:
                out.append(sq(run({w.index}), None) * levels[w.index])
            return probed, out
        own = [w for w in probed if w.kind is not None and w.kind.modelled]
        other = [w for w in probed if not (w.kind is not None and w.kind.modelled)]
        res_a = run({w.index for w in own}) if own else None
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
        return probed, out

    # -- allocation -----------------------------------------------------------------------
    def _apply(self, layers: List[_Layer], read: DeferredRead) -> None:
        """Read the probed sensitivities (copied to the host a step ago), solve, set widths."""
        values = read.read()
        for w, c in zip(layers, values):
            w.sensitivity = max(c, 0.0)
        self.allocate()
        self.updates += 1

    def allocate(self) -> Dict[str, int]:
        """Widths for the free layers from their last sensitivities under the budget (pinned
        layers' bits are taken off it first); returns name -> width."""
        seen = [w for w in self.layers_ if w.kind is not None and w.stats.numel > 0]
        free = [w for w in seen if w.pinned_bits is None and w.sensitivity is not None]
        if not free:
            return {}
        total = sum(w.stats.numel * w.stats.samples for w in seen)
        pinned = sum(w.pinned_bits * w.stats.numel * w.stats.samples
                     for w in seen if w.pinned_bits is not None)
        # layers without a sensitivity yet keep their width and pay for it too
        fixed = sum(w.width * w.stats.numel * w.stats.samples
                    for w in seen if w.pinned_bits is None and w.sensitivity is None)
        free_values = sum(w.stats.numel * w.stats.samples for w in free)
        b_free = (self.budget * total - pinned - fixed) / free_values
        if b_free < 1.0 and not self._warned:
            self._warned = True
            warnings.warn(f"actnn_zoo: layers pinned by rules use more than the {self.budget}-bit "
                          f"budget allows; the other layers get 1 bit, and the average exceeds "
                          f"the budget", UserWarning, stacklevel=2)
        widths = greedy_widths([w.sensitivity or 0.0 for w in free],
                               [float(w.stats.numel * w.stats.samples) for w in free], b_free)
        for w, b in zip(free, widths):
            w.width = b
        return {w.name: w.width for w in free}

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
        and what the probes cost (passes of ``probe_samples`` samples)."""
        bits = values = 0.0
        for w in self.layers_:
            if w.kind is None or not w.stats.numel or not w.quantized:
                continue
            n = w.stats.numel * w.stats.samples
            bits += (w.pinned_bits or w.width) * n
            values += n
        return {"widths": self.layer_budgets(), "sensitivities": self.sensitivities(),
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

    def __init__(self, rec: _Recording, j: int, k: Optional[int]) -> None:
        self.rec, self.j, self.k = rec, j, k

    def __call__(self, grad: Tensor) -> None:
        g = grad.detach()
        self.rec.grads[self.j] = (g[:self.k] if self.k is not None else g).clone()
