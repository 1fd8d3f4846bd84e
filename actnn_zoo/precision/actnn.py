"""Auto precision in the style of ActNN: ``bits`` is an average budget, spent per layer and per
sample where stochastic-rounding noise would hurt the gradient most.

Sensitivity of sample n of layer l (ActNN, section 4):
``C = factor_l * S_l * R_ln`` with ``R_ln`` the sample's sum of squared group ranges of the
tensor the layer compresses (``stats.range_statistic``), ``S_l`` the squared norm of the layer's
output gradient per sample from an earlier backward, and ``factor_l = fan_l / D_l`` (fan: the
weights each saved value multiplies in the weight gradient over ActNN's 4, e.g. kernel area x
input channels per group / 4 for a conv; D: values per sample). Then ``C / (2^b - 1)^2`` is
proportional to the weight-gradient variance the layer's compression adds; the widths
minimise its sum under the budget.

Two levels, both solved on the tensors' device (``solver``):

* across layers, at step 2 and then every ``update_interval`` steps: the joint problem over
  every (layer, sample) of the last recorded step, each sample weighted by the layer's size,
  gives a real-valued average width per layer. These widths reach the host through one
  non-blocking copy for all layers (``readback.DeferredRead``) and apply from the next step
  on, so nothing waits for the device. Pinned layers (a config rule fixed their width)
  are left out and their cost is taken off the budget first. Only conv / linear layers take
  part (``LayerKind.modelled``): their noise reaches only their own weight gradient and C
  predicts it within 2-3x (measured on a ResNet); norms, smooth activations and softmax
  put their noise into the input gradient, where it propagates through every earlier layer.
  ActNN's factor for them (BatchNorm: channels / D) mis-ranked them by up to ~30x on the same
  ResNet: it sent BatchNorm inputs to 1 bit and, after 5 training steps, the weight-gradient
  variance at a 2-bit average was 1.8x that of uniform 2 bits (development measurements). So
  they get the plain budget. Until the first re-allocation applies (steps 1 and 2) every free
  layer gets the budget itself;
* within a layer, at every training forward: integer widths for the samples of THIS batch
  under that layer's width x batch size (``solver.allocate_samples``), handed to the layer as
  :class:`~actnn_zoo.quant.SampleBits` with that bound, so quantize sizes its buffer without
  reading the widths back. Samples are ranked by ``R_n ** gamma``. ActNN's ``gamma = 1``
  assumes a sample's gradient does not depend on its range; in a classifier in training it
  falls with it (confident samples: wide activations, tiny gradients), so gamma is refitted
  from the last recorded step (``_Watched.calibrate``).

The realised average over all compressed values is then at most the budget: the Q-layers'
and what the capture tiers compress (``capture_bits``), whose values of the last captured
forward are counted at the tiers' width like a pinned layer's (``_capture_load``; a model
whose tiers save at 4 bits under a 3-bit budget leaves its free layers less than 3), and the
dropout outputs tier 3 keeps as their input's payload (``CompressedStore.derive``) at 0 bits:
saved values that cost no byte of their own, whose budget goes to the free layers. Exception:
until the first re-allocation applies (steps 1 and 2) every free layer uses the budget itself,
so pinned layers and tiers wider than the budget are not yet compensated.

A layer called several times in one forward (weight sharing, a recurrent cell) saves one
compressed tensor per call, so every call counts: the layer's statistics of a step are those of
all its calls in the root's training forward (rows stacked in call order, ``LayerStats.calls``
and ``.values``), the re-allocation weighs the layer by all the values it saved, and each
call's output gradient is recorded against that call's rows. Each call then spends the layer's
width on its own batch. Calls outside the root's training forward (a checkpoint's
recomputation in backward) get widths the same way but are not recorded: the step already
counted them.

Hooks: a forward pre-hook on the model root counts steps and re-allocates across layers; on
each watched Q-layer a forward pre-hook computes the statistic and sets ``sample_bits``, and a
forward hook puts a tensor hook on the output that records the output gradient's per-sample
norms during backward (only on steps whose statistics the next re-allocation reads; a pinned
layer's pre-hook, which only counts its values, runs on those steps alone). Every
hook is a bound method of an object owned by this strategy, so ``copy.deepcopy(model)`` gives
an independent copy. A forward hook on the root (``always_call``) marks the end of its
forward. State lives on the strategy (``model.actnn_zoo_precision``) and on the layers
(``module.precision_stats``); none is global.

Threads running one model (``base``'s module doc): each root training forward is a step of
its own (:class:`_Forward`, kept per thread), a layer's pre-hook hands its forward the widths
of its own batch through the thread's slot, and a layer's record of the step (its calls and
``stats``) changes only under the strategy's lock, as a whole: a call of another step starts
the record afresh, so it always holds the calls of one forward and the re-allocation (under
the same lock) reads rows, widths and gradients that belong together.
"""
from __future__ import annotations

