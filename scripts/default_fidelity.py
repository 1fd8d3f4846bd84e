#!/usr/bin/env python
"""Which saved tensors of the text transformer cost validation loss at 2 bits, and does a
candidate default reach fp32 (issue 31)?

Each run trains the demo's text transformer (``actnn_zoo.demo.train_text``: the weights, data
order, optimizer and cosine schedule of ``python -m actnn_zoo.demo`` for a seed) for
``--steps`` steps with one named config of ``CANDIDATES`` and records the validation loss,
the saved-activation compression of one training batch after training
(``actnn_zoo.memory.compression_ratio``, capture tiers and ranges included) and the Q-layers'
value-weighted average width. ``fp32`` trains the plain model. The screen: the old default
(``actnn`` 2-bit average, capture at 2) with ONE tensor class at 8 bits, to see which class
carries the loss; then the candidates for the new default.

One training job at a time, one thread (``torch.set_num_threads(1)``); resumable: a run whose
JSON exists under ``--dir`` is skipped::

    PYTHONPATH=. .venv/bin/python scripts/default_fidelity.py --runs old,head8 --steps 300
    PYTHONPATH=. .venv/bin/python scripts/default_fidelity.py --runs fp32,model_default \\
        --steps 1000 --seeds 0,1,2
    PYTHONPATH=. .venv/bin/python scripts/default_fidelity.py --report
    PYTHONPATH=. .venv/bin/python scripts/default_fidelity.py --plot         # the curve
    PYTHONPATH=. .venv/bin/python scripts/default_fidelity.py --compression  # project / HF

The 1000-step fp32 runs are the demo's (``results/demo_text_capture_seed*.json``: the same
``train_text``, fp32 is deterministic), copied in as ``text_fp32_1000st_s*.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

HEAD = ["head", "head.*", "heads.*", "classifier", "classifier.*", "lm_head"]
OLD = {"strategy": "actnn", "bits": 2}  # the default before issue 31


def _ln4_head4(bits: float) -> Dict[str, Any]:
    """``actnn`` at ``bits`` with the softmax, attention's linears, the norms' inputs, the
    head's input and the capture tiers at 4 (the default's rules since its second change)."""
    return {"strategy": "actnn", "bits": bits, "capture_bits": 4,
            "rules": [{"type": "Softmax", "bits": 4},
                      {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                      {"type": "LayerNorm", "bits": 4}, {"name": "head", "bits": 4}]}


# name -> convert_model config (None: fp32; "default": convert_model's own default for the
# model, i.e. no config given)
CANDIDATES: Dict[str, Any] = {
    "fp32": None,
    "old": OLD,
    "default": "default",
    # one class at 8 bits, the rest as the old default
    "head8": {**OLD, "rules": [{"pattern": HEAD, "bits": 8}]},
    "softmax8": {**OLD, "rules": [{"type": "Softmax", "bits": 8}]},
    "capture8": {**OLD, "capture_bits": 8},
    "ln8": {**OLD, "rules": [{"type": "LayerNorm", "bits": 8}]},
    "qkv8": {**OLD, "rules": [{"pattern": "*.qkv", "bits": 8}]},
    "mlp8": {**OLD, "rules": [{"pattern": ["*.mlp.*"], "bits": 8}]},
    # attention operands and the head's input wider, the bulk at the budget
    "attn4_head8": {**OLD, "capture_bits": 4,
                    "rules": [{"type": "Softmax", "bits": 4}, {"pattern": HEAD, "bits": 8}]},
    "attn8_head8": {**OLD, "capture_bits": 8,
                    "rules": [{"type": "Softmax", "bits": 8}, {"pattern": HEAD, "bits": 8}]},
    "b3_attn4_head8": {"strategy": "actnn", "bits": 3, "capture_bits": 4,
                       "rules": [{"type": "Softmax", "bits": 4}, {"pattern": HEAD, "bits": 8}]},
    # the model-aware default written out for the text transformer (config.default_config)
    "t3.25": {"strategy": "actnn", "bits": 3.25, "capture_bits": 4,
              "rules": [{"type": "Softmax", "bits": 4}, {"name": "head", "bits": 8}]},
    # ... and the attention's own linears (qkv, projection) at 4 as well
    "t3.25_attnlin4": {"strategy": "actnn", "bits": 3.25, "capture_bits": 4,
                       "rules": [{"type": "Softmax", "bits": 4},
                                 {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                                 {"name": "head", "bits": 8}]},
    # the new default's rules (t3.25_attnlin4) at other budgets: its bits-vs-loss curve
    **{f"t{b:g}": {"strategy": "actnn", "bits": b, "capture_bits": 4,
                   "rules": [{"type": "Softmax", "bits": 4},
                             {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                             {"name": "head", "bits": 8}]}
       for b in (2.75, 3.75, 4.5)},
    # ... and the MLP's first linear too: every linear's input at 4 but the MLP's down
    # projection (the widest input: 4x the values, 2.7% of the 2-bit gradient error)
    "t3.25_lin4": {"strategy": "actnn", "bits": 3.25, "capture_bits": 4,
                   "rules": [{"type": "Softmax", "bits": 4},
                             {"pattern": ["*.attn.qkv", "*.attn.proj", "*.mlp.0"], "bits": 4},
                             {"name": "head", "bits": 8}]},
    "b3": {"strategy": "actnn", "bits": 3},
    "b3.5": {"strategy": "actnn", "bits": 3.5},
    "b4_cap2": {"strategy": "actnn", "bits": 4, "capture_bits": 2},
    # uniform: attention's operands and projections at 4, the head's input at 8, the MLP,
    # the norms and the embeddings' dropout at 2
    "u_attn4_head8": {"strategy": "uniform", "bits": 2, "capture_bits": 4,
                      "rules": [{"type": "Softmax", "bits": 4},
                                {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                                {"pattern": HEAD, "bits": 8}]},
    "b3_cap4": {"strategy": "actnn", "bits": 3, "capture_bits": 4},
    # the norms' normalized inputs at 4 as well (their weights' gradients had the largest
    # relative error of any parameter at the default, 0.5-0.7 of their norm, and Adam scales
    # each parameter by its own gradient's size), the head's input down to 4 (8 bought 0.004
    # of the gradient's norm squared for 512 bits a token), the budget raised to what 10x
    # allows
    "t3.375_ln4_head4": _ln4_head4(3.375),
    # ... and the softmax's groups one row of the demo's attention (64 values): a diffuse row
    # gets its own small range instead of sharing one with a peaked row (gradient error 0.148
    # -> 0.138 after 900 fp32 steps, for 0.375 bit more metadata a softmax value)
    "t3.375_ln4_head4_sm64": {"strategy": "actnn", "bits": 3.375, "capture_bits": 4,
                              "rules": [{"type": "Softmax", "bits": 4, "group_size": 64},
                                        {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                                        {"type": "LayerNorm", "bits": 4},
                                        {"name": "head", "bits": 4}]},
    # ... the MLP's first linear at 4 too and the MLP's down projection's input (GELU's output,
    # whose weight gradient then had the largest relative error, 0.38) in groups of 128:
    # gradient error 0.148 -> 0.142, largest relative error 0.39 -> 0.32 (900 fp32 steps)
    "t3.38_ln4_head4_fc1_fc2g128": {
        "strategy": "actnn", "bits": 3.38, "capture_bits": 4,
        "rules": [{"type": "Softmax", "bits": 4},
                  {"pattern": ["*.attn.qkv", "*.attn.proj"], "bits": 4},
                  {"type": "LayerNorm", "bits": 4}, {"pattern": "*.mlp.0", "bits": 4},
                  {"pattern": "*.mlp.2", "group_size": 128}, {"name": "head", "bits": 4}]},
    # ... the same rules at a larger budget (below 10x): what seed 2 needs
    "t3.75_ln4_head4": _ln4_head4(3.75),
    # ... with the probabilities saved once (a dropout's output derived from the softmax's
    # payload, capture/store.py): the bytes freed buy a larger budget at the same 10x. Its
    # run, and 3.75's seed-0 run, predate counting derived values at 0 bits (actnn), which now
    # spends those bytes within the default's own 3.375
    "t3.625_ln4_head4": _ln4_head4(3.625),
    # every saved tensor at 8 bits (about 4x): how close to fp32 an almost exact gradient
    # lands after 1000 steps on a seed (the trajectory's own spread)
    "u8": {"strategy": "uniform", "bits": 8},
}


def run_name(cand: str, steps: int, seed: int) -> str:
    return f"text_{cand}_{steps}st_s{seed}"


def execute(cand: str, steps: int, seed: int) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from actnn_zoo import demo
    from actnn_zoo.data import load_text_corpus, random_windows
    from actnn_zoo.memory import compression_ratio
    from bits_vs_loss import strategy_bits

    torch.set_num_threads(1)
    cfg = CANDIDATES[cand]
    setup = demo.TextSetup(steps=steps)
    corpus = load_text_corpus(setup.num_chars)
    t0 = time.perf_counter()
    if cfg is None:
        res = demo.train_text("fp32", setup, seed, corpus, None, None, progress=False)
    elif cfg == "default":
        res = demo.train_text("bits", setup, seed, corpus, None, None, progress=False)
    else:
        res = demo.train_text("bits", setup, seed, corpus, None, cfg, progress=False)
    seconds = time.perf_counter() - t0
    ratio, sbits = 1.0, None
    if cfg is not None:
        xb, yb = random_windows(corpus.train, setup.context, setup.batch_size,
                                torch.Generator().manual_seed(0))
        ref = demo.make_text_model(setup, corpus.vocab_size, "fp32", seed)
        ratio = compression_ratio(ref, res.model, xb, loss_fn=lambda out: F.cross_entropy(
            out.reshape(-1, out.shape[-1]), yb.reshape(-1)))
        sbits = strategy_bits(res.model, {"bits": 2} if cfg == "default" else cfg)
    return {"name": run_name(cand, steps, seed), "candidate": cand, "config": cfg,
            "steps": steps, "seed": seed, "val_loss": res.metric, "compression": ratio,
            "storage_bits": 32.0 / ratio, "qlayer_bits": sbits, "train_seconds": seconds,
            "final_train_loss": statistics.fmean(res.losses[-20:]),
            "torch": torch.__version__}


def report(directory: Path) -> str:
    recs = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    fp32 = {(r["steps"], r["seed"]): r["val_loss"] for r in recs if r["candidate"] == "fp32"}
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in recs:
        groups.setdefault((r["steps"], r["candidate"]), []).append(r)
    lines = [f"{'steps':>5}  {'config':16s} {'seeds':7s} {'val loss':>8s} {'vs fp32 (per seed)':32s}"
             f" {'compr.':>7s} {'Q bits':>6s}"]
    for (steps, cand), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["seed"])
        vs = [100 * (r["val_loss"] / fp32[steps, r["seed"]] - 1) for r in rs
              if (steps, r["seed"]) in fp32]
        per = ", ".join(f"{v:+.2f}" for v in vs)
        mean_vs = f"{statistics.fmean(vs):+.2f}% ({per})" if vs else ""
        qb = [r["qlayer_bits"] for r in rs if r["qlayer_bits"] is not None]
        lines.append(f"{steps:5d}  {cand:16s} {','.join(str(r['seed']) for r in rs):7s} "
                     f"{statistics.fmean(r['val_loss'] for r in rs):8.4f} {mean_vs:32s} "
                     f"{statistics.fmean(r['compression'] for r in rs):6.1f}x "
                     f"{statistics.fmean(qb) if qb else float('nan'):6.2f}")
    return "\n".join(lines)


def plot(directory: Path, out: Path) -> str:
    """Validation loss vs fp32 against saved bits (32 / compression), 300 steps, seed 0: the
    old default's curve (``actnn`` at 1.5-4 bits with plain settings, from
    ``results/bits_vs_loss/``) beside the new default's rules at budgets 2.75-4.5 (this
    script's ``t*`` runs); the 1000-step points of both defaults as larger markers. Returns
    the table it plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def load(p: Path) -> Dict[str, Any]:
        return json.loads(p.read_text())

    bvl = ROOT / "results" / "bits_vs_loss"
    fp = load(bvl / "text_fp32_s0.json")["metric"]
    old = [(32 / r["compression"], 100 * (r["metric"] / fp - 1), r["label"])
           for r in map(load, sorted(bvl.glob("text_actnn_*b_s0.json")))]
    recs = {r["name"]: r for r in map(load, sorted(directory.glob("*.json")))}
    fp300 = recs["text_fp32_300st_s0"]["val_loss"]
    new = [(r["storage_bits"], 100 * (r["val_loss"] / fp300 - 1), r["candidate"])
           for n, r in recs.items() if r["steps"] == 300 and r["seed"] == 0
           and (r["candidate"] in ("t2.75", "default", "t3.75", "t4.5"))]
    long = []
    # the default now: the probabilities saved once (its runs in their own directory)
    now = {r["name"]: r for r in map(load, sorted(
        (ROOT / "results" / "default_fidelity_derived").glob("text_default_1000st_s*.json")))}
    for cand, label, pool in (("t3.25_attnlin4", "first new default", recs),
                              ("t3.25", "first new default without attention linears", recs),
                              ("t3.375_ln4_head4", "second default", recs),
                              ("default", "the default now", now)):
        rs = [r for r in pool.values() if r["candidate"] == cand and r["steps"] == 1000]
        if rs:
            vs = statistics.fmean(100 * (r["val_loss"] / recs[f"text_fp32_1000st_s{r['seed']}"]
                                         ["val_loss"] - 1) for r in rs)
            long.append((statistics.fmean(r["storage_bits"] for r in rs), vs,
                         f"{label}, 1000 steps, {len(rs)} seeds"))
    long.append((32 / 15.9, 8.7, "old default, 1000 steps, 3 seeds"))  # results.md (demo)
    old.sort()
    new.sort()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([p[0] for p in old], [p[1] for p in old], "o-", label="old default (actnn, plain), 300 steps")
    ax.plot([p[0] for p in new], [p[1] for p in new], "s-", label="new default's rules, 300 steps")
    for x, y, lab in long:
        ax.plot([x], [y], "D", markersize=8, label=lab)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(3.2, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("saved bits per value (32 / compression); dotted: 10x")
    ax.set_ylabel("validation loss vs fp32 (%)")
    ax.set_title("char transformer: the default's bits against loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    rows = [f"{lab:40s} {x:5.2f} bits ({32 / x:4.1f}x)  {y:+.2f}%" for x, y, lab in old + new + long]
    return "\n".join(rows)


def compression(warmups: Sequence[int] = (1, 2)) -> str:
    """Saved-activation compression at convert_model's default of scripts/bench_capture.py's
    project and Hugging Face models, counted after ``w`` discarded training forwards for each
    ``w`` in ``warmups``: after 1 (bench_capture's count) the free layers still use the budget
    itself, as ``actnn`` re-allocates at the second forward and applies it at the third;
    after 2 the budget is compensated for the pinned layers and the tiers (steady state)."""
    import copy
    import warnings

    import torch

    import actnn_zoo as az
    from actnn_zoo.config import default_config
    from actnn_zoo.memory import saved_activation_bytes
    from bench_capture import hf_cases, project_cases

    torch.set_num_threads(1)
    lines = []
    cases = {**project_cases(), **hf_cases()}
    for name, (build, x, loss, _label) in cases.items():
        torch.manual_seed(0)
        model = build().train()
        fp32 = saved_activation_bytes(model, x, loss_fn=loss).total_bytes
        ratios = []
        for w in warmups:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = az.convert_model(copy.deepcopy(model))
            ratios.append(fp32 / max(saved_activation_bytes(q, x, loss_fn=loss,
                                                            warmup=w).total_bytes, 1))
        cfg = default_config(model)
        lines.append(f"{name:22s} default bits {cfg.bits:g}: " + ", ".join(
            f"{r:5.1f}x after {w} forward(s)" for w, r in zip(warmups, ratios)))
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "results" / "default_fidelity"))
    ap.add_argument("--runs", default="", help="comma list of CANDIDATES names")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--compression", action="store_true",
                    help="compression at the default of bench_capture's project / HF models")
    ap.add_argument("--plot", action="store_true",
                    help="results/default_fidelity.png: the old default's curve and the new one")
    args = ap.parse_args(argv)
    if args.compression:
        compression()  # prints each model's line as it is measured
        return
    if args.plot:
        print(plot(Path(args.dir), ROOT / "results" / "default_fidelity.png"))
        return
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    for cand in [c for c in args.runs.split(",") if c]:
        if cand not in CANDIDATES:
            raise SystemExit(f"unknown candidate {cand!r}; known: {', '.join(CANDIDATES)}")
        for seed in [int(s) for s in args.seeds.split(",")]:
            path = directory / f"{run_name(cand, args.steps, seed)}.json"
            if path.exists():
                continue
            rec = execute(cand, args.steps, seed)
            path.write_text(json.dumps(rec, indent=1))
            print(f"[{time.strftime('%H:%M:%S')}] {rec['name']}: val {rec['val_loss']:.4f}, "
                  f"{rec['compression']:.1f}x, Q bits {rec['qlayer_bits']}, "
                  f"{rec['train_seconds']:.0f} s", flush=True)
    print(report(directory))


if __name__ == "__main__":
    main()
