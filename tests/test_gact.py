"""strategy: gact -- the greedy solver (against brute force), the probe's sensitivities, the
budget on a real model, configuration, side effects of the probe and training."""
from __future__ import annotations

import itertools
import math
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.config import QuantConfig
from actnn_zoo.convert import precision_strategy
from actnn_zoo.precision import STRATEGY_CLASSES, GACTStrategy, greedy_widths
from actnn_zoo.memory import saved_activation_bytes
from actnn_zoo.precision.gact import convex_one_bit, variance_cost
from actnn_zoo.precision import readback

from _spy import CompressionSpy  # tests/_spy.py

WIDTHS = (1, 2, 4, 8)


def brute_force(score: List[float], size: List[float], allowed: float,
                one_bit=None) -> float:
    """Exact minimum of sum C / (2^b - 1)^2 (1-bit variances ``one_bit`` where given) with
    sum size * b <= allowed."""
    best = math.inf
    for combo in itertools.product(WIDTHS, repeat=len(score)):
        if sum(n * b for n, b in zip(size, combo)) <= allowed * (1 + 1e-12):
            best = min(best, variance_cost(score, combo, one_bit))
    return best


class Net(nn.Module):
    """Conv, BN, ReLU, pool, linear, GELU, linear: every kind the probe attributes."""

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
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        return self.fc2(self.drop(self.act(self.fc1(x.flatten(1)))))


