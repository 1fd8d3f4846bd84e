"""Bit-allocation strategies: the solvers, auto precision (strategy: actnn) on real layers,
budgets, pinned layers, determinism, isolation between models, and no host synchronisation."""
from __future__ import annotations

import ast
import copy
import itertools
import math
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.config import STRATEGIES, QuantConfig
from actnn_zoo.convert import precision_strategy
from actnn_zoo.precision import (STRATEGY_CLASSES, ActNNStrategy, UniformStrategy,
                                 allocate_samples, allocate_weighted, quantization_cost,
                                 range_statistic)
from actnn_zoo.precision.base import WATCH_ATTR, LayerWatch
from actnn_zoo.precision.solver import _allocate_samples_torch, extra_bits
from actnn_zoo.precision.stats import _range_statistic_torch
from actnn_zoo.quant.backend import extension
from actnn_zoo.quant import SampleBits

from _spy import CompressionSpy  # tests/_spy.py

ROOT = Path(__file__).resolve().parents[1]
PRECISION_DIR = ROOT / "actnn_zoo" / "precision"
CONFIGS = ROOT / "configs"
WIDTHS = (1, 2, 4, 8)


# ----------------------------------------------------------------------------- helpers
def cost(score: Tensor, bits: Tensor) -> float:
    return float(quantization_cost(score, bits))


def brute_force(score: List[float], budget_bits: int) -> float:
    """Exact minimum of sum score / (2^b - 1)^2 with sum b <= budget_bits."""
    best = math.inf
    for combo in itertools.product(WIDTHS, repeat=len(score)):
        if sum(combo) <= budget_bits:
            best = min(best, sum(s / (2 ** b - 1) ** 2 for s, b in zip(score, combo)))
    return best


class Net(nn.Module):
    """Small CNN with every kind the strategy treats: conv, BN, ReLU, pool, GELU, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(64, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        return self.fc2(self.act(self.fc1(x.flatten(1))))


def batches(n: int, steps: int, seed: int = 0) -> List[Tuple[Tensor, Tensor]]:
    """Images whose per-sample scale varies 30x, so per-sample widths have a reason to differ."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = torch.exp(torch.rand(n, 1, 1, 1, generator=g) * math.log(30.0))
        x = torch.randn(n, 1, 8, 8, generator=g) * scale
        out.append((x, torch.randint(0, 10, (n,), generator=g)))
    return out


def train(model: nn.Module, data: List[Tuple[Tensor, Tensor]], lr: float = 0.01) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def average_bits(calls) -> float:
    values = sum(c[0] for c in calls)
    return sum(c[1] for c in calls) / values


# ----------------------------------------------------------------------------- solvers
@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=40),
       budget=st.floats(1.0, 8.0))
def test_allocate_samples_respects_and_uses_the_budget(scores, budget):
    s = torch.tensor(scores)
    bits = allocate_samples(s, budget)
    m = len(scores)
    assert bits.dtype == torch.uint8 and bits.shape == (m,)
    assert set(bits.tolist()) <= set(WIDTHS)
    allowed = math.floor(budget * m + 1e-9)
    total = int(bits.sum())
    assert total <= allowed
    # What is left is less than one upgrade (< 4 bits), and < 1 bit while any item is at 1.
    assert allowed - total < 4
    if (bits == 1).any():
        assert allowed - total < 1
    # same result as a tensor budget, and deterministic
    assert torch.equal(bits, allocate_samples(s, torch.tensor(budget, dtype=torch.float64)))
    assert torch.equal(bits, allocate_samples(s.clone(), budget))


@settings(max_examples=40, deadline=None)
@given(scores=st.lists(st.floats(0.0, 1e3), min_size=1, max_size=5),
       budget=st.floats(1.0, 8.0))
def test_allocate_samples_is_optimal_for_the_bits_it_spends(scores, budget):
    """The greedy prefix is the exact optimum for its own spend; the final fill adds at most
    3 bits, so the result is at least as good as the optimum with 3 bits fewer."""
    s = torch.tensor(scores, dtype=torch.float64)
    bits = allocate_samples(s.float(), budget)
    spent = int(bits.sum())
    assert cost(s, bits) <= brute_force(scores, spent - 3) * (1 + 1e-5) + 1e-9
    assert cost(s, bits) >= brute_force(scores, spent) * (1 - 1e-5) - 1e-9


