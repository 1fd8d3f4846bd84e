#!/usr/bin/env python
"""Average bits against validation loss: the precision strategies on the demo's text
transformer, and their accuracy / loss against fp32 on the demo's digits CNN.

Every run trains the demo's model (``actnn_zoo.demo.train_text`` / ``train_digits``: same
initial weights, data order and optimizer as ``python -m actnn_zoo.demo`` for a seed) with a
plain config whose only difference is the strategy and its budget:

* ``uniform`` at ``bits`` (1, 2, 4 or 8), ``actnn`` / ``gact`` at an average budget ``bits``,
  ``acgc`` at an error fraction ``e`` (its average width is an outcome), ``division``:
  ``compressor: division`` (block 8) with uniform 2-bit residuals;
* everything else the library's default: group 256, stochastic rounding, capture on with
  ``capture_bits`` unset (the tiers then use the largest supported width <= ``bits``), the
  strategies' default ``update_interval`` (10; the rows were trained at 1 before it became 10,
  and re-trained after) -- except ``gact``, which probes every
  ``GACT_INTERVAL`` steps (3 extra passes per probe; the README advises 100-1000).

Per run it records the final metric, the training losses and two "realised bits":

* ``strategy_bits``: the average width over the values the Q-layers compressed in one
  training forward after training (the one ``storage_bits`` measures), as the strategy set it (``report()["average_bits"]`` for gact / acgc; for
  actnn the per-sample widths on ``precision_stats.bits`` weighted by values; uniform: its
  width). This counts the Q-layers only, not what the capture tiers compress.
* ``storage_bits``: 32 / the saved-activation compression of one training batch after
  training (``actnn_zoo.memory.compression_ratio``: fp32 bytes over what autograd and the
  capture store hold after one forward plus the loss), i.e. bits per saved fp32 value with
  the ranges, the capture tiers and whatever stays uncompressed.

Usage (one training process at a time; each run in its own child process, resumable: a run
whose JSON exists under ``--dir`` is skipped)::

    PYTHONPATH=. .venv/bin/python scripts/bits_vs_loss.py                 # all runs, then report
    PYTHONPATH=. .venv/bin/python scripts/bits_vs_loss.py --groups curve  # a subset
    PYTHONPATH=. .venv/bin/python scripts/bits_vs_loss.py --report        # table + plot only
    PYTHONPATH=. .venv/bin/python scripts/bits_vs_loss.py --list          # the planned runs
    PYTHONPATH=. .venv/bin/python scripts/bits_vs_loss.py --probe-acgc    # e -> bits, 30 steps

Writes ``<dir>/<run>.json`` per run, ``results/bits_vs_loss.json`` (all runs),
``results/bits_vs_loss.txt`` (tables) and ``results/bits_vs_loss.png`` (the plot).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

TEXT_STEPS = 300
GACT_INTERVAL = 20
DIGITS_EPOCHS = 30
STRATEGIES = ("uniform", "actnn", "gact", "acgc", "division")


@dataclass(frozen=True)
class Run:
    """One training run: ``task`` text or digits, ``strategy`` fp32 or one of STRATEGIES,
    ``level`` the bits budget (uniform / actnn / gact / division) or the error fraction
    (acgc), ``group`` which part of the plan it belongs to, ``steps`` text steps when not
    TEXT_STEPS."""

    task: str
    strategy: str
    level: Optional[float]
    seed: int
    group: str
    steps: Optional[int] = None

    @property
    def name(self) -> str:
        lvl = "" if self.level is None else "_" + (f"e{self.level:g}" if self.strategy == "acgc"
                                                   else f"{self.level:g}b")
        st = "" if self.steps is None else f"_{self.steps}st"
        return f"{self.task}_{self.strategy}{lvl}{st}_s{self.seed}"

    @property
    def label(self) -> str:
        st = "" if self.steps is None else f" ({self.steps} steps)"
        if self.strategy == "fp32":
            return "fp32" + st
        if self.strategy == "acgc":
            return f"acgc e={self.level:g}" + st
        return f"{self.strategy} {self.level:g}" + st


def config_for(run: Run) -> Optional[Dict[str, Any]]:
    """The convert_model config of ``run`` (None: fp32)."""
    s, lvl = run.strategy, run.level
    if s == "fp32":
        return None
    if s == "uniform":
        return {"strategy": "uniform", "bits": int(lvl)}
    if s == "actnn":
        return {"strategy": "actnn", "bits": float(lvl)}
    if s == "gact":
        return {"strategy": "gact", "bits": float(lvl), "update_interval": GACT_INTERVAL}
    if s == "acgc":
        return {"strategy": "acgc", "error_fraction": float(lvl)}
    if s == "division":
        return {"strategy": "uniform", "bits": int(lvl), "compressor": "division",
                "division_block": 8}
    raise ValueError(f"unknown strategy {s!r}")


# acgc's error fractions: chosen from --probe-acgc (30 text steps) to land near 2-4 bits
# (e=2: 1.72, 1: 2.16, 0.3: 3.38, 0.1: 4.75 bits after 30 steps)
ACGC_E_TEXT = (1.0, 0.3, 0.1, 2.0)
ACGC_E_2BIT_TEXT = 1.0
ACGC_E_2BIT_DIGITS = 2.0  # bench_strategies: e = 2 -> 1.96 bits on the digits CNN


def plan() -> List[Run]:
    """All runs in priority order."""
    runs: List[Run] = [Run("text", "fp32", None, 0, "curve")]
    runs += [Run("text", "uniform", 2, 0, "curve"), Run("text", "actnn", 2, 0, "curve"),
             Run("text", "uniform", 4, 0, "curve"), Run("text", "actnn", 4, 0, "curve"),
             Run("text", "actnn", 1.5, 0, "curve"), Run("text", "actnn", 3, 0, "curve")]
    runs += [Run("text", "gact", 2, 0, "strategies"),
             Run("text", "acgc", ACGC_E_2BIT_TEXT, 0, "strategies"),
             Run("text", "division", 2, 0, "strategies")]
    for seed in (0, 1, 2):
        runs += [Run("digits", "fp32", None, seed, "digits")]
        runs += [Run("digits", s, ACGC_E_2BIT_DIGITS if s == "acgc" else 2, seed, "digits")
                 for s in STRATEGIES]
    runs += [Run("text", "gact", b, 0, "strategies") for b in (4, 1.5, 3)]
    runs += [Run("text", "acgc", e, 0, "strategies") for e in ACGC_E_TEXT
             if e != ACGC_E_2BIT_TEXT]
    for seed in (1, 2):
        runs += [Run("text", "fp32", None, seed, "seeds")]
        runs += [Run("text", s, ACGC_E_2BIT_TEXT if s == "acgc" else 2, seed, "seeds")
                 for s in STRATEGIES]
    # the demo's full length (1000 text steps), seed 0, the 2-bit point and 4 bits
    runs += [Run("text", "fp32", None, 0, "long", 1000)]
    runs += [Run("text", s, ACGC_E_2BIT_TEXT if s == "acgc" else 2, 0, "long", 1000)
             for s in STRATEGIES]
    runs += [Run("text", "actnn", 4, 0, "long", 1000)]
    # the ends of the curve and its other points on seeds 1-2
    runs += [Run("text", "uniform", b, 0, "extra") for b in (1, 8)]
    for seed in (1, 2):
        runs += [Run("text", "uniform", 4, seed, "extra")]
        runs += [Run("text", "actnn", b, seed, "extra") for b in (1.5, 3, 4)]
        runs += [Run("text", "gact", b, seed, "extra") for b in (1.5, 3, 4)]
        runs += [Run("text", "acgc", e, seed, "extra") for e in ACGC_E_TEXT
                 if e != ACGC_E_2BIT_TEXT]
    return runs


def by_name() -> Dict[str, Run]:
    return {r.name: r for r in plan()}


# ------------------------------------------------------------------------ one run ----
def strategy_bits(model: Any, cfg: Optional[Dict[str, Any]]) -> Optional[float]:
    """The value-weighted average width the Q-layers used in the last training forward."""
    if cfg is None:
        return None
    from actnn_zoo.convert import precision_strategy

    s = precision_strategy(model)
    if hasattr(s, "report"):  # gact, acgc
        return float(s.report()["average_bits"])
    watched = getattr(s, "watched", None)
    if watched is None:  # uniform: every Q-layer at its configured width (no rules here)
        return float(cfg["bits"])
    bits = values = 0.0
    for w in watched:  # actnn: per-sample widths of the last forward
        st = w.stats
        if not st.values:
            continue
        b = (float(st.bits.double().mean()) if st.bits is not None
             else float(w.pinned_bits or w.module.qconfig.bits))
        bits, values = bits + b * st.values, values + st.values
    return bits / values if values else float("nan")


def execute(run: Run, threads: int) -> Dict[str, Any]:
    """Train ``run`` in this process; the record its JSON holds."""
    import torch
    import torch.nn.functional as F

    from actnn_zoo import demo
    from actnn_zoo.data import load_digits_data, load_text_corpus, random_windows
    from actnn_zoo.memory import compression_ratio

    torch.set_num_threads(threads)
    cfg = config_for(run)
    mode = "fp32" if cfg is None else "bits"
    t0 = time.perf_counter()
    if run.task == "text":
        setup = demo.TextSetup(steps=run.steps or TEXT_STEPS)
        corpus = load_text_corpus(setup.num_chars)
        res = demo.train_text(mode, setup, run.seed, corpus, None, cfg, progress=False)
        xb, yb = random_windows(corpus.train, setup.context, setup.batch_size,
                                torch.Generator().manual_seed(0))
        ref = demo.make_text_model(setup, corpus.vocab_size, "fp32", run.seed)
        sizes: Dict[str, Any] = asdict(setup)
    elif run.task == "digits":
        setup_d = demo.DigitsSetup(epochs=DIGITS_EPOCHS)
        data = load_digits_data()
        res = demo.train_digits(mode, setup_d, run.seed, data, None, cfg, progress=False)
        xb, yb = data.x_train[:setup_d.batch_size], data.y_train[:setup_d.batch_size]
        ref = demo.make_digits_model(setup_d, "fp32", run.seed)
        sizes = asdict(setup_d)
    else:
        raise ValueError(run.task)
    seconds = time.perf_counter() - t0
    extra: Dict[str, Any] = {}
    if cfg is not None:
        from actnn_zoo.convert import precision_strategy

        rep = getattr(precision_strategy(res.model), "report", None)
        if rep is not None:
            extra = {k: v for k, v in rep().items() if k in ("widths", "updates", "probes")}
        ratio = compression_ratio(ref, res.model, xb, loss_fn=lambda out: F.cross_entropy(
            out.reshape(-1, out.shape[-1]), yb.reshape(-1)))
    else:
        ratio = 1.0
    # after the compression forward: a training forward on a training batch (the evaluation's
    # no-grad forwards reset what gact records as compressed)
    sbits = strategy_bits(res.model, cfg)
    return {"name": run.name, "run": asdict(run), "label": run.label, "config": cfg,
            "metric_name": "val_loss" if run.task == "text" else "acc%",
            "metric": res.metric, "strategy_bits": sbits, "compression": ratio,
            "storage_bits": 32.0 / ratio, "train_seconds": seconds,
            "final_train_loss": statistics.fmean(res.losses[-20:]),
            "losses": res.losses, "setup": sizes, "strategy_report": extra,
            "threads": threads, "torch": torch.__version__}


def run_path(directory: Path, run: Run) -> Path:
    return directory / f"{run.name}.json"


def pending(runs: Sequence[Run], directory: Path) -> List[Run]:
    """The runs whose JSON is not there yet (resumability)."""
    return [r for r in runs if not run_path(directory, r).exists()]


def run_child(run: Run, directory: Path, threads: int, log: Any) -> bool:
    """Train ``run`` in a child process (one at a time); True when its JSON was written."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", json.dumps(asdict(run)),
           "--threads", str(threads), "--dir", str(directory)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"[{time.strftime('%H:%M:%S')}] {run.name} ...", file=log, flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=log)
    ok = p.returncode == 0 and run_path(directory, run).exists()
    print(f"[{time.strftime('%H:%M:%S')}] {run.name} {'done' if ok else 'FAILED'} "
          f"({time.perf_counter() - t:.0f} s)", file=log, flush=True)
    return ok


