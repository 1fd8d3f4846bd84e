#!/usr/bin/env python
"""The fixed cost of one Q-layer call: forward + backward of a single layer at batch 1 (tiny
tensors, so the arithmetic is negligible and what is left is Python and dispatch), against the
torch layer, in microseconds per call. Three ways to run the Q-layer: converted with capture
(what ``convert_model`` gives: the session, the store, ReLU codes), converted without capture
(``capture: false``), and the 2-bit default strategy (``actnn``, per-sample widths).

Thread CPU time of one torch thread, all variants timed round-robin in one process
(``actnn_zoo.bench.interleaved_step_times``). Per call the minimum by default: a fixed cost is
what a call takes when nothing interrupts it, and on a shared machine interruptions only add
(``--stat median`` for the median). E.g.
    .venv/bin/python scripts/bench_layer_overhead.py
    .venv/bin/python scripts/bench_layer_overhead.py --layers conv,bn --calls 400
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402
from torch import nn  # noqa: E402

from actnn_zoo import convert_model  # noqa: E402
from actnn_zoo.bench import interleaved_step_times  # noqa: E402
from actnn_zoo.quant.backend import kernels  # noqa: E402

class _SelfAttention(nn.Module):
    """Causal self-attention with dropout, q = k = v = the input split into heads and
    transposed, as transformers pass them (GPT-2's layout and sizes: 4 heads of 16): what tier
    2 routes to the zoo's attention. Keeps the input's shape, so it chains."""

    def __init__(self, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        h = x.view(b, t, self.heads, e // self.heads).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            h, h, h, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, e)


class _CrossEntropy(nn.Module):
    """Cross-entropy of the input's rows (ImageNet's 1000 classes) against fixed targets, added
    back to the input so that it keeps its shape and chains: what tier 2 routes to the zoo's
    loss."""

    def __init__(self, classes: int = 1000, rows: int = 512) -> None:
        super().__init__()
        self.register_buffer("target", torch.randint(0, classes, (rows,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.cross_entropy(x, self.target[:x.shape[0]])


# name -> (layer factory, input shape); inputs require grad so every layer's backward runs
LAYERS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "conv": (lambda: nn.Conv2d(16, 16, 3, padding=1), (1, 16, 8, 8)),
    "bn": (lambda: nn.BatchNorm2d(16), (2, 16, 8, 8)),  # training BN needs 2 values a channel
    "relu": (lambda: nn.ReLU(), (1, 16, 8, 8)),
    "maxpool": (lambda: nn.MaxPool2d(2), (1, 16, 8, 8)),
    "linear": (lambda: nn.Linear(128, 128), (1, 128)),
    "layernorm": (lambda: nn.LayerNorm(128), (1, 128)),
    "gelu": (lambda: nn.GELU(), (1, 128)),
    "softmax": (lambda: nn.Softmax(dim=-1), (1, 4, 16, 16)),
    "dropout": (lambda: nn.Dropout(0.1), (1, 128)),
    "attention": (_SelfAttention, (1, 16, 64)),  # a functional call: captured, not converted
    "loss": (_CrossEntropy, (2, 1000)),  # likewise
}

VARIANTS = {  # name -> convert_model overrides (None: the torch layer)
    "torch": None,
    "uniform 2, capture": {"bits": 2, "strategy": "uniform"},
    "uniform 2, no capture": {"bits": 2, "strategy": "uniform", "capture": False},
    "default (actnn)": {},
}


class _FloorLinearFunction(torch.autograd.Function):
    """The least a compressing linear layer can do in Python (``--floor``): ``F.linear``, one
    quantize call; in backward one dequantize call and the matmuls. No checks, no capture
    store, no strategy, a fixed seed: a floor to compare the library's glue with, not a
    layer to train with."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        out = torch.nn.functional.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        ctx.codes = kernels(x.device).quantize_uniform(rows.contiguous(), 2, 256, 12345, True)
        ctx.rows_shape = rows.shape
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        data, lo, step = ctx.codes
        x = torch.empty(ctx.rows_shape, device=grad.device)
        kernels(grad.device).dequantize_uniform(data, lo, step, 2, 256, 0, x)
        g = grad.reshape(-1, grad.shape[-1])
        return grad @ weight, g.t() @ x, g.sum(0)


