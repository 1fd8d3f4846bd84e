#!/usr/bin/env python
"""The training step's peak memory and time: fp32, checkpointing, the 2-bit default (and
uniform 2 bits) with the backward decoding saved inputs whole (the default) and in four chunks
of samples (``backward_chunks: 4``), ratios from one run. Two modes are parts of a step:
``2-bit forward only`` (the default's forward and loss, graph dropped) and ``floor (no-grad
forward)`` (the plain forward and loss under ``torch.no_grad()``): no method that runs the
model's forward as written can peak below the floor, so fp32's peak over it bounds what any
activation compression can gain on that model (``StepSpec.phase``). The batch-1 cases measure
the fixed cost per step (Python and dispatch of every Q-layer call).

Peaks: each mode in a fresh child process (``actnn_zoo.bench.spec_peak_memory``: VmHWM over
the warmed-up resident set, every large tensor its own mapping). Times: all modes in this
process, round-robin (``interleaved_step_times``), median per step. E.g.
    .venv/bin/python scripts/bench_step.py --json results/bench_step.json
    .venv/bin/python scripts/bench_step.py --cases resnet:256 --no-time
    .venv/bin/python scripts/bench_step.py --cases resnet:1,resnet:128 --no-peak \
        --modes "2-bit (default),2-bit uniform"
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from actnn_zoo.bench import StepSpec, build_step, interleaved_step_times, spec_peak_memory  # noqa: E402

CASES = {  # name -> (model, batch, model kwargs)
    "resnet:1": ("resnet", 1, {}),  # the per-layer fixed cost (Python, dispatch)
    "transformer_encoder:1": ("transformer_encoder", 1, {}),
    "resnet:256": ("resnet", 256, {}),
    "resnet:128": ("resnet", 128, {}),
    "resnet:512": ("resnet", 512, {}),
    "resnet6+6:512": ("resnet", 512, {"blocks": [6, 6]}),
    "transformer_encoder:32": ("transformer_encoder", 32, {}),
    "gpt2:32": ("gpt2", 32, {}),
}


def modes(model: str, batch: int, kwargs: Dict[str, Any]) -> Dict[str, StepSpec]:
    base = StepSpec(model, batch, model_kwargs=kwargs)
    return {
        "fp32": base,
        "checkpoint": dataclasses.replace(base, mode="checkpoint"),
        "2-bit (default)": dataclasses.replace(base, mode="bits", bits=None),
        "2-bit uniform": dataclasses.replace(base, mode="bits", bits=2, strategy="uniform"),
        "2-bit chunks 4": dataclasses.replace(base, mode="bits", bits=None,
                                              config={"backward_chunks": 4}),
        "2-bit ReLU masks": dataclasses.replace(base, mode="bits", bits=None,
                                                config={"relu_codes": False}),
        # the default re-allocates every 10 steps; 1 was the default before
        "2-bit interval 1": dataclasses.replace(base, mode="bits", bits=None,
                                                config={"update_interval": 1}),
        "2-bit interval 100": dataclasses.replace(base, mode="bits", bits=None,
                                                  config={"update_interval": 100}),
        # not training steps: the 2-bit default's forward alone (its peak with the store
        # filling), and the floor (plain forward under no_grad: no method that runs this
        # forward as written can peak lower)
        "2-bit forward only": dataclasses.replace(base, mode="bits", bits=None,
                                                  phase="forward"),
        "floor (no-grad forward)": dataclasses.replace(base, phase="no_grad"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="resnet:256,resnet6+6:512,transformer_encoder:32,gpt2:32",
                   help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--modes", default=None,
                   help="comma list of the modes to run (fp32 always runs: the ratios' base)")
    p.add_argument("--no-time", action="store_true", help="peaks only")
    p.add_argument("--no-peak", action="store_true", help="times only")
    p.add_argument("--steps", type=int, default=15, help="timed steps per mode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: this thread's CPU time (needs --threads 1), which other "
                        "processes on a shared machine do not inflate")
    p.add_argument("--rounds", type=int, default=3, help="round-robin chunks of the timed steps")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread measures the stepping thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    rows: List[Dict[str, Any]] = []
    for case in args.cases.split(","):
        if case not in CASES:
            p.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
        model, batch, kwargs = CASES[case]
        specs = modes(model, batch, kwargs)
        if args.modes:
            wanted = {"fp32"} | set(args.modes.split(","))
            unknown = wanted - set(specs)
            if unknown:
                p.error(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(specs)}")
            specs = {m: s for m, s in specs.items() if m in wanted}
        peaks = {} if args.no_peak else {m: spec_peak_memory(s) for m, s in specs.items()}
        times = {}
        if not args.no_time:
            raw = interleaved_step_times({m: build_step(s) for m, s in specs.items()},
                                         n=args.steps, warmup=3, rounds=args.rounds,
                                         clock=clock)
            times = {m: statistics.median(t) for m, t in raw.items()}
        print(f"\n{case} ({torch.get_num_threads()} threads, {args.clock} clock)")
        print(f"  {'mode':<22} {'peak MiB':>9} {'vs fp32':>8} {'step ms':>8} {'vs fp32':>8}")
        for m in specs:
            row: Dict[str, Any] = {"case": case, "mode": m}
            peak = peaks.get(m)
            if peak is not None and peak.ok:
                row["peak_mib"] = peak.delta_mib
                row["peak_lower_x"] = peaks["fp32"].delta_mib / peak.delta_mib
            elif peak is not None:
                row["peak_error"] = peak.error
            if m in times:
                row["step_ms"] = 1e3 * times[m]
                row["time_vs_fp32"] = times[m] / times["fp32"]
            rows.append(row)
            fmt = lambda k, f: format(row[k], f) if k in row else "-"  # noqa: E731
            print(f"  {m:<22} {fmt('peak_mib', '9.2f'):>9} {fmt('peak_lower_x', '7.2f'):>7}x "
                  f"{fmt('step_ms', '8.1f'):>8} {fmt('time_vs_fp32', '7.2f'):>7}x"
                  + (f"  ({row['peak_error']})" if "peak_error" in row else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