# ------------------------------------------------------------------------- report ----
def load_records(directory: Path) -> List[Dict[str, Any]]:
    out = []
    for p in sorted(directory.glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # a run being written
    return out


def _fmt(v: Optional[float], spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def summarize(records: Sequence[Dict[str, Any]], task: str) -> List[Dict[str, Any]]:
    """One row per (strategy, level): mean / std of the metric over seeds, bits of seed 0 (or
    the mean), the change against fp32's mean on the same seeds."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in records:
        if r["run"]["task"] == task:
            groups.setdefault(r["label"], []).append(r)
    fp32 = {(r["run"]["seed"], r["run"].get("steps")): r["metric"] for r in records
            if r["run"]["task"] == task and r["run"]["strategy"] == "fp32"}
    rows = []
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["run"]["seed"])
        m = [r["metric"] for r in rs]
        seeds = [r["run"]["seed"] for r in rs]
        steps = rs[0]["run"].get("steps")
        ref = [fp32[s, steps] for s in seeds if (s, steps) in fp32]
        ref_mean = statistics.fmean(ref) if len(ref) == len(seeds) else None
        mean = statistics.fmean(m)
        sb = [r["strategy_bits"] for r in rs if r["strategy_bits"] is not None]
        rows.append({"label": label, "strategy": rs[0]["run"]["strategy"], "steps": steps,
                     "level": rs[0]["run"]["level"], "seeds": seeds, "metric": mean,
                     "std": statistics.stdev(m) if len(m) > 1 else None, "per_seed": m,
                     "fp32": ref_mean,
                     "vs_fp32": (None if ref_mean is None else
                                 (100 * (mean - ref_mean) / ref_mean if task == "text"
                                  else mean - ref_mean)),
                     "strategy_bits": statistics.fmean(sb) if sb else None,
                     "storage_bits": statistics.fmean(r["storage_bits"] for r in rs),
                     "compression": statistics.fmean(r["compression"] for r in rs),
                     "train_seconds": statistics.fmean(r["train_seconds"] for r in rs)})
    order = {s: i for i, s in enumerate(("fp32",) + STRATEGIES)}
    rows.sort(key=lambda r: (r["steps"] or 0, order.get(r["strategy"], 99), -(r["strategy_bits"] or 99)
                             if r["strategy"] == "acgc" else (r["level"] or 0)))
    return rows


def table(rows: Sequence[Dict[str, Any]], task: str, seeds_filter: Optional[int] = None) -> str:
    metric = "val loss" if task == "text" else "test acc %"
    vs = "vs fp32 %" if task == "text" else "vs fp32 (pts)"
    head = ["run", "seeds", metric, "fp32 same seeds", vs, "Q-layer avg bits",
            "storage bits", "saved x", "train s"]
    cells = [head]
    for r in rows:
        if seeds_filter is not None and len(r["seeds"]) != seeds_filter:
            continue
        d = 4 if task == "text" else 2
        met = f"{r['metric']:.{d}f}" + (f" ± {r['std']:.{d}f}" if r["std"] is not None else "")
        cells.append([r["label"], ",".join(map(str, r["seeds"])), met,
                      _fmt(r["fp32"], f".{d}f"), _fmt(r["vs_fp32"], "+.2f"),
                      _fmt(r["strategy_bits"], ".3f"), _fmt(r["storage_bits"], ".3f"),
                      _fmt(r["compression"], ".1f"), _fmt(r["train_seconds"], ".0f")])
    w = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(w[i]) for i in range(len(head))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def markdown(rows: Sequence[Dict[str, Any]], task: str) -> str:
    """README table: one line per run label."""
    text = task == "text"
    d = 4 if text else 2
    out = [f"| run | seeds | Q-layer avg bits | saved x (32 / x bits) | "
           f"{'val loss' if text else 'test acc %'} | fp32, same seeds | "
           f"{'vs fp32' if text else 'vs fp32 (points)'} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = f"{r['metric']:.{d}f}" + (f" ± {r['std']:.{d}f}" if r["std"] is not None else "")
        vs = _fmt(r["vs_fp32"], "+.2f") + ("%" if text and r["vs_fp32"] is not None else "")
        out.append(f"| {r['label']} | {','.join(map(str, r['seeds']))} | "
                   f"{_fmt(r['strategy_bits'], '.2f') or '-'} | {r['compression']:.1f}x "
                   f"({r['storage_bits']:.2f}) | {met} | {_fmt(r['fp32'], f'.{d}f')} | {vs} |")
    return "\n".join(out)


def seed0_rows(records: Sequence[Dict[str, Any]], task: str,
               steps: Optional[int] = None) -> List[Dict[str, Any]]:
    """Seed 0 only, runs of ``steps`` text steps (None: TEXT_STEPS)."""
    return summarize([r for r in records if r["run"]["seed"] == 0
                      and r["run"].get("steps") == steps], task)


STYLE = {"uniform": dict(color="tab:blue", marker="s"), "actnn": dict(color="tab:orange",
                                                                      marker="o"),
         "gact": dict(color="tab:green", marker="^"), "acgc": dict(color="tab:red", marker="D"),
         "division": dict(color="tab:purple", marker="*", markersize=12)}


def plot(records: Sequence[Dict[str, Any]], out: Path) -> Optional[Path]:
    """x: realised average bits, y: validation loss (text, TEXT_STEPS steps), one line per
    strategy through the seed-0 runs, fp32 dashed; where a point has more seeds, their mean
    and std as an error bar beside it. Left: the Q-layers' average width; right: 32 / the
    saved-activation compression."""
    rows = seed0_rows(records, "text")
    if not rows:
        return None
    multi = {r["label"]: r for r in summarize(
        [r for r in records if r["run"].get("steps") is None], "text") if len(r["seeds"]) > 1}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 5), sharey=True)
    fp32 = next((r for r in rows if r["strategy"] == "fp32"), None)
    # the y range of the budget strategies; points above it are drawn on the top edge
    core = [r["metric"] for r in rows if r["strategy"] in ("fp32", "uniform", "actnn", "gact")]
    top = max(core) + 0.02 if core else None
    for ax, key, xlabel in (
            (axes[0], "strategy_bits", "average width of the Q-layers' saved values (bits)"),
            (axes[1], "storage_bits", "32 / saved-activation compression (bits per fp32 value)")):
        for s in STRATEGIES:
            pts = sorted((r[key], r["metric"], r["label"]) for r in rows
                         if r["strategy"] == s and r[key] is not None)
            if not pts:
                continue
            off = [p for p in pts if top is not None and p[1] > top]
            pts_in = [p for p in pts if p not in off]
            ax.plot([p[0] for p in pts_in], [p[1] for p in pts_in], label=f"{s} (seed 0)",
                    **{"linestyle": "-", **STYLE[s]})
            for x, y, lab in off:
                ax.annotate(f"{lab}: {y:.3f} (off the scale)", (x, top), xytext=(x, top - 0.012),
                            fontsize=7, color=STYLE[s]["color"], ha="right",
                            arrowprops=dict(arrowstyle="->", color=STYLE[s]["color"]))
            pts = pts_in
            for x, y, lab in pts:
                m = multi.get(lab)
                if m is not None and m[key] is not None:
                    ax.errorbar(m[key] + 0.04, m["metric"], yerr=m["std"], fmt="none",
                                ecolor=STYLE[s]["color"], elinewidth=1.2, capsize=3,
                                alpha=0.7)
                    ax.plot(m[key] + 0.04, m["metric"], marker=STYLE[s]["marker"],
                            markerfacecolor="white", color=STYLE[s]["color"], linestyle="none")
                if s in ("acgc", "division"):
                    ax.annotate(lab.split(" ", 1)[-1], (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=7, color=STYLE[s]["color"])
        if fp32 is not None:
            ax.axhline(fp32["metric"], color="black", linestyle="--",
                       label=f"fp32, seed 0 ({fp32['metric']:.3f})")
            ax.axhline(fp32["metric"] * 1.01, color="gray", linestyle=":", linewidth=1,
                       label="fp32 + 1%")
        if "fp32" in multi:
            ax.axhline(multi["fp32"]["metric"], color="black", linestyle="-.", linewidth=0.8,
                       label=f"fp32, mean of seeds {','.join(map(str, multi['fp32']['seeds']))}"
                             f" ({multi['fp32']['metric']:.3f})")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if top is not None:
            ax.set_ylim(top=top)
    axes[0].set_ylabel("validation loss (nats / char)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"stdlib char transformer, {TEXT_STEPS} steps: bits vs validation loss "
                 f"(lines: seed 0; hollow markers: mean ± std over seeds 0-2 where run)",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(directory: Path, results: Path) -> str:
    records = load_records(directory)
    text = [f"bits_vs_loss: {len(records)} runs under {directory.relative_to(ROOT) if directory.is_relative_to(ROOT) else directory}",
            f"text: demo transformer, {TEXT_STEPS} steps (the full demo runs 1000), "
            f"vs fp32 % = (loss - fp32) / fp32 on the same seeds; digits: demo CNN, "
            f"{DIGITS_EPOCHS} epochs, vs fp32 in accuracy points.",
            "Q-layer avg bits: the strategy's widths over the Q-layers' values in the last "
            "training forward; storage bits: 32 / saved-activation compression of one "
            "training batch after training (ranges, capture tiers, uncompressed tensors "
            "included).", ""]
    for task in ("text", "digits"):
        if not any(r["run"]["task"] == task for r in records):
            continue
        text.append(f"== {task}, seed 0" + (f", {TEXT_STEPS} steps" if task == "text" else ""))
        text.append(table(seed0_rows(records, task), task))
        multi = [r for r in summarize(records, task) if len(r["seeds"]) > 1]
        if multi:
            text.append(f"\n== {task}, all seeds run (mean ± std over seeds)")
            text.append(table(multi, task))
        longer = sorted({r["run"].get("steps") for r in records if r["run"]["task"] == task}
                        - {None})
        for steps in longer:
            text.append(f"\n== {task}, seed 0, {steps} steps")
            text.append(table(seed0_rows(records, task, steps), task))
        text.append("")
    out = "\n".join(text)
    results.mkdir(parents=True, exist_ok=True)
    (results / "bits_vs_loss.txt").write_text(out + "\n")
    (results / "bits_vs_loss.json").write_text(json.dumps(
        {"text_steps": TEXT_STEPS, "digits_epochs": DIGITS_EPOCHS, "gact_interval": GACT_INTERVAL,
         "summary": {t: summarize(records, t) for t in ("text", "digits")},
         "runs": [{k: v for k, v in r.items() if k != "losses"} for r in records]}, indent=1))
    plot(records, results / "bits_vs_loss.png")
    return out


def probe_acgc(values: Sequence[float], steps: int, threads: int) -> None:
    """acgc's average width after ``steps`` text steps for each error fraction."""
    import torch

    from actnn_zoo import demo
    from actnn_zoo.data import load_text_corpus

    torch.set_num_threads(threads)
    setup = demo.TextSetup(steps=TEXT_STEPS)
    corpus = load_text_corpus(setup.num_chars)
    for e in values:
        cfg = {"strategy": "acgc", "error_fraction": e}
        res = demo.train_text("bits", setup, 0, corpus, None, cfg, max_steps=steps,
                              progress=False)
        print(f"acgc e={e:g}: {strategy_bits(res.model, cfg):.3f} bits after {steps} steps",
              flush=True)


def division_probe(draws: int = 20) -> List[str]:
    """Mean squared round-trip error at 2 bits, DIVISION (block 8) against the per-group
    quantizer (group 256), on two synthetic tensors shaped like the text transformer's:
    (8, 64, 128) token activations with a per-feature scale and offset, and (8, 4, 64, 64)
    attention probabilities (softmax over 64 keys of N(0, 3^2) logits)."""
    import torch

    from actnn_zoo.quant import dequantize, quantize
    from actnn_zoo.quant.division import division_dequantize, division_quantize

    torch.manual_seed(0)
    cases = {"activations (8, 64, 128)": torch.randn(8, 64, 128) * torch.rand(1, 1, 128) * 3
             + torch.randn(1, 1, 128),
             "attention probs (8, 4, 64, 64)": torch.randn(8, 4, 64, 64).mul(3).softmax(-1)}
    lines = []
    for name, x in cases.items():
        div = sum(float((division_dequantize(division_quantize(x, 2, 8)) - x).square().mean())
                  for _ in range(draws)) / draws
        q = sum(float((dequantize(quantize(x, 2, 256)) - x).square().mean())
                for _ in range(draws)) / draws
        lines.append(f"{name}: 2-bit MSE division (B=8) {div:.4g}, per-group quantizer "
                     f"(group 256) {q:.4g}, ratio {div / q:.2f}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "results" / "bits_vs_loss"),
                    help="one JSON per run (existing ones are skipped)")
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--groups", default="curve,strategies,digits,seeds,long,extra",
                    help="comma list of plan groups to run")
    ap.add_argument("--only", default=None, help="comma list of run names, run in that order")
    ap.add_argument("--run", default=None, help="train this one run here (child mode): a run "
                    "name of the plan or the JSON of a Run")
    ap.add_argument("--report", action="store_true", help="only the tables and the plot")
    ap.add_argument("--list", action="store_true", help="print the plan and what is done")
    ap.add_argument("--markdown", action="store_true", help="print the README's tables")
    ap.add_argument("--probe-acgc", action="store_true")
    ap.add_argument("--division-probe", action="store_true",
                    help="DIVISION's round-trip error against the quantizer's, no training")
    args = ap.parse_args(argv)
    directory, results = Path(args.dir), Path(args.results)
    if args.probe_acgc:
        probe_acgc((0.03, 0.1, 0.3, 1.0, 2.0), 30, args.threads)
        return
    if args.division_probe:
        print("\n".join(division_probe()))
        return
    if args.run:
        run = (Run(**json.loads(args.run)) if args.run.lstrip().startswith("{")
               else by_name()[args.run])
        rec = execute(run, args.threads)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = run_path(directory, run).with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(run_path(directory, run))
        print(f"{run.name}: {rec['metric_name']} {rec['metric']:.4f}, Q-layer bits "
              f"{_fmt(rec['strategy_bits'], '.3f')}, storage bits {rec['storage_bits']:.3f}, "
              f"{rec['train_seconds']:.0f} s", flush=True)
        return
    groups = {g.strip() for g in args.groups.split(",") if g.strip()}
    runs = [r for r in plan() if r.group in groups]
    if args.only:
        known = by_name()
        runs = [known[n.strip()] for n in args.only.split(",") if n.strip()]  # in this order
    if args.markdown:
        recs = load_records(directory)
        for task in ("text", "digits"):
            print(f"\n{task}, seed 0\n" + markdown(seed0_rows(recs, task), task))
            multi = [r for r in summarize(recs, task) if len(r["seeds"]) > 1]
            if multi:
                print(f"\n{task}, seeds\n" + markdown(multi, task))
            for st in sorted({r["run"].get("steps") for r in recs
                              if r["run"]["task"] == task} - {None}):
                print(f"\n{task}, {st} steps\n" + markdown(seed0_rows(recs, task, st), task))
        return
    if args.list:
        todo = set(r.name for r in pending(runs, directory))
        for r in runs:
            print(f"{'todo' if r.name in todo else 'done'}  {r.group:10s} {r.name}")
        return
    if not args.report:
        for run in pending(runs, directory):
            run_child(run, directory, args.threads, sys.stdout)
    print(report(directory, results))


if __name__ == "__main__":
    main()
