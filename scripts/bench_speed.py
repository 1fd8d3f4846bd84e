#!/usr/bin/env python
"""Median training-step time: fp32 vs each bit width vs checkpointing, ratios from one run.

All modes live in this one process and are timed round-robin (``--rounds`` chunks each), so a
machine that gets busier or quieter during the run shifts every mode alike. E.g.
    .venv/bin/python scripts/bench_speed.py --models resnet,transformer \
        --batches 64,256,1024 --json results/bench_speed.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from actnn_zoo.bench import StepSpec, build_step, interleaved_step_times  # noqa: E402

DEFAULT_BATCH = {"resnet": 256, "unet": 32, "conv1d": 256, "transformer": 32,
                 "transformer_encoder": 32, "gpt2": 32}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet,transformer")
    p.add_argument("--batches", default=None,
                   help="comma list of batch sizes (default: one per model)")
    p.add_argument("--bits", default="1,2,4,8")
    p.add_argument("--config", default=None)
    p.add_argument("--strategy", default="uniform",
                   help="precision strategy for the bit rows ('' = the config's default)")
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("once")
    bits = [int(b) for b in args.bits.split(",") if b.strip()]
    rows: List[Dict[str, Any]] = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}; "
          f"{args.steps} timed steps per mode after {args.warmup} warm-up, "
          f"{args.rounds} interleaved rounds")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        batches = ([int(b) for b in args.batches.split(",")] if args.batches
                   else [DEFAULT_BATCH.get(name, 32)])
        for batch in batches:
            base = StepSpec(name, batch, device=args.device, config=args.config)
            specs = [("fp32", base)]
            specs += [(f"{k}-bit", StepSpec(name, batch, mode="bits", bits=k,
                                            strategy=args.strategy or None,
                                            device=args.device, config=args.config))
                      for k in bits]
            if not args.no_checkpoint:
                specs.append(("checkpoint", StepSpec(name, batch, mode="checkpoint",
                                                     device=args.device)))
            try:
                times = interleaved_step_times({label: build_step(spec) for label, spec in specs},
                                               args.steps, args.warmup, args.rounds, args.device)
            except Exception as exc:  # a converter error: report the row, go on
                print(f"{name} batch {batch}: error {type(exc).__name__}: {exc}")
                rows.append({"model": name, "batch": batch, "error": str(exc)})
                continue
            ref = statistics.median(times["fp32"])
            for label, ts in times.items():
                med = statistics.median(ts)
                row = {"model": name, "batch": batch, "mode": label, "median_s": med,
                       "ratio": med / ref, "samples_per_s": batch / med, "n": len(ts),
                       "q1_s": statistics.quantiles(ts, n=4)[0] if len(ts) > 1 else med,
                       "q3_s": statistics.quantiles(ts, n=4)[2] if len(ts) > 1 else med}
                rows.append(row)
                print(f"{name:<12} batch {batch:<6} {label:<11} {1000 * med:9.1f} ms  "
                      f"{med / ref:5.2f}x fp32  {batch / med:9.0f} samples/s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "argv": sys.argv, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
