"""The actnn strategy makes an activation's f'(x) to choose its per-sample widths; the layer
then uses that tensor instead of computing f'(x) again, and a large f'(x) is never made whole
by the strategy (the layer's Function makes it in chunks, precision/stats.saved_statistic)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import actnn_zoo as az
from actnn_zoo.functional import _saving
from actnn_zoo.precision.base import ThreadWidths
from actnn_zoo.precision.stats import layer_kind, range_statistic, saved_statistic

aten = torch.ops.aten
# the exact GELU's f'(x) on the CPU: the out= overload, written over a dense unit gradient
GELU_DERIVATIVE = aten.gelu_backward.grad_input
ACTS = [(nn.GELU, GELU_DERIVATIVE), (nn.SiLU, aten.silu_backward.default),
        (nn.Sigmoid, aten.sigmoid_backward.default), (nn.Tanh, aten.tanh_backward.default),
        (nn.ELU, aten.elu_backward.default), (nn.Softplus, aten.softplus_backward.default)]


class _Outputs(TorchDispatchMode):
    """Records the number of values of every output of ``op``."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.sizes = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.sizes.append(out.numel())
        return out


def _model(act: type) -> nn.Module:
    torch.manual_seed(0)
    # a 2.5-bit budget is no width of its own: every layer gets per-sample widths
    return az.convert_model(nn.Sequential(nn.Linear(16, 64), act(), nn.Linear(64, 4)),
                            bits=2.5, strategy="actnn")


def _step(model: nn.Module, op) -> tuple:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 16, generator=g) * torch.linspace(0.1, 10, 8)[:, None]).requires_grad_()
    torch.manual_seed(2)
    with _Outputs(op) as seen:
        out = model(x)
    out.square().sum().backward()
    return seen.sizes, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("act,op", ACTS, ids=[a.__name__ for a, _ in ACTS])
def test_the_layer_uses_the_strategys_derivative(act, op, monkeypatch):
    model = _model(act)
    assert model[1].__class__.__name__ == "Q" + act.__name__
    twin = copy.deepcopy(model)
    sizes, gx, gp = _step(model, op)
    assert sizes == [8 * 64]  # made once, by the strategy's pre-hook

    # without the hand-off the Function makes it again: the same values, so the same codes
    monkeypatch.setattr(ThreadWidths, "hand_derivative", lambda self, x, d: None)
    sizes2, gx2, gp2 = _step(twin, op)
    assert sizes2 == [8 * 64, 8 * 64]
    assert torch.equal(gx, gx2)
    for a, b in zip(gp, gp2):
        assert torch.equal(a, b)
    assert model[1].sample_bits is not None  # per-sample widths were in use


def test_a_large_derivative_is_not_made_whole(monkeypatch):
    """Above the produce chunk size the strategy makes f'(x) a chunk of samples at a time, as
    the Function does: no full-size f'(x) exists in the forward, and the statistic is the
    whole one."""
    monkeypatch.setattr(_saving, "PRODUCE_CHUNK_BYTES", 4 * 64 * 2)  # 2 samples of 64
    model = _model(nn.GELU)
    sizes, _, _ = _step(model, GELU_DERIVATIVE)
    assert max(sizes) < 8 * 64 and sum(sizes) == 2 * 8 * 64  # strategy and Function, chunked

    x = torch.randn(40, 64)
    kind = layer_kind(model[1])
    score, made = saved_statistic(kind, model[1], x, 256)
    assert made is None
    whole = range_statistic(aten.gelu_backward(torch.ones_like(x), x), 256)
    assert torch.equal(score, whole)


def test_the_hand_off_is_for_one_tensor_at_one_version():
    slot = ThreadWidths()
    x, other, d = torch.randn(3), torch.randn(3), torch.randn(3)
    slot.hand_derivative(x, d)
    assert slot.take_derivative(other) is None
    assert slot.take_derivative(x) is None  # taken (and dropped) by the mismatch
    slot.hand_derivative(x, d)
    assert slot.take_derivative(x) is d
    assert slot.take_derivative(x) is None  # once
    slot.hand_derivative(x, d)
    x.add_(1.0)  # changed since it was made
    assert slot.take_derivative(x) is None
    slot.hand_derivative(x, d)
    slot.hand_derivative(x, None)  # withdrawn
    assert slot.take_derivative(x) is None


def test_acgc_hands_its_derivative_on_too(monkeypatch):
    """The acgc strategy computes f'(x) on its recording steps for the same reason: the layer
    takes it there as well (one derivative per forward), with the same gradients."""
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)),
                             strategy="acgc")
    twin = copy.deepcopy(model)
    sizes, gx, gp = _step(model, GELU_DERIVATIVE)
    assert sizes == [8 * 64]  # the first step records
    monkeypatch.setattr(ThreadWidths, "hand_derivative", lambda self, x, d: None)
    sizes2, gx2, gp2 = _step(twin, GELU_DERIVATIVE)
    assert sizes2 == [8 * 64, 8 * 64]
    assert torch.equal(gx, gx2)
    for a, b in zip(gp, gp2):
        assert torch.equal(a, b)


def test_fused_width_choice_equals_the_three_steps(monkeypatch):
    """Every kind chooses its per-sample widths in one compiled call on the CPU
    (``_C.choose_widths``: the range statistic of the tensor it compresses, its power, the
    widths): conv and linear on their input, an activation on the f'(x) it then hands to the
    layer, a layer norm on its normalised input. Over steps past the first re-allocations (a
    refitted exponent) the widths, hence codes and gradients, are those of the three separate
    steps, bit for bit."""
    import actnn_zoo.precision.actnn as A
    if A._CHOOSE is None:
        pytest.skip("no compiled extension")
    calls = []
    real = A._CHOOSE
    monkeypatch.setattr(A, "_CHOOSE",
                        lambda *a: calls.append((tuple(a[0].shape), a[2] is not None))
                        or real(*a))
    watched = (0, 3, 4, 5, 6)

    def run(fused: bool) -> list:
        if not fused:
            monkeypatch.setattr(A, "_CHOOSE", None)
        torch.manual_seed(0)
        model = az.convert_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(),
                                               nn.Linear(8 * 36, 32), nn.GELU(),
                                               nn.LayerNorm(32), nn.Linear(32, 5)),
                                 bits=2.5, strategy="actnn", update_interval=3)
        g = torch.Generator().manual_seed(1)
        out = []
        for step in range(8):
            x = torch.randn(6, 3, 8, 8, generator=g) * torch.linspace(0.1, 5, 6)[:, None, None,
                                                                                None]
            torch.manual_seed(100 + step)
            model(x).square().sum().backward()
            out += [p.grad.clone() for p in model.parameters()]
            out += [model[i].precision_stats.bits.clone() for i in watched]
            model.zero_grad()
        return out
    fused = run(True)
    # every watched layer, every step; a fitted exponent later; the GELU and the norm too
    assert len(calls) == 8 * len(watched) and any(fitted for _, fitted in calls)
    assert sum(shape == (6, 32) for shape, _ in calls) == 8 * 3  # linear 2's input, GELU, norm
    plain = run(False)
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