class _FloorLinear(nn.Linear):
    def forward(self, x):
        return _FloorLinearFunction.apply(x, self.weight, self.bias)


def step_fn(layer: str, overrides, batch: int = 0, chain: int = 1) -> Callable[[], None]:
    """``batch`` > 0 replaces the input's batch size (0: the fixed-cost shape above);
    ``overrides`` "floor": the linear layer as :class:`_FloorLinear`; ``chain``: that many
    layers one after the other (one capture session per forward for all of them)."""
    make, shape = LAYERS[layer]
    if batch > 0:
        shape = (batch,) + tuple(shape[1:])
    torch.manual_seed(0)
    model = nn.Sequential(*[make() for _ in range(chain)]).train()
    if overrides == "floor":
        floor = _FloorLinear(model[0].in_features, model[0].out_features)
        floor.load_state_dict(model[0].state_dict())
        model = nn.Sequential(floor).train()
    elif overrides is not None:
        model = convert_model(model, **overrides)
    x = torch.randn(shape, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()
    return step


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--calls", type=int, default=300, help="timed calls per variant")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stat", choices=("min", "median"), default="min")
    p.add_argument("--batch", type=int, default=0,
                   help="input batch size (default: 1, 2 for batch norm): a larger one times "
                        "the layer's arithmetic too, e.g. --layers bn --batch 512")
    p.add_argument("--chain", type=int, default=1,
                   help="time a chain of this many layers and report per layer call: the "
                        "capture session, paid once per forward, is then shared as in a model "
                        "(layers that keep their input's shape; not maxpool)")
    p.add_argument("--floor", action="store_true",
                   help="also time the least a compressing linear layer can do in Python (one "
                        "quantize, one dequantize, no checks, store or strategy); linear only")
    args = p.parse_args(argv)
    if args.batch < 0:
        p.error(f"--batch must be >= 0, got {args.batch}")
    if args.chain < 1:
        p.error(f"--chain must be >= 1, got {args.chain}")
    torch.set_num_threads(1)
    names = [s.strip() for s in args.layers.split(",") if s.strip()]
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        p.error(f"unknown layer(s) {unknown}; known: {', '.join(LAYERS)}")
    if args.chain > 1 and "maxpool" in names:
        p.error("--chain needs layers that keep their input's shape; maxpool halves it")
    variants = dict(VARIANTS)
    if args.floor:
        if names != ["linear"]:
            p.error("--floor needs --layers linear (the floor is a linear layer)")
        variants["python floor"] = "floor"
    stat = min if args.stat == "min" else statistics.median
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, {args.stat} microseconds per "
          f"forward + backward call ({args.calls} calls per variant, {args.rounds} rounds"
          f"{f', batch {args.batch}' if args.batch else ''}"
          f"{f'; a chain of {args.chain} layers, per layer' if args.chain > 1 else ''})")
    head = f"{'layer':10s}" + "".join(f" | {v:>21s}" for v in variants)
    print(head)
    print("-" * len(head))
    for name in names:
        steps = {v: step_fn(name, o, args.batch, args.chain) for v, o in variants.items()}
        times = interleaved_step_times(steps, n=args.calls, warmup=20, rounds=args.rounds,
                                       clock=time.thread_time)
        med = {v: stat(t) * 1e6 / args.chain for v, t in times.items()}
        base = med["torch"]
        cells = [f"{med['torch']:9.0f}" + " " * 12]
        cells += [f"{med[v]:9.0f} (+{med[v] - base:6.0f})" for v in list(variants)[1:]]
        print(f"{name:10s}" + "".join(f" | {c:>21s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
