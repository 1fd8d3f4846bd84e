"""Issue 11's fidelity cases at 2 bits, on whole converted models (default strategy, capture on):

* a small CNN whose late stage is a 3x3 map, channels of scales spread over 1e-3..1e3 in front
  of every BatchNorm, batch 4 (a 256-value group mixes ~28 channels there);
* a pre-norm transformer whose residual stream has 4 features 100x the rest (what LayerNorm
  sees), batch 4 x 16 tokens.

Each: every norm's input gradient follows fp32's (cosine with the exact fp32 gradient at the same
weights, one draw), 20 SGD steps stay finite with the gradient norm within 10x the exact one, and
the Linear/Conv weight gradients are unbiased (mean of K draws). The CNN runs the 2-bit default;
the transformer needs ``transform: hadamard`` for the first (its final LayerNorm saves a
normalized input whose 4 outlier features set every group's step: cosine 0.855 without the
transform, 0.988 with it, measured; the default's figure has a lower bound below)."""
from __future__ import annotations

import copy
import math
import warnings
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az


# tiny ops: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


class Scale(nn.Module):
    def __init__(self, scale: Tensor, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        shape = [1] * x.dim()
        shape[self.dim] = -1
        return x * self.scale.view(shape)


def _scales(c: int, seed: int) -> Tensor:
    order = torch.randperm(c, generator=torch.Generator().manual_seed(seed))
    return torch.logspace(-3, 3, c)[order]


def scaled_cnn() -> nn.Module:
    """12x12 -> 6x6 -> 3x3 (two BatchNorms on the 3x3 map)."""
    layers: List[nn.Module] = []
    for i, (cin, cout, stride) in enumerate([(3, 32, 1), (32, 64, 2), (64, 64, 2), (64, 64, 1)]):
        layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), Scale(_scales(cout, i), 1),
                   nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc1, self.fc2, self.act = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class OutlierTransformer(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 64) -> None:
        super().__init__()
        s = torch.ones(d)
        s[torch.randperm(d, generator=torch.Generator().manual_seed(7))[:4]] = 100.0
        self.embed, self.outliers = nn.Embedding(vocab, d), Scale(s, -1)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, t: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.outliers(self.embed(t)))))


def _batch(name: str, seed: int) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "cnn":
        return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)
    t = torch.randint(0, 50, (4, 17), generator=g)
    return t[:, :-1], t[:, 1:]


BUILD = {"cnn": (scaled_cnn, nn.BatchNorm2d, {"bits": 2}),  # the 2-bit default
         "transformer": (OutlierTransformer, nn.LayerNorm, {"bits": 2, "transform": "hadamard"})}


def _pair(name: str, config=None):
    torch.manual_seed(0)
    ref = BUILD[name][0]().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = az.convert_model(copy.deepcopy(ref), dict(BUILD[name][2] if config is None
                                                      else config))
    return ref, q


def _run(model: nn.Module, x: Tensor, y: Tensor, norm_type: type
         ) -> Tuple[Tensor, Dict[str, Tensor], Dict[str, Tensor]]:
    """Loss, then the gradient of every norm's input and of every Linear/Conv weight."""
    inputs: Dict[str, Tensor] = {}

    def keep(name):
        def hook(_m, args):
            args[0].retain_grad()
            inputs[name] = args[0]
        return hook

    handles = [m.register_forward_pre_hook(keep(n)) for n, m in model.named_modules()
               if isinstance(m, norm_type)]
    model.zero_grad(set_to_none=True)
    with az.capturing(model) if "actnn_zoo_capture" in vars(model) else torch.enable_grad():
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    for h in handles:
        h.remove()
    weights = {n: m.weight.grad.clone() for n, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Conv2d))}
    return loss.detach(), {n: t.grad.clone() for n, t in inputs.items()}, weights