import warnings
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._compile import EagerHook
from ..capture.attach import CAPTURE_ATTR, Capture
from ..quant import SampleBits
from ..quant.backend import extension
from .base import (PrecisionStrategy, TrackedLayer, compresses_now, hand_derivative,
                   set_sample_bits)
from .readback import DeferredRead
from .rows import LayoutCache, RowLayout, host_tensor
from .solver import UpgradeTable, allocate_samples, allocate_weighted, extra_bits
from .stats import (LayerKind, LayerStats, chunked_statistic, layer_kind, range_statistic,
                    sample_grad_sq, same_tensor, saved_tensor)

__all__ = ["ActNNStrategy"]

# range_statistic, pow and allocate_widths in one call on the CPU (cpp_ext/bindings.cpp); None
# without the extension or in an older build
_CHOOSE = getattr(extension(), "choose_widths", None)
_CHOOSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_LADDER = (1.0, 2.0, 4.0, 8.0)


def _stack(parts: List[Optional[Tensor]]) -> Optional[Tensor]:
    """The parts concatenated (one part: itself), or None when any is missing."""
    if not parts or any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]


class _Forward:
    """One root training forward, on the thread running it: its step number and whether its
    output gradients are recorded (for the next re-allocation). A plain class: one is made
    per forward, and a dataclass's ``__init__`` costs more."""

    __slots__ = ("step", "record_grads")

    def __init__(self, step: int, record_grads: bool) -> None:
        self.step = step
        self.record_grads = record_grads


class _Call:
    """One recorded call of a watched layer in the current step: the rows it compressed, their
    range statistic and widths, and (``grad_sq``, (samples,)) its output gradient's once it
    arrived. A plain class with slots: one is made per layer call."""

    __slots__ = ("step", "samples", "numel", "range_sq", "bits", "grad_sq")

    def __init__(self, step: int, samples: int, numel: int, range_sq: Optional[Tensor] = None,
                 bits: Optional[Tensor] = None) -> None:
        self.step = step
        self.samples = samples
        self.numel = numel
        self.range_sq = range_sq
        self.bits = bits
        self.grad_sq: Optional[Tensor] = None