def problem(n: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """A learnable task: the label is the quadrant with the largest mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    quad = torch.stack([x[:, 0, :4, :4].mean((1, 2)), x[:, 0, :4, 4:].mean((1, 2)),
                        x[:, 0, 4:, :4].mean((1, 2)), x[:, 0, 4:, 4:].mean((1, 2))], 1)
    return x, quad.argmax(1)


def train(model: nn.Module, steps: int, n: int = 32, lr: float = 0.05) -> List[float]:
    x, y = problem(256)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for i in range(steps):
        j = (i * n) % 256
        opt.zero_grad()
        loss = F.cross_entropy(model(x[j:j + n]), y[j:j + n])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ----------------------------------------------------------------------------- solver
@settings(max_examples=80, deadline=None)
@given(items=st.lists(st.tuples(st.floats(0.0, 1e3), st.integers(1, 20)), min_size=1,
                      max_size=5),
       budget=st.floats(1.0, 8.0))
def test_greedy_is_optimal_for_what_it_spends_and_meets_the_budget(items, budget):
    score = [c for c, _ in items]
    size = [float(n) for _, n in items]
    allowed = budget * sum(size)
    plain = greedy_widths(score, size, budget, fill=False)
    filled = greedy_widths(score, size, budget)
    for bits in (plain, filled):
        assert set(bits) <= set(WIDTHS)
        assert sum(n * b for n, b in zip(size, bits)) <= allowed * (1 + 1e-9)
    # the heap greedy is a Lagrangian optimum: optimal among allocations spending <= its spend
    spent = sum(n * b for n, b in zip(size, plain))
    assert variance_cost(score, plain) <= brute_force(score, size, spent) * (1 + 1e-9) + 1e-12
    # the fill only adds bits where they fit, so it never does worse
    assert variance_cost(score, filled) <= variance_cost(score, plain) * (1 + 1e-12) + 1e-15


@settings(max_examples=40, deadline=None)
@given(score=st.lists(st.floats(0.0, 1e3), min_size=1, max_size=5), budget=st.floats(1.0, 8.0))
def test_greedy_with_equal_sizes_matches_brute_force_within_one_step(score, budget):
    """Equal sizes (ActNN's per-sample problem): the filled greedy is as good as the optimum
    with one upgrade (4 bits) less."""
    size = [1.0] * len(score)
    bits = greedy_widths(score, size, budget)
    allowed = budget * len(score)
    assert variance_cost(score, bits) <= brute_force(score, size, allowed - 4) * (1 + 1e-9)
    assert variance_cost(score, bits) >= brute_force(score, size, allowed) * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.tuples(st.floats(0.0, 1e3), st.integers(1, 20), st.floats(1.0, 60.0)),
                      min_size=1, max_size=5),
       budget=st.floats(1.0, 8.0))
def test_greedy_with_measured_one_bit_variances(items, budget):
    """Measured 1-bit variances (a norm's is 12-45x its 2-bit one, not the model's 9x): the
    greedy stays a Lagrangian optimum once each is made convex with the chain."""
    score = [c for c, _, _ in items]
    size = [float(n) for _, n, _ in items]
    ones = [convex_one_bit(c, c * r / 9.0) for c, _, r in items]  # V(1) = r V(2)
    plain = greedy_widths(score, size, budget, fill=False, one_bit=ones)
    filled = greedy_widths(score, size, budget, one_bit=ones)
    assert sum(n * b for n, b in zip(size, filled)) <= budget * sum(size) * (1 + 1e-9)
    spent = sum(n * b for n, b in zip(size, plain))
    best = brute_force(score, size, spent, ones)
    assert variance_cost(score, plain, ones) <= best * (1 + 1e-9) + 1e-12
    assert variance_cost(score, filled, ones) <= variance_cost(score, plain, ones) * (1 + 1e-12) \
        + 1e-15


def test_greedy_edges():
    assert greedy_widths([], [], 2.0) == []
    assert greedy_widths([5.0, 1.0], [10.0, 10.0], 8.0) == [8, 8]
    assert greedy_widths([5.0, 1.0], [10.0, 10.0], 1.0) == [1, 1]
    assert greedy_widths([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 2.0) == [2, 2, 2]
    # the sensitive item keeps more bits; the small one is cheap to keep wide
    assert greedy_widths([100.0, 1.0], [10.0, 10.0], 3.0) == [4, 2]
    assert greedy_widths([1.0, 1.0], [1.0, 100.0], 2.0)[0] >= 4
    with pytest.raises(ValueError, match="entries"):
        greedy_widths([1.0], [1.0, 2.0], 2.0)


# ----------------------------------------------------------------------------- config
def test_yaml_selects_gact_and_bad_values_name_the_key(tmp_path):
    assert STRATEGY_CLASSES["gact"] is GACTStrategy
    path = tmp_path / "gact.yaml"
    path.write_text("strategy: gact\nbits: 1.5\nupdate_interval: 50\n")
    model = az.convert_model(Net(), path)
    s = precision_strategy(model)
    assert isinstance(s, GACTStrategy) and s.budget == 1.5 and s.update_interval == 50
    for text, key in (("strategy: gact\nbits: 9\n", "bits"),
                      ("strategy: gact\nupdate_interval: 0\n", "update_interval"),
                      ("strategy: gcat\n", "strategy")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=key):
            QuantConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="estimator"):
        GACTStrategy(QuantConfig(strategy="gact"), estimator="exact")


# ----------------------------------------------------------------------------- budget
@pytest.mark.parametrize("budget", [1.5, 2, 3])
def test_allocation_meets_the_budget(monkeypatch, budget):
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="gact", bits=budget, update_interval=2,
                             capture=False)
    spy = CompressionSpy(monkeypatch)
    x, y = problem(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    realised = []
    for step in range(7):
        opt.zero_grad()
        spy.calls = []
        F.cross_entropy(model(x), y).backward()
        opt.step()
        # the probes' own forwards run in the pre-hook, before this step's: the last 6 calls
        # (conv1, bn1, conv2, bn2, fc1, gelu, fc2 minus ...) are this step's forward
        calls = spy.calls[-7:]
        realised.append(sum(c[1] for c in calls) / sum(c[0] for c in calls))
    s = precision_strategy(model)
    assert s.updates >= 2
    assert all(r <= budget + 1e-9 for r in realised[2:]), realised
    widths = set(s.layer_budgets().values())
    assert widths <= {1.0, 2.0, 4.0, 8.0}
    assert s.report()["average_bits"] <= budget + 1e-9


# ----------------------------------------------------------------------------- sensitivity
class TwoHeads(nn.Module):
    """Two linear heads on the same input; the loss weighs head b 30x: its weight gradient,
    and the noise its saved input adds there, is 30x larger."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 8)
        self.b = nn.Linear(256, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.a(x), 30.0 * self.b(x)], 1)


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("estimator", ["hybrid", "joint", "per_tensor"])
def test_sensitivities_are_positive_and_ordered(estimator, capture):
    """Inside a capture session too: the rounding seeds come from the session's stream there,
    which the probe must re-key per layer (re-seeding torch's generator alone left every
    conv / linear sensitivity at exactly 0)."""
    torch.manual_seed(0)
    model = az.convert_model(TwoHeads(), strategy="gact", bits=3, capture=capture)
    s = precision_strategy(model)
    s.estimator = estimator
    x = torch.randn(32, 256)
    for _ in range(3):
        model(x).square().sum().backward()
    c = s.sensitivities()
    if capture and estimator == "per_tensor":
        # one payload, compressed by a (first): re-seeding a alone moves both gradients (its
        # pass carries the tensor's whole variance), b alone changes nothing; the solve adds
        # them up for the one width
        assert c["a"] > 0 and c["b"] == 0
    else:
        assert c["a"] > 0 and c["b"] > 0
        assert c["b"] > 100 * c["a"], c  # 30^2 = 900 in expectation
    if capture:  # both read x: the store keeps one payload at one width
        assert s.layer_budgets()["b"] == s.layer_budgets()["a"]
    else:
        assert s.layer_budgets()["b"] > s.layer_budgets()["a"]
    # hybrid, joint: reference + conv/linear re-seeded (no other kinds here); per tensor: 1 + 2
    assert s.report()["passes_per_probe"] == (3 if estimator == "per_tensor" else 2)


def test_joint_and_per_tensor_estimates_agree_on_a_cnn():
    """On Net the joint estimate (3 passes) ranks the tensors like GACT's per-tensor one
    (1 + 7 passes), averaged over a few probes each."""
    from scipy.stats import spearmanr

    torch.manual_seed(0)
    est = {}
    for estimator in ("joint", "per_tensor"):
        torch.manual_seed(1)
        model = az.convert_model(Net(), strategy="gact", bits=2, capture=False)
        model.drop.p = 0.0
        s = precision_strategy(model)
        s.estimator, s.probe_repeats, s.probe_samples = estimator, 4, 16
        x, y = problem(16)
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
        est[estimator] = s.sensitivities()
    names = sorted(est["joint"])
    rho = spearmanr([est["joint"][n] for n in names], [est["per_tensor"][n] for n in names])[0]
    assert rho > 0.6, (rho, est)
    # conv / linear tensors: the joint estimate is GACT's (exact split), up to sampling noise
    for n in ("conv1", "conv2", "fc1", "fc2"):
        assert est["joint"][n] == pytest.approx(est["per_tensor"][n], rel=0.5), n


def test_probe_leaves_no_trace():
    """The probe restores BN running statistics and the RNG stream, and does not touch .grad;
    it runs only on update steps; sensitivities reach the host one read per update."""
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="gact", bits=2, update_interval=3)
    s = precision_strategy(model)
    x, y = problem(16)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    state = torch.get_rng_state()
    s.probe(model)  # what step 2's pre-hook runs
    # hybrid: reference, conv / linear re-seeded, then per other tensor (bn1, bn2, gelu) one
    # pass at its width, and for gelu two at 1 bit (norms do not go to 1 bit)
    assert s.probes == 1 and s.probe_passes == 2 + 3 + 2
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert torch.equal(state, torch.get_rng_state())


