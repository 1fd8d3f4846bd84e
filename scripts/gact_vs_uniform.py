"""GACT against uniform bits at equal saved bytes: weight-gradient error after training.

Per model and seed:

1. build the model (``seed``), convert it with ``strategy: gact`` at a ``--bits`` budget
   (``update_interval`` ``--interval``) and train it ``--steps`` steps on its own data with
   dropout on (GACT probes and re-allocates as in any run);
2. freeze: dropout off, GACT's last allocation applied and no further probe; a held-out batch;
   the exact fp32 gradient of the same weights (the unconverted model);
3. ``--draws`` compressed backward passes of the GACT model, and as many of the same weights
   converted with ``strategy: uniform`` at ``bits`` (each pass a new rounding draw): the
   error ``E ||g_q - g||^2`` summed over the conv / linear weight matrices (the embeddings
   excluded), its standard error from the spread of the draws, and the bytes autograd and the
   capture store keep after one forward plus the loss (``actnn_zoo.memory``: codes and group
   metadata, everything uncompressed too).

Models (small sizes, seconds on 2 cores): ``digits``, ``DigitsResNet`` (width 16) on the
digits data, batch 64; ``text``, the project's ``CharTransformer`` (d 64, 2 layers, context
32) on stdlib text, batch 16; ``gpt2``, ``transformers``' GPT-2 (``GPT2LM``: d 64, 2 layers,
4 heads, context 32, random init) on the same characters, batch 16.

    PYTHONPATH=. .venv/bin/python scripts/gact_vs_uniform.py [--models digits,text,gpt2]
        [--seeds 0,1,2] [--steps 30] [--draws 16]
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.convert import precision_strategy  # noqa: E402
from actnn_zoo.memory import saved_activation_bytes  # noqa: E402

MODELS: Tuple[str, ...] = ("digits", "text", "gpt2")


@dataclass
class Setup:
    """A model, where its training batches come from, and a held-out batch."""

    model: nn.Module
    batches: Iterator[Tuple[Tensor, Tensor]]
    held_out: Tuple[Tensor, Tensor]
    lr: float
    adam: bool


@dataclass
class Result:
    """One model and seed: error of each strategy against the exact gradient."""

    model: str
    seed: int
    gact: float  # E ||g_q - g||^2 over every parameter
    gact_se: float  # its standard error over the draws
    uniform: float
    uniform_se: float
    gact_w: float  # the same over the conv / linear weight matrices (not embeddings)
    gact_w_se: float
    uniform_w: float
    uniform_w_se: float
    gact_bytes: int  # saved bytes after one forward + loss
    uniform_bytes: int
    gact_bits: float  # the realised average width of the Q-layers
    widths: Dict[str, float]
    predicted: Optional[float]  # GACT's predicted variance / uniform's at its last update
    seconds: float

    @property
    def ratio(self) -> float:
        return self.gact / self.uniform

    @property
    def ratio_se(self) -> float:
        """Standard error of the ratio (delta method, independent draws)."""
        return _ratio_se(self.gact, self.gact_se, self.uniform, self.uniform_se)

    @property
    def ratio_w(self) -> float:
        return self.gact_w / self.uniform_w

    @property
    def ratio_w_se(self) -> float:
        return _ratio_se(self.gact_w, self.gact_w_se, self.uniform_w, self.uniform_w_se)


def _ratio_se(a: float, a_se: float, b: float, b_se: float) -> float:
    return a / b * math.sqrt((a_se / a) ** 2 + (b_se / b) ** 2)


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _text_batches(ids: Tensor, context: int, batch: int, seed: int
                  ) -> Iterator[Tuple[Tensor, Tensor]]:
    from actnn_zoo.data import random_windows

    g = torch.Generator().manual_seed(seed)
    while True:
        yield random_windows(ids, context, batch, g)


def _digit_batches(x: Tensor, y: Tensor, batch: int, seed: int
                   ) -> Iterator[Tuple[Tensor, Tensor]]:
    from actnn_zoo.data import iterate_minibatches

    g = torch.Generator().manual_seed(seed)
    while True:
        yield from iterate_minibatches(x, y, batch, g)


def setup(name: str, seed: int, tiny: bool = False) -> Setup:
    """The model of ``name`` initialised from ``seed``, its data and a held-out batch
    (``tiny``: half the width and batch, for the test suite)."""
    from actnn_zoo.data import load_digits_data, load_text_corpus, random_windows
    from actnn_zoo.models import CharTransformer, DigitsResNet, GPT2LM

    torch.manual_seed(seed)
    if name == "digits":
        data = load_digits_data()
        model: nn.Module = DigitsResNet(width=8 if tiny else 16)
        batch = 32 if tiny else 64
        return Setup(model, _digit_batches(data.x_train, data.y_train, batch, seed),
                     (data.x_test[:2 * batch], data.y_test[:2 * batch]), 0.05, False)
    if name not in ("text", "gpt2"):
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    corpus = load_text_corpus(200_000)
    context, width, batch = (16, 32, 8) if tiny else (32, 64, 16)
    if name == "text":
        model = CharTransformer(vocab_size=corpus.vocab_size, d_model=width, n_heads=4,
                                n_layers=2, context=context)
    else:
        model = GPT2LM(vocab_size=corpus.vocab_size, n_embd=width, n_layer=2, n_head=4,
                       context=context)
    held = random_windows(corpus.val, context, 2 * batch,
                          torch.Generator().manual_seed(1000 + seed))
    return Setup(model, _text_batches(corpus.train, context, batch, seed), held, 3e-3, True)


def _dropout(model: nn.Module, p: Optional[float]) -> List[float]:
    """Set every dropout's p (None: leave), returning the old values."""
    old = []
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            old.append(m.p)
            if p is not None:
                m.p = p
    return old


