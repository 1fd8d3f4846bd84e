"""Bit allocation as tensor programs: no Python loop over samples, no host synchronisation.

Both solvers minimise ``sum_i C_i / (2^b_i - 1)^2`` over widths ``b_i`` in {1, 2, 4, 8} under a
bit budget. Each item starts at 1 bit and may take the upgrades 1->2, 2->4, 4->8 in that order.
The gain of an upgrade per bit it costs, ``C * (v(b) - v(b')) / (b' - b)`` with
``v(b) = 1 / (2^b - 1)^2``, is 0.889 C, 0.0533 C and 0.0011 C: strictly decreasing along each
item's chain. So the greedy that takes upgrades by decreasing gain per bit (ActNN's priority
queue, run backwards) is one sort of the 3M candidates, and what it takes under a budget is a
prefix of that order found with a cumsum: the prefix never takes an upgrade before the one it
depends on (a stable sort keeps the chain order among ties, e.g. C = 0). The exact optimum of the
continuous relaxation is this prefix plus a fraction of the next candidate; the integer
allocation drops the fraction and then spends what is left on the cheapest upgrades that still
fit (1->2 of items at 1 bit).

The budget arguments may be tensors on the items' device; nothing here reads a value back to
the host, so the solvers can run every step on a GPU without a device-to-host copy. With a
host budget, :func:`allocate_samples` runs as one call into the compiled extension, bit-identical
(``cpp_ext/widths_cpu.cpp``; on CUDA ``widths_cuda.cu``, not yet run on a GPU): the ~21 small
torch ops cost more in dispatch than the work, and on a GPU each is a launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch
from torch import Tensor

from ..quant.api import no_graph
from ..quant.backend import kernels

__all__ = ["WIDTHS", "UPGRADE_COST", "UPGRADE_GAIN", "UpgradeTable", "quantization_cost",
           "allocate_samples", "allocate_weighted", "extra_bits"]

WIDTHS = (1, 2, 4, 8)
UPGRADE_COST = (1.0, 2.0, 4.0)  # bits the upgrades 1->2, 2->4, 4->8 add to one item


def _v(b: int) -> float:
    return 1.0 / float((1 << b) - 1) ** 2


# Decrease of C / (2^b - 1)^2 per unit of C for each upgrade (not per bit).
UPGRADE_GAIN = (_v(1) - _v(2), _v(2) - _v(4), _v(4) - _v(8))


def quantization_cost(score: Tensor, bits: Tensor) -> Tensor:
    """``sum score / (2^bits - 1)^2``: the objective, proportional to the stochastic-rounding
    variance when ``score`` is the sum of squared group ranges (times the op's sensitivity)."""
    levels = torch.pow(2.0, bits.to(torch.float64)) - 1.0
    return (score.to(torch.float64) / levels.square()).sum()


@dataclass(frozen=True)
class UpgradeTable:
    """The per-upgrade constants as tensors on one device: built once and reused, so a solver
    call creates no tensor from host data (a host-to-device copy on a GPU)."""

    gain_per_bit: Tensor  # (3,) UPGRADE_GAIN / UPGRADE_COST
    cost: Tensor          # (3,) UPGRADE_COST
    _repeated: Dict[int, Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> "UpgradeTable":
        gain = torch.tensor(UPGRADE_GAIN, dtype=torch.float64)
        cost = torch.tensor(UPGRADE_COST, dtype=torch.float64)
        return cls((gain / cost).to(device=device, dtype=dtype), cost.to(device=device,
                                                                         dtype=dtype))

    def costs(self, m: int) -> Tensor:
        """(3m,) the cost of every upgrade in the stage-major layout (cached per m)."""
        c = self._repeated.get(m)
        if c is None:
            c = self._repeated[m] = self.cost.repeat_interleave(m)
        return c


def extra_bits(budget: Union[Tensor, float], m: int) -> Union[Tensor, float]:
    """Bits ``m`` items may take above 1 each under an average ``budget``:
    ``floor(budget * m) - m`` (a 0-d float32 tensor when ``budget`` is a tensor)."""
    if isinstance(budget, Tensor):  # the epsilon absorbs float error in budget * m
        return (torch.floor(budget * m + 1e-9) - m).to(torch.float32)
    return float(math.floor(float(budget) * m + 1e-9) - m)


def allocate_samples(score: Tensor, budget: Union[Tensor, float],
                     table: Optional[UpgradeTable] = None,
                     extra: Union[Tensor, float, None] = None) -> Tensor:
    """Integer widths, one per item, with ``sum(widths) <= floor(budget * M)``.

    ``score`` (M,): each item's sensitivity C_i (non-negative, finite). ``budget``: the average
    width allowed, a float or a 0-d tensor on ``score``'s device (1 <= budget <= 8).
    ``table``: :class:`UpgradeTable` for ``score``'s device and float32 (built when None).
    Returns uint8 widths in {1, 2, 4, 8} on ``score``'s device; identical inputs give identical
    outputs. ``extra``: :func:`extra_bits` of ``budget`` and M, when the caller has it.
    """
    m = score.shape[0]
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=score.device)
    s = no_graph(score)
    s = s if s.dtype == torch.float32 else s.to(torch.float32)
    if extra is None:
        extra = extra_bits(budget, m)
    # The compiled greedy (CPU, and CUDA in a CUDA build; the meta device's stand-in): one call
    # where the torch program below is ~21 small operators. A budget on the device (a tensor
    # extra) takes the torch program: reading it would wait for the device.
    kernel = (None if isinstance(extra, Tensor)
              else getattr(kernels(s.device), "allocate_widths", None))
    if kernel is not None:
        return kernel(s.contiguous(), float(extra))
    return _allocate_samples_torch(s, extra, table)


def _allocate_samples_torch(s: Tensor, extra: Union[Tensor, float],
                            table: Optional[UpgradeTable] = None) -> Tensor:
    """:func:`allocate_samples` as a torch program (any device, tensor budgets); ``s`` float32."""
    m = s.shape[0]
    table = UpgradeTable.build(s.device) if table is None else table
    # The 3M upgrades, stage-major ([1->2 of every item, 2->4 ..., 4->8 ...]): a stable sort
    # by gain per bit then keeps each item's chain in order, ties included.
    ratio = (table.gain_per_bit.unsqueeze(1) * s).reshape(-1)
    order = torch.argsort(ratio, descending=True, stable=True)
    cost_sorted = table.costs(m)[order]
    taken = cost_sorted * (cost_sorted.cumsum(0) <= extra)  # the prefix that fits, as costs
    # What it left (less than the next upgrade's cost) goes to 1->2 upgrades of items still
    # at 1 bit, in the same order.
    free_unit = (cost_sorted - taken) == 1.0
    fill = free_unit & (free_unit.cumsum(0) <= extra - taken.sum())
    # order is a permutation: every slot of inc is written
    inc = torch.empty_like(taken).scatter_(0, order, taken + fill)
    return inc.view(3, m).sum(0, dtype=torch.uint8).add_(1)


def allocate_weighted(score: Tensor, weight: Tensor, budget: Union[Tensor, float],
                      table: Optional[UpgradeTable] = None) -> Tensor:
    """Real-valued widths (the continuous relaxation) for items of different sizes.

    Item i holds ``weight[i]`` values (a layer's values per sample), so its upgrades cost
    ``weight[i]`` times more bits. Minimises ``sum C_i / (2^b_i - 1)^2`` subject to
    ``sum weight_i * b_i <= budget * sum weight_i`` with each b_i on the chain 1 -> 2 -> 4 -> 8
    and at most one upgrade taken fractionally; the budget is used exactly (unless every item
    is at 8 bits). ``weight`` must be positive. float64 widths (M,), on ``score``'s device
    (``table``, when given, must be float64 on that device).
    """
    m = score.shape[0]
    if m == 0:
        return torch.empty(0, dtype=torch.float64, device=score.device)
    s = score.detach().to(torch.float64)
    w = weight.detach().to(torch.float64)
    table = UpgradeTable.build(s.device, torch.float64) if table is None else table
    ratio = (table.gain_per_bit.unsqueeze(1) * (s / w)).reshape(-1)
    cost = (table.cost.unsqueeze(1) * w).reshape(-1)
    order = torch.argsort(ratio, descending=True, stable=True)
    cost_sorted = cost[order]
    extra = (budget - 1.0) * w.sum()
    cum = cost_sorted.cumsum(0)
    # 1 for upgrades fully inside the budget, the fraction that fits for the first one that
    # does not, 0 after it.
    frac = ((extra - (cum - cost_sorted)) / cost_sorted).clamp(0.0, 1.0)
    inc = torch.zeros_like(cost).scatter_(0, order, frac)
    return (inc.view(3, m) * table.cost.unsqueeze(1)).sum(0) + 1.0