def test_allocate_samples_gives_wider_codes_to_larger_scores():
    s = torch.tensor([1.0, 50.0, 3.0, 1000.0, 0.0, 20.0, 7.0, 300.0])
    for budget in (1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0):
        bits = allocate_samples(s, budget)
        order = torch.argsort(s)
        assert torch.all(bits[order][1:] >= bits[order][:-1]), (budget, bits)
    two = allocate_samples(s, 2.0)
    assert int(two.sum()) == 16 and cost(s, two) == pytest.approx(brute_force(s.tolist(), 16))
    assert allocate_samples(s, 8.0).tolist() == [8] * 8
    assert allocate_samples(s, 1.0).tolist() == [1] * 8
    assert allocate_samples(torch.zeros(0), 2.0).shape == (0,)


@settings(max_examples=40, deadline=None)
@given(data=st.lists(st.tuples(st.floats(0.0, 1e4), st.integers(1, 5000)), min_size=1,
                     max_size=30),
       budget=st.floats(1.0, 7.99))
def test_allocate_weighted_uses_the_budget_exactly(data, budget):
    s = torch.tensor([d[0] for d in data], dtype=torch.float64)
    w = torch.tensor([float(d[1]) for d in data], dtype=torch.float64)
    b = allocate_weighted(s, w, budget)
    assert torch.all(b >= 1.0 - 1e-12) and torch.all(b <= 8.0 + 1e-12)
    assert float((b * w).sum()) == pytest.approx(budget * float(w.sum()), rel=1e-9)


def test_allocate_weighted_favours_sensitive_and_small_items():
    w = torch.tensor([100.0, 100.0, 100.0])
    b = allocate_weighted(torch.tensor([1.0, 10.0, 100.0]), w, 2.0)
    assert b[0] <= b[1] <= b[2] and b[2] > 2.0 > b[0]
    # same sensitivity, 10x the values: a bit there costs 10x more
    b = allocate_weighted(torch.tensor([100.0, 100.0]), torch.tensor([10.0, 100.0]), 3.0)
    assert b[0] > b[1]


def test_range_statistic_is_the_sum_of_squared_group_ranges():
    x = torch.randn(3, 600)
    x[1, 10] = float("nan")  # its group counts 0
    r = range_statistic(x, 256)
    for n in range(3):
        expect = 0.0
        for a in range(0, 600, 256):
            g = x[n, a:a + 256]
            if torch.isfinite(g).all():
                expect += len(g) * float(g.max() - g.min()) ** 2
        assert float(r[n]) == pytest.approx(expect, rel=1e-5)
    assert range_statistic(torch.ones(2, 5, 5), 256).tolist() == [0.0, 0.0]


def _cpu_kernels():
    from _ext import compiled_extension

    return compiled_extension()


@settings(max_examples=80, deadline=None)
@given(scores=st.lists(st.sampled_from([0.0, 1e-3, 0.5, 1.0, 1.0, 3.0, 17.0, 250.0, 1e4]) |
                       st.floats(0.0, 1e6), min_size=1, max_size=60),
       budget=st.floats(1.0, 8.0))
def test_cpu_width_kernel_is_the_torch_program(scores, budget):
    """Bit-identical, ties included (repeated scores, zeros)."""
    ext = _cpu_kernels()
    s = torch.tensor(scores, dtype=torch.float32)
    extra = extra_bits(budget, len(scores))
    got = ext.allocate_widths(s, extra)
    want = _allocate_samples_torch(s, extra)
    assert got.dtype == torch.uint8 and torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(allocate_samples(s, budget), want)  # the public entry uses the kernel


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), d=st.integers(1, 700), group_size=st.sampled_from([8, 32, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       poison=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_cpu_range_kernel_matches_the_torch_reductions(n, d, group_size, dtype, poison, seed):
    """Equal up to rounding: torch takes max - min in the input dtype, the kernel in float32."""
    ext = _cpu_kernels()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 100).to(dtype)
    if poison is not None:
        x[n // 2, d // 2] = poison
    got = ext.range_statistic(x, group_size)
    want = _range_statistic_torch(x, group_size)
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-30)
    assert torch.equal(range_statistic(x, group_size), got)  # the public entry uses the kernel


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5), d=st.integers(0, 300), group_size=st.sampled_from([8, 64, 256]),
       exponent=st.sampled_from([None, 0.0, 0.5, 1.0]), budget=st.floats(1.0, 8.0),
       seed=st.integers(0, 2 ** 31 - 1))
