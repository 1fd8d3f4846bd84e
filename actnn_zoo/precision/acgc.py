"""``strategy: acgc`` -- widths from a gradient-error bound, in the style of AC-GC (Evans and
Aamodt, NeurIPS 2021): the configured quantity is the error fraction ``e``
(``error_fraction``), and the average width is an outcome (:meth:`ACGCStrategy.report`).

Bound (ours, for stochastic rounding; AC-GC derives the same shape for its rounding). A Q-layer
that saves a tensor s with independent, unbiased rounding noise of variance sigma^2 per value
adds to its gradient an error of expected squared norm

* conv / linear (s = the input, g_W = g_y^T s): ``sigma^2 * fan * ||g_y||^2`` exactly, with
  ``fan`` the weights one input value meets per output channel (input channels per group x
  kernel area; divided by the stride area for transposed convs; ``in_features`` for linear).
  Keeping it within ``e ||g_W||^2`` allows ``sigma^2 <= e ||g_W||^2 / (fan ||g_y||^2)``.
  (AC-GC's ``dx^2 = e ||g_W||^2 / (2 N C H W sum_i u_i ||g_y,i||^2)`` is the same relation
  with gradients normalised per value and a factor 2 of slack; we keep the exact expectation
  so that ``e`` is the expected squared relative error of each weight gradient.)
* every other kind (norms, smooth activations, softmax), which has no weight gradient that the
  saved tensor alone feeds: the relation of its own backward, ``g_x = s * g_y`` as for an
  activation saving its derivative, where it is exact: ``sigma^2 <= e ||g_x||^2 / ||g_y||^2``
  keeps the input gradient's error within ``e``. For norms and softmax (whose backward also
  mixes values along the normalised dims) this is an approximation, documented as such.

The rounding variance of a value in group g at b bits is at most ``step_g^2 / 4`` with
``step_g = range_g / (2^b - 1)``; averaged over the tensor that is
``R / (4 D (2^b - 1)^2)`` (R: sum of len_g range_g^2, ``stats.range_statistic``; D: values).
The width is the smallest of {1, 2, 4, 8} that keeps this under the allowed sigma^2 (8 when
none does). Pinned layers keep their width.

Schedule (AC-GC: statistics every 100 steps, averaged over the last 10): the norms are summed
on the device over the last ``min(10, update_interval)`` steps of every ``update_interval``;
the step after such a window computes all widths on the device and sends them to the host
with one non-blocking copy (``readback.DeferredRead``); the step after that applies them.
Nothing reads the device per step. Until the first update every layer uses the config's width.

Threads running one model (``base``'s module doc): each root training forward takes its step
number and whether it records from the root's pre-hook (kept per thread); the sums, sizes and
widths change under the strategy's lock, and a layer's widths reach its forward through the
thread's slot (``stats.set_width``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .._compile import EagerHook
from ..quant import SampleBits
from .base import PrecisionStrategy, TrackedLayer, compresses_now, hand_derivative
from .readback import DeferredRead
from .stats import (LayerKind, LayerStats, count_call, layer_kind, saved_statistic,
                    set_width)

__all__ = ["ACGCStrategy", "WINDOW"]

WINDOW = 10  # steps averaged per update (AC-GC)
_WIDTHS = (1, 2, 4, 8)


def _sq(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32).square()


class _Layer:
    """Hooks, sums and width of one quantizing Q-layer."""

    def __init__(self, strategy: "ACGCStrategy", tl: TrackedLayer, kind: LayerKind) -> None:
        self.strategy = strategy
        self.name = tl.name
        self.module = tl.module
        self.kind = kind
        self.pinned_bits = tl.pinned_bits
        self.stats = LayerStats()
        self.width: int = int(tl.module.qconfig.bits)  # type: ignore[attr-defined]
        self.fan = 1.0
        self.recording = False
        self._counted: Optional[int] = None  # the step stats.* belong to
        self._full: Optional[SampleBits] = None
        # device sums over the window: [||g_W||^2 or ||g_x||^2, ||g_y||^2, R, values]
        self.sums: Optional[Tensor] = None

    def reset(self) -> None:
        self.sums = None

    def _add(self, slot: int, value: Union[Tensor, float]) -> None:
        """Add to the window's sums (under the strategy's lock)."""
        if self.sums is None:
            dev = value.device if isinstance(value, Tensor) else self.module_device()
            self.sums = torch.zeros(4, dtype=torch.float64, device=dev)
        if isinstance(value, Tensor):
            value = value.to(self.sums.device, torch.float64)
        self.sums[slot] += value

    def module_device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    # -- hooks ----------------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: Tuple) -> None:
        s = self.strategy
        running = s.running()
        running.pop(self, None)
        self.recording = False
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
        # this thread's root forward: (step, recording); outside one (a checkpoint's
        # recomputation on the autograd engine's thread) the last step's
        step, recording = s.local.forward or (s.step, s.recording)
        record = recording and self.pinned_bits is None
        if record:
            with torch.no_grad():  # (an activation's f'(x) is handed to the layer, stats.py)
                r, made = saved_statistic(self.kind, module, rows,
                                          module.qconfig.group_size)  # type: ignore[attr-defined]
                r_sum, values = r.sum(), float(rows.numel())
            hand_derivative(module, x, made)
            fan = 4.0 * self.kind.fan(module, rows) if self.kind.modelled else 1.0
            if not self.kind.modelled and x.requires_grad:
                x.register_hook(self.input_grad)
        with s.lock:
            count_call(self.stats, step != self._counted, n, rows.numel() // n)
            self._counted = step
            if record:
                self.recording = True
                self._add(2, r_sum)
                self._add(3, values)
                self.fan = fan
            if self.pinned_bits is None:
                self._full = set_width(module, self.stats, self.width, n, x.device, self._full)
        if record:
            running[self] = True

    def post_hook(self, module: nn.Module, args: Tuple, output: object) -> None:
        running = self.strategy.local.running
        if running and running.pop(self, None) and isinstance(output, Tensor) \
                and output.requires_grad:
            output.register_hook(self.output_grad)

    def output_grad(self, grad: Tensor) -> None:
        sq = _sq(grad)
        with self.strategy.lock:
            self._add(1, sq)

    def input_grad(self, grad: Tensor) -> None:
        sq = _sq(grad)
        with self.strategy.lock:
            self._add(0, sq)

    def weight_grad(self, grad: Tensor) -> None:
        """Counted when the layer's last call recorded (a Parameter's hook cannot tell which
        forward its gradient is of; with threads that is the last call of any thread)."""
        if self.recording:
            sq = _sq(grad)
            with self.strategy.lock:
                self._add(0, sq)

    # -- the bound ------------------------------------------------------------------------
    def widths_index(self, e: float, levels: Tensor) -> Optional[Tensor]:
        """0-d int64 index into (1, 2, 4, 8) of the smallest width meeting the bound, on the
        device; None without statistics."""
        s = self.sums
        if s is None:
            return None
        gref, gy, r, d = s[0], s[1], s[2], s[3]
        allowed = e * gref / (self.fan * gy)  # sigma^2 allowed per value (inf: g_y = 0)
        need = r / (4.0 * d.clamp_min(1.0) * allowed)  # (2^b - 1)^2 must reach this
        need = torch.nan_to_num(need, nan=0.0, posinf=float("inf"))
        return (levels.to(need.device) < need).sum().clamp(max=3)


class ACGCStrategy(PrecisionStrategy):
    """``strategy: acgc`` -- per-layer widths from an error fraction (module doc)."""

    name = "acgc"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.error_fraction = float(config.error_fraction)
        self.update_interval = int(config.update_interval)
        self.window = min(WINDOW, self.update_interval)
        self.step = 0
        self.updates = 0
        self.recording = False
        self.watched: List[_Layer] = []
        self._pending: Optional[Tuple[List[_Layer], DeferredRead]] = None
        self._levels: Dict[torch.device, Tensor] = {}

    def attach(self, model: nn.Module, layers: Sequence[TrackedLayer]) -> None:
        super().attach(model, layers)
        for tl in self.layers:
            kind = layer_kind(tl.module)
            if kind is None:
                continue
            w = _Layer(self, tl, kind)
            tl.module.precision_stats = w.stats
            tl.module.sample_bits = None
            self.own_widths(tl.module)
            self._watch(model, tl.module, w.pre_hook, w.post_hook)
            weight = getattr(tl.module, "weight", None)
            if kind.modelled and isinstance(weight, nn.Parameter) and weight.requires_grad:
                self._keep(weight.register_hook(EagerHook(w.weight_grad)))
            self.watched.append(w)
        if self.watched:
            self._keep(model.register_forward_pre_hook(EagerHook(self.on_model_forward),
                                                        prepend=True))

    def detach(self) -> None:
        super().detach()
        self.watched = []
        self._pending = None

    # -- per step -------------------------------------------------------------------------
    def on_model_forward(self, model: nn.Module, args: Tuple) -> None:
        """Count steps; apply widths computed a step ago; compute widths after a window;
        record statistics on the window's steps."""
        if not (model.training and torch.is_grad_enabled()):
            return
        k = self.update_interval
        with self.lock:
            step = self._count_step()
            if step > 1 and (step - 1) % k == 0:  # a window ended with the last step
                self.compute()
            recording = self.recording = (step - 1) % k >= k - self.window
        self.local.forward = (step, recording)

    def compute(self) -> None:
        """Widths of every free layer from the window's sums (on the device), sent to the host
        with one non-blocking copy; the sums restart. Under the lock."""
        ready, idx = [], []
        for w in self.watched:
            if w.pinned_bits is not None:
                continue
            if w.sums is not None:
                dev = w.sums.device
                levels = self._levels.get(dev)
                if levels is None:
                    levels = self._levels[dev] = torch.tensor([1.0, 9.0, 225.0, 65025.0],
                                                              dtype=torch.float64, device=dev)
                i = w.widths_index(self.error_fraction, levels)
                if i is not None:
                    ready.append(w)
                    idx.append(i if not idx else i.to(idx[0].device))
            w.reset()
        if ready:
            self._pending = (ready, DeferredRead(torch.stack(idx)))

    def _apply(self, layers: List[_Layer], read: DeferredRead) -> None:
        for w, i in zip(layers, read.read()):
            w.width = _WIDTHS[int(i)]
        self.updates += 1

    # -- reporting ------------------------------------------------------------------------
    def layer_budgets(self) -> Dict[str, float]:
        """name -> the width each free layer's next forward uses."""
        return {w.name: float(w.width) for w in self.watched if w.pinned_bits is None}

    def average_bits(self) -> float:
        """The average width over the values the last training forward compressed."""
        bits = values = 0.0
        for w in self.watched:
            if not w.stats.numel:
                continue
            n = w.stats.numel * w.stats.samples
            bits += (w.pinned_bits or w.width) * n
            values += n
        return bits / values if values else float("nan")

    def report(self) -> Dict[str, Any]:
        """The error fraction, the widths it gave and the average width (the outcome)."""
        return {"error_fraction": self.error_fraction, "widths": self.layer_budgets(),
                "average_bits": self.average_bits(), "updates": self.updates}
