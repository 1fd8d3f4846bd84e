#!/usr/bin/env python
"""PNG plots from the JSON the benchmarks and the demo write (matplotlib, Agg backend).

* peak_memory_vs_batch.png  from bench_memory.json ("sweep": bench_memory.py --sweep ...)
* compression.png           from bench_memory.json ("rows")
* throughput_vs_batch.png   from bench_speed.json (bench_speed.py --batches ...)
* training_curves.png       from demo.json (python -m actnn_zoo.demo --json ...)

    .venv/bin/python scripts/plots.py --results results --out results
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 2 ** 20
STYLE = {"fp32": dict(color="black", marker="o"), "checkpoint": dict(color="tab:blue",
                                                                     marker="s")}


def _save(fig: "plt.Figure", path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _load(path: Path) -> Optional[Dict[str, Any]]:
    if not path.exists():
        print(f"skip: {path} not found")
        return None
    with open(path) as f:
        return json.load(f)


def _style(mode: str) -> Dict[str, Any]:
    return STYLE.get(mode, dict(color="tab:red", marker="^"))


def peak_vs_batch(data: Dict[str, Any], out: Path) -> Optional[Path]:
    sweep = [r for r in data.get("sweep", []) if not r.get("error")]
    if not sweep:
        print("skip: no peak-memory sweep in bench_memory.json (run it with --sweep)")
        return None
    series: Dict[str, List] = defaultdict(list)
    for r in sweep:
        series[r["mode"]].append((r["batch"], r["peak_bytes"] / MiB))
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in series.items():
        pts.sort()
        ax.plot([b for b, _ in pts], [m for _, m in pts], label=mode, **_style(mode))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("peak memory of a step over warmed-up state (MiB)")
    ax.set_title(f"{sweep[0]['model']}: peak memory vs batch size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, out / "peak_memory_vs_batch.png")


def compression(data: Dict[str, Any], out: Path) -> Optional[Path]:
    rows = [r for r in data.get("rows", []) if r.get("saved_ratio") and r["mode"] != "fp32"]
    if not rows:
        return None
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    modes = sorted({r["mode"] for r in rows}, key=[r["mode"] for r in rows].index)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = [next((r["saved_ratio"] for r in rows if r["model"] == m and r["mode"] == mode),
                     0) for m in models]
        ax.bar([j + i * width for j in range(len(models))], vals, width, label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models, rotation=15)
    ax.set_ylabel("saved-activation bytes, fp32 / mode")
    ax.set_title("compression of what is saved for backward")
    ax.axhline(1, color="gray", lw=0.8)
    ax.legend(fontsize=8)
    return _save(fig, out / "compression.png")


def throughput_vs_batch(data: Dict[str, Any], out: Path) -> Optional[Path]:
    rows = [r for r in data.get("rows", []) if "samples_per_s" in r]
    if not rows:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        series: Dict[str, List] = defaultdict(list)
        for r in rows:
            if r["model"] == model:
                series[r["mode"]].append((r["batch"], r["samples_per_s"]))
        for mode, pts in series.items():
            pts.sort()
            ax.plot([b for b, _ in pts], [s for _, s in pts], label=mode, **_style(mode))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("training samples / s")
        ax.set_title(f"{model}: throughput (threads {data.get('threads')})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "throughput_vs_batch.png")


def _smooth(xs: Sequence[float], k: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc = x if i == 0 else (1 - 1 / k) * acc + x / k
        out.append(acc)
    return out


def training_curves(data: Dict[str, Any], out: Path) -> Optional[Path]:
    rows = [r for r in data.get("rows", []) if r.get("curve")]
    if not rows:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r["model"] == model:
                k = max(1, len(r["curve"]) // 50)
                # fp32 wide and checkpoint dashed: checkpointing is exact, so they coincide.
                lw, ls = {"fp32": (2.4, "-"), "checkpoint": (1.2, "--")}.get(r["mode"],
                                                                            (1.2, "-"))
                ax.plot(_smooth(r["curve"], k), label=f"{r['mode']} ({r['metric_name']} "
                        f"{r['metric']:.4g})", color=_style(r["mode"])["color"], lw=lw, ls=ls)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (EMA)")
        ax.set_title(model)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "training_curves.png")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results", help="folder with the JSON files")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: --results)")
    p.add_argument("--memory-json", default="bench_memory.json")
    p.add_argument("--speed-json", default="bench_speed.json")
    p.add_argument("--demo-json", default="demo.json")
    args = p.parse_args(argv)
    res = Path(args.results)
    out = Path(args.out or args.results)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    mem = _load(res / args.memory_json)
    if mem:
        made += [peak_vs_batch(mem, out), compression(mem, out)]
    speed = _load(res / args.speed_json)
    if speed:
        made.append(throughput_vs_batch(speed, out))
    demo = _load(res / args.demo_json)
    if demo:
        made.append(training_curves(demo, out))
    for path in made:
        if path:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