def test_choose_widths_is_the_statistic_its_power_and_the_widths(n, d, group_size, exponent,
                                                                 budget, seed):
    """The one call a watched layer makes per step (``_C.choose_widths``) gives exactly what
    its three parts give one by one, on a 3-d input read through its pointer (no row view),
    empty rows and samples included."""
    ext = _cpu_kernels()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, d, generator=g) * torch.rand(n, 1, 1, generator=g) * 10
    e = None if exponent is None else torch.tensor(exponent)
    extra = extra_bits(budget, n)
    score, bits = ext.choose_widths(x, group_size, e, extra)
    want = ext.range_statistic(x.reshape(n, 3 * d), group_size)
    assert score.dtype == torch.float32 and torch.equal(score, want)
    if n and not d:
        assert score.tolist() == [0.0] * n  # no values: no range (the output is not left unset)
    expected = want if e is None else want.pow(e)
    assert bits.dtype == torch.uint8 and torch.equal(bits, ext.allocate_widths(expected, extra))


# ----------------------------------------------------------------------------- config
def test_strategy_registry_and_configs():
    assert set(STRATEGY_CLASSES) == set(STRATEGIES)
    assert STRATEGY_CLASSES["actnn"] is ActNNStrategy
    model = az.convert_model(Net())
    strategy = precision_strategy(model)
    assert isinstance(strategy, ActNNStrategy) and strategy.budget == 2.0
    assert isinstance(precision_strategy(az.convert_model(Net(), CONFIGS / "2bit.yaml")),
                      UniformStrategy)
    low = az.convert_model(Net(), CONFIGS / "actnn_1.5bit.yaml")
    assert precision_strategy(low).budget == 1.5 and low.conv1.qconfig.bits == 1
    for bad in (0.5, 9, "2"):
        with pytest.raises(ValueError, match="bits"):
            QuantConfig(strategy="actnn", bits=bad)
    cfg = QuantConfig(rules=[{"type": "Linear", "bits": 8}, {"name": "fc2", "bits": 4},
                             {"name": "conv1", "group_size": 64}])
    assert cfg.pinned_bits("fc1", nn.Linear(1, 1)) == 8
    assert cfg.pinned_bits("fc2", nn.Linear(1, 1)) == 4
    assert cfg.pinned_bits("conv1", nn.Conv2d(1, 1, 1)) is None