def _cos(a: Tensor, b: Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("name", list(BUILD))
def test_norm_input_gradients_follow_fp32_at_two_bits(name):
    """One 2-bit draw: every norm's input-gradient cosine with exact fp32 >= 0.9 in each of 3
    draws (measured minima: CNN 0.942, transformer with the transform 0.988)."""
    ref, q = _pair(name)
    norm_type = BUILD[name][1]
    x, y = _batch(name, 1)
    _, exact, _ = _run(ref, x, y, norm_type)
    assert len(exact) >= 4
    worst = []
    for seed in range(3):
        torch.manual_seed(seed)
        _, got, _ = _run(q, x, y, norm_type)
        worst.append(min(_cos(got[k], exact[k]) for k in exact))
    assert min(worst) >= 0.9, worst


def test_outlier_transformer_without_the_transform_is_what_the_transform_fixes():
    """The 2-bit default without the transform still follows fp32 (measured cosine 0.855-0.868
    over 3 draws, below the transform's 0.988: the outlier features, not the norms' backward,
    limit it). A lower bound only: a better default must not fail the test."""
    ref, q = _pair("transformer", {"bits": 2})
    x, y = _batch("transformer", 1)
    _, exact, _ = _run(ref, x, y, nn.LayerNorm)
    torch.manual_seed(0)
    _, got, _ = _run(q, x, y, nn.LayerNorm)
    worst = min(_cos(got[k], exact[k]) for k in exact)
    assert worst > 0.7, worst


@pytest.mark.parametrize("name", list(BUILD))
def test_twenty_sgd_steps_without_divergence(name):
    """20 SGD steps (lr 0.05, momentum 0.9) at 2 bits: every loss and gradient finite, the
    gradient norm within 10x the exact fp32 gradient at the same weights, and the final loss
    within 20% of the fp32 run's."""
    ref, q = _pair(name)
    twin = copy.deepcopy(ref)
    norm_type = BUILD[name][1]
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_q = torch.optim.SGD(q.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        x, y = _batch(name, 100 + step % 4)
        loss_r, _, _ = _run(ref, x, y, norm_type)
        opt_r.step()
        twin.load_state_dict(q.state_dict())
        _run(twin, x, y, norm_type)
        exact = torch.cat([p.grad.flatten() for p in twin.parameters() if p.grad is not None])
        loss_q, _, _ = _run(q, x, y, norm_type)
        got = torch.cat([p.grad.flatten() for p in q.parameters() if p.grad is not None])
        assert math.isfinite(float(loss_q)) and bool(torch.isfinite(got).all()), step
        assert float(got.norm()) < 10 * float(exact.norm()), step
        opt_q.step()
    assert float(loss_q) < 1.2 * float(loss_r) + 0.05, (float(loss_q), float(loss_r))


@pytest.mark.parametrize("name", list(BUILD))
def test_weight_gradients_unbiased(name):
    """K = 16 draws at fixed weights and batch, every Linear/Conv weight gradient. Unbiased
    means the error of the K-draw mean is noise: its norm is within 1.5x of what noise alone
    gives, RMS(single-draw error) / sqrt(K) (measured about 1.0 for every layer at K = 24). A
    bias of more than ~0.3 of one draw's RMS error would fail. (An element-wise t-test is not used:
    2-bit codes of near-constant groups give sample deviations that understate the spread.)"""
    ref, q = _pair(name)
    norm_type = BUILD[name][1]
    x, y = _batch(name, 1)
    _, _, exact = _run(ref, x, y, norm_type)
    k = 16
    draws: Dict[str, List[Tensor]] = {n: [] for n in exact}
    for seed in range(k):
        torch.manual_seed(1000 + seed)
        _, _, w = _run(q, x, y, norm_type)
        for n in exact:
            draws[n].append(w[n])
    for n, e in exact.items():
        err = torch.stack(draws[n]) - e
        noise = float(err.flatten(1).norm(dim=1).pow(2).mean().sqrt()) / math.sqrt(k)
        bias = float(err.mean(0).norm())
        assert bias < 1.5 * noise, (n, bias / noise)