def _grads(model: nn.Module, x: Tensor, y: Tensor, names: Sequence[str]) -> List[Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    params = dict(model.named_parameters())
    return [params[n].grad.detach().double().clone() for n in names]


def weight_names(model: nn.Module) -> List[str]:
    """Conv / linear weight matrices (and transformers' Conv1D), not embeddings."""
    out = []
    params = dict(model.named_parameters())  # a tied weight (GPT-2's head) is listed once
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            continue
        w = getattr(mod, "weight", None)
        name = f"{mod_name}.weight" if mod_name else "weight"
        if isinstance(w, nn.Parameter) and w.dim() >= 2 and w.requires_grad and name in params:
            out.append(name)
    return out


def error(model: nn.Module, x: Tensor, y: Tensor, exact: List[Tensor], names: Sequence[str],
          subset: Sequence[str], draws: int) -> Tuple[float, float, float, float]:
    """Mean and standard error over ``draws`` passes of ``||g_q - g||^2`` summed over
    ``names`` (every parameter), then the same over ``subset`` of them."""
    full, part = [], []
    keep = set(subset)
    for _ in range(draws):
        g = _grads(model, x, y, names)
        sq = [float((a - b).square().sum()) for a, b in zip(g, exact)]
        full.append(sum(sq))
        part.append(sum(v for n, v in zip(names, sq) if n in keep))
    out: List[float] = []
    for vals in (full, part):
        t = torch.tensor(vals, dtype=torch.float64)
        out += [float(t.mean()), float(t.std() / math.sqrt(draws)) if draws > 1 else 0.0]
    return out[0], out[1], out[2], out[3]


def _bytes(model: nn.Module, x: Tensor, y: Tensor) -> int:
    return saved_activation_bytes(model, x, loss_fn=lambda out: _loss(out, y)).total_bytes


def measure(name: str, seed: int, steps: int = 30, draws: int = 16, bits: float = 2,
            interval: int = 10, probe_samples: int = 8, threads: Optional[int] = None,
            configure: Optional[Callable[[Any], None]] = None, tiny: bool = False) -> Result:
    """GACT trained ``steps`` steps vs uniform ``bits`` on the same weights (module doc)."""
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    st = setup(name, seed, tiny)
    base = st.model
    model = az.convert_model(copy.deepcopy(base), strategy="gact", bits=bits,
                             update_interval=interval)
    s = precision_strategy(model)
    s.probe_samples = probe_samples
    if configure is not None:
        configure(s)
    opt = (torch.optim.Adam(model.parameters(), lr=st.lr) if st.adam
           else torch.optim.SGD(model.parameters(), lr=st.lr, momentum=0.9))
    torch.manual_seed(seed + 100)
    for _ in range(steps):
        x, y = next(st.batches)
        opt.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()
        opt.step()
    x, y = st.held_out
    _dropout(model, 0.0)
    # apply a finished probe (if any) with one more forward, then no probe runs any more
    s.update_interval = 10 ** 9
    model.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    assert s._pending is None
    # the same weights: fp32 and uniform
    fp32 = copy.deepcopy(base)
    fp32.load_state_dict(az.restore_model(copy.deepcopy(model)).state_dict())
    _dropout(fp32, 0.0)
    names = [n for n, p in fp32.named_parameters() if p.requires_grad]
    weights = weight_names(fp32)
    exact = _grads(fp32, x, y, names)
    uni = az.convert_model(copy.deepcopy(fp32), strategy="uniform", bits=int(bits))
    torch.manual_seed(seed + 200)
    _grads(uni, x, y, names)  # first forward: the ReLUs learn what the next layer saves
    gm, gse, gw, gwse = error(model, x, y, exact, names, weights, draws)
    um, use, uw, uwse = error(uni, x, y, exact, names, weights, draws)
    gb, ub = _bytes(model, x, y), _bytes(uni, x, y)
    return Result(name, seed, gm, gse, um, use, gw, gwse, uw, uwse, gb, ub,
                  float(s.report()["average_bits"]), s.layer_budgets(),
                  s.report().get("predicted_ratio"), time.perf_counter() - t0)


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--estimator", default=None, help="gact's estimator (default: its own)")
    ap.add_argument("--min-gain", type=float, default=None,
                    help="gact's min_gain (default: its own)")
    ap.add_argument("--widths", action="store_true", help="print GACT's widths per tensor")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    seeds = [int(v) for v in args.seeds.split(",") if v]

    def configure(s: Any) -> None:
        if args.estimator:
            s.estimator = args.estimator
        if args.min_gain is not None:
            s.min_gain = args.min_gain
    print(f"GACT vs uniform at {args.bits:g} bits after {args.steps} steps "
          f"(update_interval {args.interval}), {args.draws} draws each")
    print("error: E ||g_q - g||^2 against the exact fp32 gradient, over every parameter; "
          "'weights': over the conv / linear weight matrices only (embeddings and a head tied "
          "to them excluded); ± one standard error over the draws")
    print(f"{'model':7s} {'seed':>4s} {'gact bits':>9s} {'gact err':>10s} {'uniform err':>11s} "
          f"{'gact/uniform':>14s} {'weights':>14s} {'bytes gact/uni':>14s} {'predicted':>9s} "
          f"{'s':>6s}")
    for m in models:
        for seed in seeds:
            r = measure(m, seed, args.steps, args.draws, args.bits, args.interval,
                        threads=args.threads, configure=configure)
            print(f"{m:7s} {seed:4d} {r.gact_bits:9.3f} {r.gact:10.4g} {r.uniform:11.4g} "
                  f"{r.ratio:7.3f} ± {r.ratio_se:.3f} {r.ratio_w:7.3f} ± {r.ratio_w_se:.3f} "
                  f"{r.gact_bytes / r.uniform_bytes:14.4f} "
                  f"{_fmt(r.predicted):>9s} {r.seconds:6.1f}", flush=True)
            if args.widths:
                print("   ", {k: int(v) for k, v in r.widths.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
