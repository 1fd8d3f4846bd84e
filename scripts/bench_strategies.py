"""The four precision strategies at a 2-bit average on DigitsResNet, and GACT's sensitivity
estimators compared.

1. Sensitivities: the joint probe (``estimator="joint"``: 3 passes per update, module doc of
   ``actnn_zoo/precision/gact.py``) against GACT's per-tensor one (1 + L passes), each averaged
   over ``--repeats`` probes on one batch: Spearman rank correlation of C_l, and how many
   tensors get the same width at a 2-bit budget.
2. Gradient fidelity: on one fixed test batch of a briefly fp32-trained DigitsResNet (dropout
   off), ``--passes`` compressed backward passes per strategy against the exact fp32 gradient:
   the variance (mean squared deviation, summed over the conv / linear weights) and the mean
   cosine. AC-GC's average width is an outcome: the error fraction e whose average is closest
   to 2 bits is picked from a scan and reported. ``division`` rows: uniform 2-bit residuals
   under ``compressor: division`` (DIVISION's bf16 block means + per-map ranges) at blocks of
   8 (every map of this CNN, 8x8 and 4x4, is then one block: no low part is stored) and 4.
3. Per row also the saved-activation compression (what autograd and the capture store hold
   after one training forward plus the loss, fp32 bytes over compressed bytes,
   ``actnn_zoo.memory.compression_ratio``) and the median step time (forward + backward)
   relative to uniform 2 bits, all rows timed round-robin in one process.

``--model text`` runs parts 2-3 on the demo's char transformer (stdlib text) after
``--steps`` fp32 steps (dropout off), a batch of 32 validation windows of 64 characters;
``--model gpt2`` on GPT-2 small's configuration (``transformers.GPT2Config()``: 12 layers,
768 wide, 50257 tokens; random init, dropout off), ``--gpt2-batch`` sequences of 128 tokens
(the stdlib text's character ids). The weight-gradient variance of those two sums over every
weight matrix except the embeddings.

    .venv/bin/python scripts/bench_strategies.py [--quick] [--model digits|text|gpt2]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.convert import precision_strategy  # noqa: E402
from actnn_zoo.data import load_digits_data  # noqa: E402
from actnn_zoo.bench import interleaved_step_times  # noqa: E402
from actnn_zoo.memory import compression_ratio  # noqa: E402
from bench_precision import is_weight, train_fp32  # noqa: E402

Setup = Optional[Callable[[nn.Module], None]]
WEIGHT: Callable[[str, nn.Module], bool] = is_weight  # which gradients the variance sums


def gradients(model: nn.Module, x: Tensor, y: Tensor) -> Dict[str, Tensor]:
    """Parameter gradients of the cross-entropy; (N, C) logits or (N, T, V) token logits."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def matrix_weight(name: str, model: nn.Module) -> bool:
    """Every weight matrix except the embeddings (the transformers' 'weight gradient')."""
    mod = model.get_submodule(name.rpartition(".")[0])
    p = model.get_parameter(name)
    return name.endswith("weight") and p.dim() >= 2 and not isinstance(mod, nn.Embedding)


class _Logits(nn.Module):
    """A Hugging Face causal LM that returns the logits tensor."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: Tensor) -> Tensor:
        return self.lm(input_ids=idx).logits


def text_base(steps: int, seed: int) -> Tuple[nn.Module, Tensor, Tensor]:
    """The demo's char transformer after ``steps`` fp32 steps, dropout off, and a batch of 32
    validation windows."""
    from actnn_zoo import demo
    from actnn_zoo.data import load_text_corpus, random_windows

    setup = demo.TextSetup(steps=steps)
    corpus = load_text_corpus(setup.num_chars)
    base = demo.train_text("fp32", setup, seed, corpus, progress=False).model
    _no_dropout(base)
    x, y = random_windows(corpus.val, setup.context, 32, torch.Generator().manual_seed(seed))
    return base, x, y


def gpt2_base(batch: int, seed: int) -> Tuple[nn.Module, Tensor, Tensor]:
    """GPT-2 small's configuration, random init, dropout off; ``batch`` windows of 128 ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from actnn_zoo.data import load_text_corpus, random_windows

    torch.manual_seed(seed)
    base = _Logits(GPT2LMHeadModel(GPT2Config(use_cache=False, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0))).train()
    _no_dropout(base)
    corpus = load_text_corpus(300_000)
    x, y = random_windows(corpus.val, 128, batch, torch.Generator().manual_seed(seed))
    return base, x, y