# ----------------------------------------------------------------------------- budget
@pytest.mark.parametrize("budget", [1.5, 2, 2.5, 3])
def test_realised_average_never_exceeds_the_budget(monkeypatch, budget):
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="actnn", bits=budget)
    spy = CompressionSpy(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    realised = []
    for x, y in batches(32, 6):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        realised.append(average_bits(spy.take()))
    assert all(r <= budget + 1e-9 for r in realised), realised
    assert all(r >= 0.95 * budget for r in realised), realised
    widths = {int(w) for wt in precision_strategy(model).watched if wt.stats.bits is not None
              for w in wt.stats.bits}
    assert widths <= set(WIDTHS)


def test_pinned_layers_keep_their_widths_and_the_rest_pays(monkeypatch):
    torch.manual_seed(0)
    cfg = {"strategy": "actnn", "bits": 2,
           "rules": [{"name": "conv2", "bits": 4}, {"type": "BatchNorm2d", "bits": 1}]}
    model = az.convert_model(Net(), cfg)
    pinned = {model.conv2: 4, model.bn1: 1, model.bn2: 1}
    spy = CompressionSpy(monkeypatch)
    seen: Dict[nn.Module, List[Tensor]] = {m: [] for m in pinned}
    for m in pinned:
        m.register_forward_hook(lambda mod, a, out: seen[mod].append(spy.calls[-1][2]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(batches(32, 5)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        calls = spy.take()
        if step >= 2:  # from step 3 on (solved at step 2), pinned cost is subtracted
            assert 0.95 * 2 <= average_bits(calls) <= 2 + 1e-9
    for m, width in pinned.items():
        assert m.sample_bits is None and m.qconfig.bits == width
        assert len(seen[m]) == 5 and all(not q.mixed and q.bits == width for q in seen[m])


def test_pinned_layers_count_at_every_re_allocation(monkeypatch):
    """A pinned layer records its values on the recording steps alone (the ones each
    re-allocation reads): over 4 re-allocations (update_interval 3) with the batch size
    changing, the realised average stays within the budget on every step after the first
    solve, and a pinned layer's record is that of the last recording step."""
    torch.manual_seed(0)
    cfg = {"strategy": "actnn", "bits": 2, "update_interval": 3,
           "rules": [{"name": "conv2", "bits": 4}, {"type": "BatchNorm2d", "bits": 1}]}
    model = az.convert_model(Net(), cfg)
    strategy = precision_strategy(model)
    spy = CompressionSpy(monkeypatch)
    sizes = [32, 16, 32, 24, 32, 16, 32, 32, 24, 16, 32, 32, 16]
    for step, n in enumerate(sizes, start=1):
        x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
        F.cross_entropy(model(x), y).backward()
        calls = spy.take()
        if step >= 3:
            assert 0.95 * 2 <= average_bits(calls) <= 2 + 1e-9, (step, average_bits(calls))
        last_recorded = max(s for s in range(1, step + 1) if s == 1 or s % 3 == 0)
        w = next(w for w in strategy.watched if w.module is model.conv2)
        assert w.stats.samples == sizes[last_recorded - 1], (step, w.stats.samples)
    assert strategy.updates >= 4


def test_pinned_layers_wider_than_the_budget_warn():
    model = az.convert_model(Net(), {"strategy": "actnn", "bits": 1,
                                     "rules": [{"type": "BatchNorm2d", "bits": 8}]})
    with pytest.warns(UserWarning, match="pinned by rules"):
        train(model, batches(8, 2))


# ----------------------------------------------------------------------------- sensitivity
def test_samples_with_a_larger_range_get_more_bits():
    torch.manual_seed(0)
    lin = az.convert_model(nn.Linear(512, 16), strategy="actnn", bits=2.5)
    x = torch.randn(16, 512)
    x[3] *= 30.0
    x[7] *= 5.0
    lin(x).square().sum().backward()  # step 1: plain ranges
    bits = lin.sample_bits.bits
    assert int(bits[3]) == 8 and int(bits[3]) > int(bits[7]) >= int(bits.min())
    rng = range_statistic(x, 256)
    for _ in range(3):  # later steps: the widths stay ordered by range
        lin(x).square().sum().backward()
        b = lin.sample_bits.bits[torch.argsort(rng)]
        assert torch.all(b[1:] >= b[:-1])
        assert int(lin.sample_bits.bits.sum()) <= lin.sample_bits.max_sum == 2.5 * 16


class TwoHeads(nn.Module):
    """Two identical layers on the same input; the loss weighs one head's output 10x."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 8)
        self.b = nn.Linear(256, 8)

    def forward(self, x: Tensor) -> Tensor:
        return 10.0 * self.a(x) + self.b(x)


def test_a_layer_with_a_larger_gradient_gets_more_bits():
    torch.manual_seed(0)
    model = az.convert_model(TwoHeads(), strategy="actnn", bits=2)
    x = torch.randn(32, 256)
    for _ in range(3):
        model(x).square().sum().backward()
    budgets = precision_strategy(model).layer_budgets()
    assert float(budgets["a"]) > 2.0 > float(budgets["b"])
    assert (float(model.a.sample_bits.bits.double().mean())
            > float(model.b.sample_bits.bits.double().mean()))
    # the first step, before any gradient, used the uniform budget
    fresh = az.convert_model(TwoHeads(), strategy="actnn", bits=2)
    fresh(x).sum().backward()
    assert fresh.a.sample_bits.bits.tolist() == fresh.b.sample_bits.bits.tolist() == [2] * 32


def test_calibration_follows_how_gradients_depend_on_ranges():
    """E[C_n | R_n] ~ R_n^gamma: gamma ~ 1 when gradients do not depend on the range, ~ 0
    when they fall as 1/R (confident samples), clipped to [0, 1]."""
    torch.manual_seed(0)
    model = az.convert_model(nn.Linear(256, 4), strategy="actnn", bits=2)
    w = precision_strategy(model).watched[0]
    r = torch.exp(torch.randn(64) * 2)
    w.stats.range_sq = r
    w.stats.samples, w.stats.numel = 64, 256
    for grads, expect in ((torch.ones(64), 1.0), (1.0 / r, 0.0), (1.0 / r ** 3, 0.0),
                          (r ** 0.5, 1.0), (r ** -0.5, 0.5)):
        w.stats.sample_grad_sq = grads
        c = w.calibrate(torch.device("cpu"))
        assert float(w.exponent) == pytest.approx(expect, abs=1e-4)
        assert float(c.sum()) == pytest.approx(float((r * grads).sum()) * w.factor(), rel=1e-6)


def test_update_interval_reallocates_every_k_steps():
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="actnn", bits=2, update_interval=3)
    strategy = precision_strategy(model)
    conv = next(w for w in strategy.watched if w.name == "conv2")
    history = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(16, 9):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        history.append((strategy.updates, conv.budget))
    applied = [i + 1 for i in range(1, 9) if history[i][0] != history[i - 1][0]]
    # solved at step 2, then at steps 1 + 3k; each applies from the step after
    assert applied == [3, 5, 8] and strategy.updates == 3 and strategy.step == 9
    assert all(history[i][1] == history[i - 1][1] for i in range(1, 9) if i + 1 not in applied)
    assert history[2][1] != 2.0  # the first applied re-allocation moved conv2 off the budget


def test_eval_and_no_grad_do_not_count_or_set_widths():
    model = az.convert_model(Net())
    strategy = precision_strategy(model)
    x = torch.randn(4, 1, 8, 8)
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert strategy.step == 0 and model.conv1.sample_bits is None


# ----------------------------------------------------------------------------- reproducible
def run_history(seed: int) -> Tuple[List[List[int]], Dict[str, Tensor]]:
    torch.manual_seed(seed)
    model = az.convert_model(Net(), strategy="actnn", bits=1.5)
    widths = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(16, 4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        widths.append(torch.cat([w.stats.bits for w in precision_strategy(model).watched
                                 if w.stats.bits is not None]).tolist())
        opt.step()
    return widths, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_identical_seeds_give_identical_results():
    w1, p1 = run_history(0)
    w2, p2 = run_history(0)
    assert w1 == w2
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    w3, p3 = run_history(1)
    assert any(not torch.equal(p1[n], p3[n]) for n in p1)


# ----------------------------------------------------------------------------- isolation
def test_models_do_not_interact_and_deepcopy_is_independent():
    torch.manual_seed(0)
    a = az.convert_model(Net(), strategy="actnn", bits=2)
    b = az.convert_model(Net(), strategy="actnn", bits=4)
    train(a, batches(8, 3))
    assert precision_strategy(a).step == 3 and precision_strategy(b).step == 0
    assert b.conv1.sample_bits is None
    c = copy.deepcopy(a)
    sc = precision_strategy(c)
    assert sc is not precision_strategy(a)
    assert all(w.module is dict(c.named_modules())[w.name] for w in sc.watched)
    train(c, batches(8, 2))
    assert sc.step == 5 and precision_strategy(a).step == 3


def hook_counts(model: nn.Module) -> Dict[str, int]:
    """Per module: its forward hooks and a strategy's callbacks around its calls."""
    return {n: len(m._forward_pre_hooks) + len(m._forward_hooks) + (WATCH_ATTR in vars(m))
            for n, m in model.named_modules()}


def test_strategy_callbacks_wrap_the_layer_call_not_as_module_hooks():
    """The strategy's per-layer work runs around the Q-layer's call (LayerWatch), not as
    module hooks (which put every watched call on nn.Module's slow path): the user's own
    hooks still run, inside it -- a user pre-hook sees the widths the strategy just chose,
    and the strategy measures the output a user forward hook left."""
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="actnn")
    conv = model.conv2
    assert not conv._forward_pre_hooks and not conv._forward_hooks
    assert isinstance(vars(conv)[WATCH_ATTR], LayerWatch)
    seen: List[object] = []
    conv.register_forward_pre_hook(
        lambda m, args: seen.append(type(m.sample_bits).__name__))
    conv.register_forward_hook(lambda m, args, out: seen.append("post") or out * 2.0)
    data = batches(8, 3)
    train(model, data)
    assert seen == ["SampleBits", "post"] * 3, seen
    st = precision_strategy(model)
    assert st.step == 3 and conv.precision_stats.values > 0
    # the root's own step hook still counts a forward before any layer's callback, also when
    # the root is itself a watched Q-layer (its callbacks stay module hooks, after the step's)
    root = az.convert_model(nn.Sequential(nn.Linear(8, 8)), strategy="actnn")[0]
    lone = az.convert_model(nn.Linear(8, 8), strategy="actnn")
    assert WATCH_ATTR not in vars(lone) and len(lone._forward_pre_hooks) == 2
    assert isinstance(vars(root)[WATCH_ATTR], LayerWatch)
    for _ in range(3):
        lone(torch.randn(4, 8)).sum().backward()
    assert precision_strategy(lone).step == 3 and lone.precision_stats.samples == 4
    # restored: no callbacks left; eval and no_grad calls clear the widths as the hook did
    model.eval()
    with torch.no_grad():
        model(data[0][0])
    assert conv.sample_bits is None
    plain = az.restore_model(model)
    assert not any(WATCH_ATTR in vars(m) for m in plain.modules())


def test_restore_and_reconvert_remove_the_hooks():
    plain = Net()
    before = hook_counts(plain)
    model = az.convert_model(plain, strategy="actnn")
    assert hook_counts(model) != before
    az.convert_model(model, strategy="actnn", bits=3)  # re-conversion: one strategy only
    assert sum(hook_counts(model).values()) == sum(
        hook_counts(az.convert_model(Net(), strategy="actnn")).values())
    restored = az.restore_model(model)
    assert hook_counts(restored) == before
    assert not hasattr(restored, "actnn_zoo_precision")
    assert all(not hasattr(m, "precision_stats") and not hasattr(m, "sample_bits")
               for m in restored.modules())
    train(restored, batches(4, 1))
    uniform = az.convert_model(Net(), strategy="uniform", capture=False)
    assert hook_counts(uniform) == before  # uniform widths need no hooks (capture adds two)


# ----------------------------------------------------------------------------- host syncs
_SYNCING = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
# The one sanctioned read: the per-layer widths of a re-allocation, one step after the
# non-blocking copy that carries them (actnn_zoo/precision/readback.py).
_READBACK = (PRECISION_DIR / "readback.py", "read")


def _caller(depth: int = 2) -> Tuple[Path, str]:
    frame = sys._getframe(depth)
    return Path(frame.f_code.co_filename).resolve(), frame.f_code.co_name


@pytest.fixture
def host_reads(monkeypatch) -> List[str]:
    """Any Tensor -> host read (item/cpu/tolist/numpy/bool/int/float) made by code in
    actnn_zoo/precision raises, except DeferredRead.read, whose calls are listed."""
    sanctioned: List[str] = []
    for name in _SYNCING:
        real = getattr(Tensor, name)

        def guard(self, *args, _real=real, _name=name, **kwargs):
            path, func = _caller()
            if (path, func) == _READBACK:
                sanctioned.append(_name)
            elif path.parent == PRECISION_DIR:
                raise AssertionError(f"Tensor.{_name} called from actnn_zoo/precision "
                                     f"({path.name}, {func})")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Tensor, name, guard)
    return sanctioned


def test_the_per_step_path_reads_nothing_back_to_the_host(host_reads):
    # the guard works: a call made from a file in actnn_zoo/precision is caught
    probe = compile("t.item()", str(PRECISION_DIR / "actnn.py"), "exec")
    with pytest.raises(AssertionError, match="Tensor.item"):
        exec(probe, {"t": torch.ones(())})
    torch.ones(()).item()  # elsewhere it is allowed
    torch.manual_seed(0)
    for cfg, steps, applied in (({"bits": 2, "update_interval": 1}, 5, 3),
                                ({"bits": 1.5, "update_interval": 2}, 5, 2),
                                ({"bits": 2.5, "update_interval": 1,
                                  "rules": [{"name": "fc2", "bits": 8}]}, 6, 4)):
        host_reads.clear()
        model = az.convert_model(Net(), strategy="actnn", **cfg)
        train(model, batches(16, steps))  # per-step widths every step, re-allocations
        strategy = precision_strategy(model)
        assert strategy.step == steps and strategy.updates == applied
        # one read of all the layers' widths per applied re-allocation, none per layer or step
        assert host_reads == ["tolist"] * applied, host_reads


def test_quantize_with_sample_bits_reads_nothing_back_off_cpu():
    """On a device other than the CPU, quantize trusts SampleBits: sizing the buffer and
    checking the widths read no value (meta tensors have none to read; any read raises)."""
    from actnn_zoo.quant.api import _capacity, _row_bits
    from actnn_zoo.quant.reference import row_offsets
    meta = torch.device("meta")
    widths = SampleBits(torch.empty(6, dtype=torch.uint8, device=meta), 15)
    row_bits, uniform = _row_bits(widths, 6, meta)
    assert row_bits is widths.bits and uniform is None
    assert _capacity(widths, row_offsets(100, row_bits), 6, 100) == (100 * 15 + 7 * 6) // 8
    with pytest.raises(RuntimeError, match="meta"):  # a plain widths tensor is read back
        _row_bits(torch.empty(6, dtype=torch.uint8, device=meta), 6, meta)


def test_precision_code_has_no_host_reads():
    """Static check: no .item()/.cpu()/.tolist()/.numpy() call anywhere in actnn_zoo/precision
    but the one in DeferredRead.read (bool()/int()/float() of a tensor are caught at run time
    by the test above)."""
    bad, sanctioned = [], []
    for path in sorted(PRECISION_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
            for node in ast.walk(func or tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("item", "cpu", "tolist", "numpy")):
                    where = f"{path.name}:{node.lineno} .{node.func.attr}()"
                    if func is None:
                        bad.append(where)
                    elif (path, func.name) == _READBACK:
                        sanctioned.append(where)
    bad = sorted(set(bad) - set(sanctioned))
    assert not bad, bad
    assert len(sanctioned) == 1, sanctioned


# ----------------------------------------------------------------------------- layers
def test_every_quantizing_layer_kind_gets_per_sample_widths():
    """Conv, conv-transpose, linear, norms, smooth activations, softmax: the strategy picks
    widths for them at a fractional budget; masks/pooling layers are not watched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                          nn.ConvTranspose2d(4, 4, 2, stride=2), nn.BatchNorm2d(4),
                          nn.Tanh(), nn.Flatten(), nn.LayerNorm(256), nn.Linear(256, 16),
                          nn.Softmax(dim=1))
    model = az.convert_model(model, strategy="actnn", bits=1.5)
    watched = {w.name for w in precision_strategy(model).watched}
    assert watched == {str(i) for i in range(10)} - {"6"}
    x = torch.randn(8, 2, 4, 4)
    for _ in range(3):
        model(x)[:, 0].sum().backward()
    bits = values = 0.0
    for name in watched:
        m = model.get_submodule(name)
        assert m.sample_bits is not None and m.sample_bits.shape == (8,), name
        bits += float(m.sample_bits.bits.double().sum()) * m.precision_stats.numel
        values += 8 * m.precision_stats.numel
    assert 0.95 * 1.5 <= bits / values <= 1.5


def test_unbatched_and_frozen_layers():
    conv = az.convert_model(nn.Conv2d(3, 4, 3), strategy="actnn", bits=1.5)
    conv(torch.randn(3, 6, 6)).sum().backward()  # unbatched: a batch of one
    assert conv.sample_bits.shape == (1,)
    lin = az.convert_model(nn.Linear(8, 2), strategy="actnn", bits=1.5)
    lin.weight.requires_grad_(False)
    lin(torch.randn(4, 8, requires_grad=True)).sum().backward()  # nothing compressed
    assert lin.sample_bits is None and lin.precision_stats.numel == 0


class Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint: its forward (and pre-hooks) run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.utils.checkpoint.checkpoint(self.block, self.stem(x), use_reentrant=False)
        return self.fc(x.mean((2, 3)))


def test_checkpointing_batch_changes_autocast_and_accumulation(monkeypatch):
    """Recomputation, batches of 7 and 1, channels_last, bf16 autocast, an eval forward and two
    accumulated backwards: every step trains, counts once, and stays within the budget."""
    torch.manual_seed(0)
    model = az.convert_model(Checkpointed(), strategy="actnn", bits=1.5, update_interval=1)
    spy = CompressionSpy(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, n in enumerate([16, 16, 16, 7, 16, 1, 16]):
        x, y = torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))
        if i == 4:
            x = x.to(memory_format=torch.channels_last)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 2):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        calls = spy.take()
        # stem, the block's first pass (its saved tensors are dropped), fc, the loss's logits
        # (the converted root's output routes cross_entropy to tier 2, capture/tail.py), the
        # block again (recomputed in backward: these are kept)
        assert [c[0] for c in calls] == [n * 192, n * 512, n * 512, n * 8, n * 10, n * 512,
                                         n * 512]
        kept = [calls[0], calls[3], calls[4], calls[5], calls[6]]
        if i >= 2:  # from step 3 the re-allocation applies
            assert average_bits(kept) <= 1.5 + 1e-9
        if i == 3:
            model.eval()
            model(torch.randn(4, 3, 8, 8))
            model.train()
    for _ in range(2):  # gradient accumulation: two forwards count as two steps
        F.cross_entropy(model(torch.randn(8, 3, 8, 8)), torch.randint(0, 10, (8,))).backward()
    strategy = precision_strategy(model)
    assert strategy.step == 9 and strategy.updates == 7
    assert all(1.0 <= b <= 8.0 for b in strategy.layer_budgets().values())


def test_sample_grad_sq_float64():
    """A float64 model's output gradient: per-sample squared norms in float32, no narrowing
    error from vector_norm (the actnn strategy's gradient hook raised on float64 models)."""
    from actnn_zoo.precision.stats import sample_grad_sq

    g = torch.randn(4, 3, 5, dtype=torch.float64)
    got = sample_grad_sq(g, 4)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), g.reshape(4, -1).square().sum(1), rtol=1e-6)
    assert torch.allclose(sample_grad_sq(g, 1).double(), g.square().sum().reshape(1), rtol=1e-6)


# ----------------------------------------------------------------------------- row layouts
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 2 ** 31 - 1))
def test_row_layout_sums_means_and_spreads_each_layers_rows(sizes, seed):
    """RowLayout: the per-layer sum / mean of stacked rows and the spread back to rows equal
    the same done layer by layer (equal sizes take the reshape path, unequal the grid)."""
    from actnn_zoo.precision.rows import RowLayout
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout(sizes, torch.device("cpu"))
    v = torch.randn(sum(sizes), dtype=torch.float64, generator=g)
    parts = v.split(sizes)
    assert torch.allclose(layout.sum(v), torch.stack([p.sum() for p in parts]), atol=1e-12)
    assert torch.allclose(layout.mean(v), torch.stack([p.mean() for p in parts]), atol=1e-12)
    per = torch.randn(len(sizes), dtype=torch.float64, generator=g)
    assert torch.equal(layout.spread(per),
                       torch.cat([per[i].expand(n) for i, n in enumerate(sizes)]))
    assert layout.layer.tolist() == [i for i, n in enumerate(sizes) for _ in range(n)]