class _Watched:
    """Hooks and state for one Q-layer (the strategy owns it; hooks are its bound methods)."""

    def __init__(self, strategy: "ActNNStrategy", name: str, module: nn.Module,
                 kind: LayerKind, pinned_bits: Optional[int]) -> None:
        self.strategy = strategy
        self.name = name
        self.module = module
        self.kind = kind
        self.pinned_bits = pinned_bits
        self.stats = LayerStats()
        self.budget: float = strategy.budget  # average width for the next forwards
        self.fan = 1.0  # op factor x values per sample, from the last forward's shapes
        # gamma of the within-layer sensitivity model E[C_n | R_n] ~ R_n ** gamma (None: 1)
        self.exponent: Optional[Tensor] = None
        # the step's recorded calls, in call order, and the root step they belong to (both
        # changed under the strategy's lock, with ``stats``)
        self.calls: List[_Call] = []
        self._step = -1

    # -- hooks ----------------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: Tuple) -> None:
        """Before the layer runs: record sizes; choose this batch's per-sample widths."""
        # this thread's root training forward; None outside it (a checkpoint's recomputation
        # in backward is not counted again)
        fw: Optional[_Forward] = self.strategy.local.forward
        if self.pinned_bits is not None and (fw is None or not fw.record_grads):
            # A pinned layer's widths are its rule's; its record (the values it saved) is read
            # only by the re-allocation, which reads a recording step's. So it records on those
            # steps alone: GPT-2's default pins 50 layers, ~10 us each a step.
            return
        x = args[0] if args else None
        if not compresses_now(module, x):
            # eval / no_grad: nothing is compressed; keep the last training statistics
            if self.pinned_bits is None:
                set_sample_bits(module, None)
            return
        call = self._choose(module, x, fw)
        if call is not None and fw is not None and fw.record_grads:
            # post_hook has its output gradient measured (an entry a forward that raised
            # left behind is of an older step: grad_hook ignores it)
            self.strategy.running()[self] = call

    def _record(self, fw: Optional[_Forward], call: Optional[_Call],
                fan: Optional[float] = None) -> None:
        """Add ``call`` to the step's record (a call of another step starts it afresh) and
        summarise, under the lock: the re-allocation never sees half of it."""
        if fw is None:
            return
        with self.strategy.lock:
            if self._step != fw.step:
                # The first call in a root training forward: this step's totals start from
                # zero (the re-allocation has read the last step's in the root's pre-hook
                # already). The last recorded gradients are kept unless this step records new
                # ones. (Written here, not as a method: most layers run once a step, so every
                # call came here, one Python frame each.)
                self._step = fw.step
                self.calls = []
                st = self.stats
                st.samples = st.numel = st.values = st.calls = 0
                st.bits = None
                if fw.record_grads:  # this step's gradients replace the last recorded ones
                    st.sample_grad_sq = st.grad_sq = None
            if call is not None:
                self.calls.append(call)
            if fan is not None:
                self.fan = fan
            self._summarise()

    def _choose(self, module: nn.Module, x: Tensor, fw: Optional[_Forward]) -> Optional[_Call]:
        """Set this call's widths (this thread's); returns the recorded call whose output
        gradient the step wants, else None."""
        kind = self.kind
        if x.numel() == 0 or not kind.compresses(module, x):
            self._record(fw, None)
            self._clear(module)
            return None
        rows = x if kind.batched is same_tensor else kind.batched(module, x)
        if rows.dim() <= 1:  # one row; the layer uses qconfig.bits (<= the budget)
            self._record(fw, None)
            self._clear(module)
            return None
        n = rows.shape[0]
        # recorded in the root's training forward only
        call = _Call(fw.step, n, rows.numel() // n) if fw is not None else None
        if self.pinned_bits is not None:
            self._record(fw, call)
            return None
        budget = self.budget
        if not kind.modelled and budget in _LADDER:
            # No sensitivity model, and the plain budget is a width: every sample gets it.
            width = int(budget)
            if width == module.qconfig.bits:  # type: ignore[attr-defined]
                set_sample_bits(module, None)
            else:
                full = torch.full((n,), width, dtype=torch.uint8, device=x.device)
                set_sample_bits(module, SampleBits(full, width * n))
                if call is not None:
                    call.bits = full
            self._record(fw, call)
            return None
        fan = kind.fan(module, rows)
        group_size = module.qconfig.group_size  # type: ignore[attr-defined]
        extra = extra_bits(budget, n)  # host number: budget is a host float
        # The tensor the layer compresses, made whole (None: the layer's Function makes it in
        # chunks). f'(x), softmax(x), a norm's normalised input are not part of the model's
        # graph; conv and linear inputs need no no_grad context (~10 Python calls): the kernels
        # read their input detached.
        if kind.saved is same_tensor:
            saved, made = rows, None
        else:
            with torch.no_grad():
                saved, made = saved_tensor(kind, module, rows)
        if (saved is not None and _CHOOSE is not None and saved.is_cpu
                and saved.dtype in _CHOOSE_DTYPES and saved.is_contiguous()
                and not isinstance(extra, Tensor)):
            # the three steps below in one compiled call (the statistic, its power, the widths)
            score, bits = _CHOOSE(saved, group_size, self.exponent, extra)
        else:
            if saved is None:  # made in chunks, as the Function makes it
                with torch.no_grad():
                    score = chunked_statistic(module, rows, group_size)
            else:
                score = range_statistic(saved, group_size)
            exponent = self.exponent
            expected = score if exponent is None else score.pow(exponent)
            bits = allocate_samples(expected, budget, self.strategy.table(score.device), extra)
        if made is not None:  # f'(x): the layer uses it, not a second one
            hand_derivative(module, x, made)
        if call is not None:
            call.range_sq, call.bits = score, bits
        self._record(fw, call, fan)
        set_sample_bits(module, SampleBits.made(bits, n + int(extra)))
        return call

    def _summarise(self) -> None:
        """``stats`` = this step's calls together (rows stacked in call order). One call: its
        tensors as they are; several: concatenated (small (samples,) tensors, no host read)."""
        calls, st = self.calls, self.stats
        if len(calls) == 1:  # most layers run once a step: no sums, no concatenation
            c = calls[0]
            st.calls, st.samples, st.numel = 1, c.samples, c.numel if c.samples else 0
            st.values = c.samples * c.numel
            st.range_sq, st.bits = c.range_sq, c.bits
            return
        st.calls = len(calls)
        st.samples = sum(c.samples for c in calls)
        st.values = sum(c.samples * c.numel for c in calls)
        # values per row; exact unless calls differ in row size (then numel * samples is the
        # floor of ``values``, which is what the re-allocation uses)
        st.numel = st.values // st.samples if st.samples else 0
        st.range_sq = _stack([c.range_sq for c in calls]) if calls else st.range_sq
        st.bits = _stack([c.bits for c in calls])

    def post_hook(self, module: nn.Module, args: Tuple, output: object) -> None:
        """After the layer runs: have the output's gradient measured, when it will be read."""
        running = self.strategy.local.running
        call = running.pop(self, None) if running else None
        if call is not None and isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(partial(self.grad_hook, call))

    def grad_hook(self, call: _Call, grad: Tensor) -> None:
        """One call's output gradient; once every call of the step has one, the layer's."""
        if call.step != self._step:
            return  # a gradient of an earlier step (a retained graph run again)
        grad_sq = sample_grad_sq(grad, call.samples)
        with self.strategy.lock:
            if call.step != self._step or not any(c is call for c in self.calls):
                return  # or of a step another thread's forward has replaced since
            call.grad_sq = grad_sq
            per_sample = _stack([c.grad_sq for c in self.calls])
            if per_sample is not None:
                self.stats.sample_grad_sq = per_sample
                self.stats.grad_sq = per_sample.mean()

    def _clear(self, module: nn.Module) -> None:
        """A call that compresses nothing: neither widths nor a recorded call."""
        if self.pinned_bits is None:
            set_sample_bits(module, None)

    # -- sensitivity ----------------------------------------------------------------------
    def factor(self) -> float:
        """The op factor fan / D of the last forward (host float, from shapes)."""
        return self.fan / max(self.stats.numel, 1)

    def fits(self) -> bool:
        """Whether the last recorded step left matching statistics to calibrate on: a range
        and an output gradient for each row."""
        st = self.stats
        return (st.range_sq is not None and st.sample_grad_sq is not None
                and st.range_sq.shape == st.sample_grad_sq.shape)

    def calibrate(self, device: torch.device) -> Optional[Tensor]:
        """float64 (N,) sensitivities C_n of the last recorded step's samples, and refit the
        exponent the within-layer allocation uses; None without matching statistics.
        :func:`calibrate_layers` for this layer alone (the strategy calibrates all at once)."""
        if not self.fits():
            return None
        layout = self.strategy.layouts.get(self.stats.range_sq.shape[:1], device)
        return calibrate_layers([self], layout)


def calibrate_layers(layers: Sequence[_Watched], layout: RowLayout) -> Tensor:
    """float64 (M,): every sample's sensitivity C_n, the layers' rows stacked in order (their
    sizes ``layout.sizes``, on its device), and each layer's refitted exponent (``exponent``).
    Each layer must fit (:meth:`_Watched.fits`). A fixed number of tensor ops for any number
    of layers (:mod:`~actnn_zoo.precision.rows`).

    C_n = factor * R_n * S with one S per layer (ActNN) assumes a sample's gradient does not
    depend on its range. In a trained classifier it does, inversely: confident samples have
    wide activations and tiny gradients. So fit log g_n^2 = a + beta log R_n on the last step's
    samples of each layer (g_n^2: that sample's squared output gradient) and rank the next
    batch by E[R_n g_n^2 | R_n] ~ R_n ** gamma, gamma = 1 + beta clipped to [0, 1] (a wider
    sample never gets fewer bits). Each layer's total sensitivity keeps its measured value,
    factor * sum_n R_n g_n^2.
    """
    device = layout.layer.device
    r = _stacked([w.stats.range_sq for w in layers], device)  # type: ignore[misc]
    g = _stacked([w.stats.sample_grad_sq for w in layers], device)  # type: ignore[misc]
    lr, lg = r.clamp_min(1e-30).log(), g.clamp_min(1e-30).log()
    lr = lr - layout.spread(layout.mean(lr))
    lg = lg - layout.spread(layout.mean(lg))
    beta = layout.mean(lr * lg) / layout.mean(lr * lr).clamp_min(1e-6)
    gamma = (1.0 + beta).clamp(0.0, 1.0)
    expected = r.pow(layout.spread(gamma))
    factors = host_tensor([w.factor() for w in layers], torch.float64, device)
    total = layout.sum(r * g) * factors
    exponents = gamma.to(torch.float32).unbind()
    for w, e in zip(layers, exponents):
        home = w.stats.range_sq.device  # type: ignore[union-attr]
        w.exponent = e if home == device else e.to(home)
    return expected * layout.spread(total / layout.sum(expected).clamp_min(1e-300))


def _stacked(parts: List[Tensor], device: torch.device) -> Tensor:
    """The parts, float64, concatenated on ``device`` (one copy when they are all there)."""
    if all(p.device == device for p in parts):
        return torch.cat(parts).to(torch.float64)
    return torch.cat([p.to(device, torch.float64) for p in parts])


class ActNNStrategy(PrecisionStrategy):
    """``strategy: actnn`` -- per-layer and per-sample widths from gradients (module doc)."""

    name = "actnn"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.budget = float(config.bits)
        self.update_interval = int(config.update_interval)
        self.step = 0  # training forwards of the model root seen so far
        self.updates = 0  # re-allocations applied so far
        # whether the last root training forward recorded its gradients (each thread's own
        # forward decides for itself: ``local.forward``)
        self.record_grads = True
        # a re-allocation on its way to the host: (budget of the free layers, the layers of
        # the joint solve, their widths to read at the next step)
        self._pending: Optional[Tuple[float, List[_Watched], Optional[DeferredRead]]] = None
        self.watched: List[_Watched] = []
        self._warned = False
        self._tables: Dict[Tuple[torch.device, torch.dtype], UpgradeTable] = {}
        self.layouts = LayoutCache()  # the re-allocation's row layouts (rows.py)
        self._root: Optional[nn.Module] = None  # the converted root (its capture tiers)

    def table(self, device: torch.device, dtype: torch.dtype = torch.float32) -> UpgradeTable:
        """Solver constants on ``device``, built once for all layers (no host copy per step)."""
        t = self._tables.get((device, dtype))
        if t is None:
            t = self._tables[device, dtype] = UpgradeTable.build(device, dtype)
        return t

    # -- attach / detach ------------------------------------------------------------------
    def attach(self, model: nn.Module, layers: Sequence[TrackedLayer]) -> None:
        super().attach(model, layers)
        self._root = model
        for tl in self.layers:
            kind = layer_kind(tl.module)
            if kind is None:
                continue
            w = _Watched(self, tl.name, tl.module, kind, tl.pinned_bits)
            tl.module.precision_stats = w.stats
            tl.module.sample_bits = None
            self.own_widths(tl.module)
            self._watch(model, tl.module, w.pre_hook,
                        w.post_hook if tl.pinned_bits is None else None)
            self.watched.append(w)
        if self.watched:  # prepended: runs before a watched root layer's own pre-hook
            self._keep(model.register_forward_pre_hook(EagerHook(self.on_model_forward),
                                                        prepend=True))
            self._keep(model.register_forward_hook(EagerHook(self.on_model_forward_end),
                                                   always_call=True))

    def detach(self) -> None:
        super().detach()
        self.watched = []
        self._root = None
        self._pending = None

    # -- per step -------------------------------------------------------------------------
    def on_model_forward(self, model: nn.Module, args: Tuple) -> None:
        """Count training steps; apply the last re-allocation; re-allocate across layers at
        step 2 and every ``update_interval`` steps after (applied at the next step); ask for
        gradient statistics on the steps before those."""
        if not (model.training and torch.is_grad_enabled()):
            return
        k = self.update_interval
        with self.lock:
            step = self._count_step()
            if step == 2 or (step > 1 and (step - 1) % k == 0):
                self.reallocate()
            record = self.record_grads = step == 1 or step % k == 0
        self.local.forward = _Forward(step, record)

    def on_model_forward_end(self, model: nn.Module, args: Tuple, output: object) -> None:
        """The root's forward is over (also when it raised): later layer calls on this thread,
        such as a checkpoint's recomputation in backward, are not counted as more saved
        tensors."""
        self.local.forward = None

    @property
    def in_forward(self) -> bool:
        """A root training forward is running on this thread (its layer calls count)."""
        return self.local.forward is not None

    def _capture_load(self) -> Tuple[float, int, float]:
        """(values, width) the capture tiers compressed in the root's last captured forward,
        and the values they kept at no cost of their own (derived dropout outputs); (0, 0, 0)
        without capture or before its first forward. Values are the tensors' bytes / 4 (fp32);
        a tensor in a narrower dtype is over-counted, which only lowers the free layers' share
        when the tiers are wider than the budget (and a derived one's raises it a little)."""
        capture = vars(self._root).get(CAPTURE_ATTR) if self._root is not None else None
        if not isinstance(capture, Capture) or capture.last_stats is None:
            return 0.0, 0, 0.0
        stats = capture.last_stats
        return (stats.compressed_bytes / 4.0, int(capture.qconfig.bits),
                stats.derived_bytes / 4.0)

    def reallocate(self) -> None:
        """Per-layer average widths from the statistics of the last forward / backward; they
        apply from the next training step (:meth:`on_model_forward`). Under the lock."""
        # every call of a layer saved its own tensor: stats.values counts them all
        seen = [w for w in self.watched if w.stats.values > 0]
        free = [w for w in seen if w.pinned_bits is None]
        cap_values, cap_bits, derived_values = self._capture_load()
        free_values = sum(w.stats.values for w in free)
        if not free_values:
            return
        # what the pinned layers and the capture tiers spend above (or below) the budget; the
        # free layers make up for it. Written as an excess, b_free is exactly the budget when
        # nothing is pinned and the tiers use the budget's width (the CNN default: 2 and 2).
        excess = sum((w.pinned_bits - self.budget) * w.stats.values
                     for w in seen if w.pinned_bits is not None)
        if cap_values:
            excess += (cap_bits - self.budget) * cap_values
        excess -= self.budget * derived_values  # saved at 0 bits of their own
        b_free = self.budget - excess / free_values
        if b_free < 1.0 and not self._warned:
            self._warned = True
            warnings.warn(f"actnn_zoo: layers pinned by rules and the capture tiers "
                          f"(capture_bits) use more than the {self.budget}-bit budget allows; "
                          f"the other layers get 1 bit, and the average exceeds the budget",
                          UserWarning, stacklevel=2)
        b_free = min(max(b_free, 1.0), 8.0)
        ready = [w for w in free if w.stats.grad_sq is not None and w.stats.range_sq is not None
                 and w.stats.range_sq.shape[0] == w.stats.samples]
        joint = [w for w in ready if w.kind.modelled]
        read = None
        device = ready[0].stats.range_sq.device if ready else None  # type: ignore[union-attr]
        scores = self._scores(ready, joint, device) if ready else None
        if scores is not None:
            # each row weighs the values its call saved; a layer's width is the average over
            # all the values it saved (all its calls)
            calls = [c for w in joint for c in w.calls]
            by_call = self.layouts.get([c.samples for c in calls], device)
            weight = by_call.spread(host_tensor([float(c.numel) for c in calls],
                                                torch.float64, device))
            widths = allocate_weighted(scores, weight, b_free, self.table(device, torch.float64))
            layers = self.layouts.get([w.stats.samples for w in joint], device)
            read = DeferredRead(layers.sum(widths * weight) / layers.sum(weight))
        self._pending = (b_free, joint, read)

    def _scores(self, ready: List[_Watched], joint: List[_Watched], device: torch.device
                ) -> Optional[Tensor]:
        """float64: the ``joint`` layers' per-sample sensitivities, stacked in order, on
        ``device`` (None without joint layers). Every ``ready`` layer with matching statistics
        refits its exponent on the way, all at once (one outside the joint solve uses its own
        when its budget is not a width)."""
        fitted = [w for w in ready if w.fits()]
        fits: Dict[int, Tensor] = {}
        if fitted:
            layout = self.layouts.get([w.stats.samples for w in fitted], device)
            c_all = calibrate_layers(fitted, layout)
            if joint == fitted:  # the common case: every joint layer fitted, nothing else
                return c_all
            fits = {id(w): c for w, c in zip(fitted, c_all.split(layout.sizes))}
        if not joint:
            return None
        scores = []
        for w in joint:
            c = fits.get(id(w))
            if c is None:  # no per-sample gradients: ActNN's C = factor * R_n * S
                r = w.stats.range_sq.to(device, torch.float64)  # type: ignore[union-attr]
                c = r * (w.stats.grad_sq.to(device, torch.float64)  # type: ignore[union-attr]
                         * w.factor())
            scores.append(c)
        return torch.cat(scores)

    def _apply(self, b_free: float, joint: List[_Watched],
               widths: Optional[DeferredRead]) -> None:
        """Set the budgets a re-allocation chose: ``b_free`` for every free layer, the solved
        widths for the ``joint`` ones."""
        for w in self.watched:
            if w.pinned_bits is None:
                w.budget = b_free
        if widths is not None:
            for w, b in zip(joint, widths.read()):
                w.budget = min(max(b, 1.0), 8.0)
        self.updates += 1

    def layer_budgets(self) -> Dict[str, float]:
        """name -> the average width each free layer's next forward may use."""
        return {w.name: w.budget for w in self.watched if w.pinned_bits is None}
