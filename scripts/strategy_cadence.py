#!/usr/bin/env python
"""A strategy's step time relative to uniform 2 bits, amortised over whole update intervals.

AC-GC refreshes its widths every 100 steps from gradient norms recorded over the last 10 of
them; timing it with ``update_interval: 2`` (as the fidelity table of bench_strategies.py does,
so that widths adapt within its few passes) records on every step. Here each mode trains the
char transformer (bench_strategies' text model after 150 fp32 steps) for ``--steps`` steps,
the modes interleaved in rounds, and the mean over all steps is the amortised cost: two full
intervals of 100 by default, windows and width solves included.

    PYTHONPATH=. .venv/bin/python scripts/strategy_cadence.py [--steps 200] [--threads 2]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.convert import precision_strategy  # noqa: E402
from actnn_zoo.bench import interleaved_step_times  # noqa: E402

import bench_strategies as B  # noqa: E402

CONFIGS = {
    "uniform 2": {"bits": 2, "strategy": "uniform"},
    "acgc e=2, update_interval 2": {"strategy": "acgc", "error_fraction": 2.0,
                                    "update_interval": 2},
    "acgc e=2, update_interval 100": {"strategy": "acgc", "error_fraction": 2.0,
                                      "update_interval": 100},
    "actnn 2, update_interval 1": {"bits": 2, "update_interval": 1},
    "actnn 2 (the default, update_interval 10)": {"bits": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, x, y = B.text_base(150, 0)
    models = {k: az.convert_model(copy.deepcopy(base), **c) for k, c in CONFIGS.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        out = models[k](x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opts[k].step()

    times = interleaved_step_times({k: (lambda k=k: step(k)) for k in models}, n=args.steps,
                                   warmup=0, rounds=max(1, args.steps // 10))
    u = statistics.mean(times["uniform 2"])
    print(f"char transformer, {args.steps} training steps per mode from the first, modes "
          f"interleaved every 10 steps, {torch.get_num_threads()} threads")
    print(f"{'mode':42s} {'mean ms':>8s} {'vs uniform':>10s} {'avg bits':>9s}")
    for k, v in times.items():
        s = precision_strategy(models[k])
        bits = f"{s.average_bits():9.3f}" if hasattr(s, "average_bits") else f"{'':9s}"
        print(f"{k:42s} {statistics.mean(v) * 1e3:8.1f} {statistics.mean(v) / u:9.3f}x {bits}")


if __name__ == "__main__":
    main()