def test_row_layout_rejects_an_empty_layer():
    from actnn_zoo.precision.rows import RowLayout
    with pytest.raises(ValueError, match="a row per layer"):
        RowLayout([3, 0, 2], torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one layer"):
        RowLayout([], torch.device("cpu"))


def test_calibrating_layers_together_equals_one_at_a_time():
    """The re-allocation calibrates all layers in one batch of ops (calibrate_layers); each
    layer's sensitivities and exponent are those it gets calibrated alone (float64, up to
    summation order), also for layers of different batch sizes."""
    from actnn_zoo.precision.actnn import calibrate_layers
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8),
                                           nn.Linear(8, 4)), strategy="actnn", bits=2)
    watched = precision_strategy(model).watched
    g = torch.Generator().manual_seed(3)
    for w, n, slope in zip(watched, (5, 12, 7), (0.0, -1.0, -0.5)):
        r = torch.exp(torch.randn(n, generator=g) * 2)
        w.stats.range_sq = r.float()
        w.stats.sample_grad_sq = (r ** slope * torch.exp(torch.randn(n, generator=g) * 0.1)
                                  ).float()
        w.stats.samples, w.stats.numel = n, 32
    alone, exps = [], []
    for w in watched:
        alone.append(w.calibrate(torch.device("cpu")))
        exps.append(float(w.exponent))
    layout = precision_strategy(model).layouts.get((5, 12, 7), torch.device("cpu"))
    together = calibrate_layers(watched, layout)
    assert torch.allclose(together, torch.cat(alone), rtol=1e-12, atol=0)
    assert [float(w.exponent) for w in watched] == pytest.approx(exps, abs=1e-6)
    assert exps[0] == pytest.approx(1.0, abs=0.05) and exps[1] == pytest.approx(0.0, abs=0.05)
