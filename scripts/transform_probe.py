#!/usr/bin/env python
"""Where does the Hadamard transform help? One-step 2-bit gradient cosine against exact fp32.

    PYTHONPATH=. .venv/bin/python scripts/transform_probe.py --draws 8

Two models built to have the failure modes of issue 11 (random init, no training):

* ``cnn``: a small CNN whose late stage is a 3x3 map, with fixed per-channel scales spread over
  1e-3..1e3 in front of its BatchNorms, batch 4 (groups of 256 span ~28 channels there).
* ``transformer``: two pre-norm encoder blocks (LayerNorm, attention, MLP) of width 128 whose
  residual stream has 4 features 100x the rest, batch 4 x 32 tokens.

For each placement of ``transform: hadamard`` (nowhere, every layer, Linear layers only,
Conv layers only, norms only) it converts a copy, draws ``--draws`` compressed backward passes
at the same weights and batch, and prints the mean and standard error of the cosine (and norm
ratio) of the full parameter gradient with the exact fp32 one.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import actnn_zoo as az  # noqa: E402


class ChannelScale(nn.Module):
    """Multiplies channel (dim 1) or feature (last dim) i by a fixed scale: the mixed-scale
    activations the issue describes, reproducible at random init."""

    def __init__(self, scale: Tensor, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        shape = [1] * x.dim()
        shape[self.dim] = -1
        return x * self.scale.view(shape)


def channel_scales(c: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.logspace(-3, 3, c)[torch.randperm(c, generator=g)]


def scaled_cnn(classes: int = 10) -> nn.Module:
    """12x12 input -> 6x6 -> 3x3 late stage; scales before each BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), ChannelScale(channel_scales(32, 1), 1), nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), ChannelScale(channel_scales(64, 2), 1),
        nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), ChannelScale(channel_scales(64, 3), 1),
        nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), ChannelScale(channel_scales(64, 4), 1),
        nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def outlier_scale(d: int, count: int = 4, factor: float = 100.0) -> Tensor:
    s = torch.ones(d)
    s[torch.randperm(d, generator=torch.Generator().manual_seed(7))[:count]] = factor
    return s


class Block(nn.Module):
    """Pre-norm encoder block; the residual stream carries the outlier features."""

    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class OutlierTransformer(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.outliers = ChannelScale(outlier_scale(d), -1)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, t: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.outliers(self.embed(t)))))


def batch(name: str, seed: int = 1) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "cnn":
        return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)
    t = torch.randint(0, 100, (4, 33), generator=g)
    return t[:, :-1], t[:, 1:]


BUILD = {"cnn": scaled_cnn, "transformer": OutlierTransformer}
PLACEMENTS: Dict[str, dict] = {
    "none": {},
    "all": {"transform": "hadamard"},
    "linear": {"rules": [{"type": ["Linear", "NonDynamicallyQuantizableLinear"],
                          "transform": "hadamard"}]},
    "conv": {"rules": [{"type": "Conv2d", "transform": "hadamard"}]},
    "norms": {"rules": [{"type": ["BatchNorm2d", "LayerNorm"], "transform": "hadamard"}]},
}


def grads(model: nn.Module, x: Tensor, y: Tensor, capture: bool) -> Tuple[Tensor, Tensor]:
    model.zero_grad(set_to_none=True)
    inp = x.float().requires_grad_() if x.is_floating_point() else x
    with az.capturing(model) if capture else _Nothing():
        out = model(inp)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                   for p in model.parameters()])
    gi = inp.grad.flatten() if x.is_floating_point() else torch.zeros(1)
    return g, gi


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def cos(a: Tensor, b: Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def probe(name: str, placement: str, draws: int, base: dict) -> Dict[str, float]:
    torch.manual_seed(0)
    ref = BUILD[name]().train()
    x, y = batch(name)
    exact, _ = grads(ref, x, y, capture=False)
    cfg = dict(base)
    cfg.update(copy.deepcopy(PLACEMENTS[placement]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = az.convert_model(copy.deepcopy(ref), cfg)
    cs, rs = [], []
    for k in range(draws):
        torch.manual_seed(100 + k)
        g, _ = grads(q, x, y, capture=True)
        cs.append(cos(g, exact))
        rs.append(float(g.norm() / exact.norm()))
    se = lambda v: float(torch.tensor(v).std() / math.sqrt(len(v))) if len(v) > 1 else 0.0  # noqa
    out = {"cos": sum(cs) / draws, "cos_se": se(cs), "norm_ratio": sum(rs) / draws}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=8)
    p.add_argument("--models", nargs="+", default=list(BUILD))
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS))
    p.add_argument("--strategy", default=None, help="default: the config default (actnn)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = {"bits": 2}
    if args.strategy:
        base["strategy"] = args.strategy
    print(f"2-bit one-step gradient cosine vs exact fp32, mean of {args.draws} draws "
          f"(+- standard error), strategy {args.strategy or 'default'}")
    for name in args.models:
        for placement in args.placements:
            r = probe(name, placement, args.draws, base)
            print(f"{name:12s} transform on {placement:7s}: grad cos {r['cos']:.4f} "
                  f"+- {r['cos_se']:.4f}  norm ratio {r['norm_ratio']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