def _no_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def spearman(a: List[float], b: List[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def probed(base: nn.Module, x: Tensor, y: Tensor, estimator: str, repeats: int,
           seed: int) -> Tuple[Dict[str, float], Dict[str, float], float, int]:
    """(C_l, widths at 2 bits, seconds, passes) of one probe (``repeats`` averaged)."""
    torch.manual_seed(seed)
    model = az.convert_model(copy.deepcopy(base), strategy="gact", bits=2,
                             update_interval=1000)
    s = precision_strategy(model)
    s.estimator, s.probe_repeats, s.probe_samples = estimator, repeats, 8
    gradients(model, x, y)  # step 1: recorded
    t = time.perf_counter()
    gradients(model, x, y)  # step 2: probe
    dt = time.perf_counter() - t
    gradients(model, x, y)  # step 3: applied
    return s.sensitivities(), s.layer_budgets(), dt, s.probe_passes


def fidelity(base: nn.Module, cfg: dict, x: Tensor, y: Tensor, exact: Dict[str, Tensor],
             passes: int, seed: int, setup: Setup = None
             ) -> Tuple[float, float, float, nn.Module]:
    """(weights' variance, mean cosine of the whole gradient, realised average bits, the
    converted model)."""
    torch.manual_seed(seed)
    model = az.convert_model(copy.deepcopy(base), cfg)
    if setup is not None:
        setup(model)
    for _ in range(4):  # the strategies' first update has applied after this
        gradients(model, x, y)
    var = cos = 0.0
    flat_exact = torch.cat([g.flatten() for g in exact.values()]).double()
    for _ in range(passes):
        g = gradients(model, x, y)
        var += sum(float((g[n] - exact[n]).double().square().sum()) for n in g
                   if WEIGHT(n, base)) / passes
        flat = torch.cat([g[n].flatten() for n in exact]).double()
        cos += float(F.cosine_similarity(flat, flat_exact, dim=0)) / passes
    s = precision_strategy(model)
    bits = s.report()["average_bits"] if hasattr(s, "report") else _actnn_bits(s, cfg)
    return var, cos, bits, model


def _actnn_bits(s, cfg: dict) -> float:
    bits = values = 0.0
    for w in getattr(s, "watched", []):
        st = w.stats
        if not st.numel:
            continue
        n = st.numel * st.samples
        b = (float(st.bits.double().mean()) if st.bits is not None
             else float(w.pinned_bits or w.module.qconfig.bits))
        bits, values = bits + b * n, values + n
    return bits / values if values else float(cfg["bits"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fidelity-only", action="store_true", help="skip part 1")
    ap.add_argument("--model", choices=("digits", "text", "gpt2"), default="digits",
                    help="text / gpt2: parts 2-3 only (see the module doc)")
    ap.add_argument("--steps", type=int, default=None,
                    help="fp32 steps before the measurement (digits 100, text 150)")
    ap.add_argument("--passes", type=int, default=None, help="compressed passes per row")
    ap.add_argument("--timing", type=int, default=None, help="timed steps per row per round")
    ap.add_argument("--gpt2-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global WEIGHT
    passes, repeats, steps = (8, 2, 30) if args.quick else (24, 4, 100)
    timing = 6 if args.quick else 30
    scan = (0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
    if args.model == "digits":
        steps = args.steps or steps
        data = load_digits_data()
        x, y = data.x_test[:128], data.y_test[:128]
        base = train_fp32(steps, args.seed)
        base.dropout.p = 0.0
        what = f"DigitsResNet after {steps} fp32 steps, batch of {len(y)} digits test images"
    elif args.model == "text":
        steps = args.steps or 150
        base, x, y = text_base(steps, args.seed)
        WEIGHT, scan = matrix_weight, (0.1, 0.3, 1.0, 2.0)
        what = (f"char transformer (demo) after {steps} fp32 steps, {len(y)} validation "
                f"windows of {x.shape[1]} characters")
    else:
        base, x, y = gpt2_base(args.gpt2_batch, args.seed)
        WEIGHT, scan = matrix_weight, (0.3, 1.0, 2.0)
        passes, timing = min(passes, 6), min(timing, 4)
        what = (f"GPT-2 small config (12x768, vocab 50257), random init, {len(y)} windows of "
                f"{x.shape[1]} tokens")
    passes = args.passes or passes
    timing = args.timing or timing
    exact = gradients(copy.deepcopy(base), x, y)

    print(what)
    if not args.fidelity_only and args.model == "digits":
        compare(base, x, y, repeats, args.seed)
    rows = fidelity_rows(base, x, y, exact, passes, args.seed, scan)
    ratio, speed = saved_and_speed(base, x, y, {k: r[3] for k, r in rows.items()}, timing)
    u = rows["uniform 2"][0]
    # E||g_q - g||^2 / ||g||^2 over the same weights: AC-GC's e bounds it per weight tensor,
    # so the whole-gradient ratio must stay under e too
    ref_sq = sum(float(g.double().square().sum()) for n, g in exact.items() if WEIGHT(n, base))
    print(f"   {'strategy':24s} {'avg bits':>8s} {'variance':>10s} {'/ uniform':>9s} "
          f"{'rel err':>8s} {'cosine':>8s} {'saved x':>8s} {'step / uniform':>14s}")
    for name, (v, c, b, _) in rows.items():
        print(f"   {name:24s} {b:8.3f} {v:10.4g} {v / u:9.3f} {v / ref_sq:8.4f} {c:8.4f} "
              f"{ratio[name]:8.2f} {speed[name]:14.3f}")
    print(f"   (rel err: variance / squared norm of the exact weight gradient. "
          f"avg bits: the width the strategy chose; for division the residual's width. "
          f"saved x: fp32 saved bytes / compressed, one forward + loss. step: median of the "
          f"round-robin timings, machine shared)")


def saved_and_speed(base: nn.Module, x: Tensor, y: Tensor, models: Dict[str, nn.Module],
                    n: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Saved-activation compression vs fp32 and median step time relative to uniform 2."""
    loss = lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # noqa
    ratio = {k: compression_ratio(base, m, x, loss_fn=loss) for k, m in models.items()}
    times = interleaved_step_times({k: (lambda m=m: gradients(m, x, y))
                                    for k, m in models.items()}, n=n, warmup=2, rounds=3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return ratio, {k: t / med["uniform 2"] for k, t in med.items()}


def compare(base: nn.Module, x: Tensor, y: Tensor, repeats: int, seed: int) -> None:
    """Part 1: the joint and per-tensor estimators on the same batch."""
    cj, wj, tj, pj = probed(base, x, y, "joint", repeats, seed + 1)
    cp, wp, tp, pp = probed(base, x, y, "per_tensor", repeats, seed + 1)
    names = sorted(cj)
    rho = spearman([cj[n] for n in names], [cp[n] for n in names])
    same = sum(wj[n] == wp[n] for n in names)
    print(f"\n1. sensitivities, {len(names)} tensors, probe of 8 samples, {repeats} repeats")
    print(f"   joint:      {pj} passes ({pj // repeats} per probe), {tj:.2f} s")
    print(f"   per-tensor: {pp} passes ({pp // repeats} per probe), {tp:.2f} s")
    print(f"   Spearman rank correlation of C_l: {rho:.3f}; same width at 2 bits: "
          f"{same}/{len(names)}")
    for n in names:
        print(f"     {n:24s} C joint {cj[n]:10.4g}  per-tensor {cp[n]:10.4g}  "
              f"bits {wj[n]:.0f} / {wp[n]:.0f}")


def fidelity_rows(base: nn.Module, x: Tensor, y: Tensor, exact: Dict[str, Tensor],
                  passes: int, seed: int,
                  e_scan: Tuple[float, ...] = (0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
                  ) -> Dict[str, Tuple[float, float, float, nn.Module]]:
    """Part 2: every strategy at (about) 2 bits on average."""
    print(f"\n2. gradient fidelity at a 2-bit average, {passes} passes each")
    rows: Dict[str, Tuple[float, float, float, nn.Module]] = {}
    common = {"bits": 2, "update_interval": 1000}
    rows["uniform 2"] = fidelity(base, {**common, "strategy": "uniform"}, x, y, exact, passes,
                                 seed + 2)
    rows["actnn 2"] = fidelity(base, {**common, "strategy": "actnn"}, x, y, exact, passes,
                               seed + 2)
    rows["gact 2 (hybrid)"] = fidelity(base, {**common, "strategy": "gact"}, x, y, exact,
                                      passes, seed + 2)

    def per_tensor(m: nn.Module) -> None:
        precision_strategy(m).estimator = "per_tensor"
    rows["gact 2 (per-tensor)"] = fidelity(base, {**common, "strategy": "gact"}, x, y, exact,
                                           passes, seed + 2, per_tensor)
    scan = {}
    for e in e_scan:
        scan[e] = fidelity(base, {"strategy": "acgc", "error_fraction": e,
                                  "update_interval": 2}, x, y, exact, 2, seed + 2)
    ref_sq = sum(float(g.double().square().sum()) for n, g in exact.items() if WEIGHT(n, base))
    print("   acgc scan (e: average bits, relative weight-gradient error over 2 passes): "
          + ", ".join(f"{e:g}: {v[2]:.2f} / {v[0] / ref_sq:.3f}" for e, v in scan.items()))
    best = min(scan, key=lambda e: abs(scan[e][2] - 2.0))
    rows[f"acgc e={best:g}"] = fidelity(base, {"strategy": "acgc", "error_fraction": best,
                                               "update_interval": 2}, x, y, exact, passes,
                                        seed + 2)
    for block in (8, 4):
        rows[f"division 2 (B={block})"] = fidelity(
            base, {**common, "strategy": "uniform", "compressor": "division",
                   "division_block": block}, x, y, exact, passes, seed + 2)
    return rows


if __name__ == "__main__":
    main()