def test_update_schedule_and_one_read_per_update(monkeypatch):
    reads = []
    real = readback.DeferredRead.read

    def counted(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(readback.DeferredRead, "read", counted)
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="gact", bits=2, update_interval=4)
    train(model, 11, n=16)
    s = precision_strategy(model)
    # probes at steps 2, 6, 10; applied at 3, 7, 11
    assert s.step == 11 and s.probes == 3 and s.updates == 3 and len(reads) == 3
    model.eval()
    with torch.no_grad():
        model(problem(4)[0])
    assert s.step == 11


def test_converted_model_trains():
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="gact", bits=2, update_interval=10)
    losses = train(model, 60)
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10, losses
    assert precision_strategy(model).updates >= 5


def test_deepcopy_and_restore():
    import copy

    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="gact", bits=2, update_interval=2)
    train(model, 3, n=8)
    twin = copy.deepcopy(model)
    train(twin, 3, n=8)
    assert precision_strategy(model).step == 3 and precision_strategy(twin).step == 6
    plain = az.restore_model(model)
    assert not any(m._forward_pre_hooks for m in plain.modules())


# ----------------------------------------------------------------------------- bytes
class Shared(nn.Module):
    """conv-BN-ReLU, then two convs reading the ReLU output (stored once, as sparse codes:
    the mask plus codes of its nonzeros), the second weighted 8x so that widths differ."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu(self.bn0(self.conv0(x)))
        y = self.bn1(self.a(h) + 8.0 * self.b(h))
        return self.fc(y.mean((2, 3)))


def test_budget_counts_bytes_shared_and_sparse_payloads():
    """A tensor two convs save is one payload at one width and counts once; a ReLU output's
    sparse codes cost its nonzeros; the saved bytes (codes and metadata, what autograd and the
    store keep) at a 3-bit budget stay within the mean of uniform 2 and 4 bits' on the same
    weights (bytes are linear in the width: codes, plus metadata that does not depend on it)."""
    torch.manual_seed(0)
    x, y = problem(64)
    model = az.convert_model(Shared(), strategy="gact", bits=3, update_interval=2)
    s = precision_strategy(model)
    s.min_gain = 0.0  # apply whatever the model predicts, to exercise the accounting
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    layers = {w.name: w for w in s.layers_}
    assert layers["b"].leader == layers["a"].index and layers["a"].leader is None
    assert layers["a"].width == layers["b"].width
    assert 0.2 < layers["a"].density < 0.8  # about half the ReLU output is zero
    assert layers["bn0"].density == 1.0
    assert len(set(s.layer_budgets().values())) > 1, s.layer_budgets()  # not uniform
    plain = az.restore_model(__import__("copy").deepcopy(model))
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    got = saved_activation_bytes(model, x, loss_fn=loss, warmup=1).total_bytes
    ref = sum(saved_activation_bytes(az.convert_model(__import__("copy").deepcopy(plain),
                                                      strategy="uniform", bits=b), x,
                                     loss_fn=loss, warmup=1).total_bytes for b in (2, 4)) / 2
    # the budget is exact in values; rows round up to whole bytes and the nonzero fraction is
    # measured on the probe's 8 samples: 1% slack
    assert got <= ref * 1.01, (got, ref, s.layer_budgets())
    assert s.report()["average_bits"] <= 3.0 + 1e-9


def test_no_predicted_gain_keeps_uniform_widths():
    """Two like heads: no allocation beats uniform 2 bits by ``min_gain``, so the widths stay
    there (the byte test above, with ``min_gain`` 0, moves them)."""
    torch.manual_seed(0)

    class Twins(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(256, 8)
            self.b = nn.Linear(256, 8)

        def forward(self, x: Tensor) -> Tensor:
            return torch.cat([self.a(x), self.b(x.flip(1))], 1)

    model = az.convert_model(Twins(), strategy="gact", bits=2, capture=False)
    s = precision_strategy(model)
    x = torch.randn(32, 256)
    for _ in range(3):
        model(x).square().sum().backward()
    assert set(s.layer_budgets().values()) == {2.0}
    assert s.predicted_ratio is not None and s.predicted_ratio > 1.0 - s.min_gain


def test_detach_restores_the_configured_widths():
    """GACT sets widths through each layer's qconfig; detaching puts the configured one back."""
    torch.manual_seed(0)
    model = az.convert_model(TwoHeads(), strategy="gact", bits=3, capture=False)
    orig = {n: model.get_submodule(n).qconfig for n in ("a", "b")}
    x = torch.randn(32, 256)
    for _ in range(3):
        model(x).square().sum().backward()
    assert any(model.get_submodule(n).qconfig.bits != orig[n].bits for n in orig)
    precision_strategy(model).detach()
    assert all(model.get_submodule(n).qconfig is orig[n] for n in orig)
