#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler over a few steps, fp32 against converted.

    python scripts/profile_step.py --model resnet50 --batch 64 --modes fp32 "2-bit uniform"
    python scripts/profile_step.py --model gpt2 --batch 4 --device cuda --rows 30

Prints, per mode, the wall time per step, the number of operator calls per step, and the
operators with the largest self CPU time (host-side cost: Python, dispatch, launches) and, on
CUDA, the largest self device time (the extension's CUDA kernels appear there by name; their
host-side calls are not operator records, so their CPU cost shows only in the step's wall
time). The models and modes are those of ``bench_gpu_models.py``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu_models import MODES, Trainer, Workload  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=("resnet50", "gpt2"))
    p.add_argument("--modes", nargs="+", default=["fp32", "2-bit uniform", "2-bit default"],
                   choices=MODES)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny models")
    args = p.parse_args()

    dev = torch.device(args.device)
    work = Workload(args.model, args.quick)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for mode in args.modes:
        tr = Trainer(work, mode, dev)
        x, y = work.batch(args.batch, dev)
        for _ in range(4):
            tr.step(x, y)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                tr.step(x, y)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        events = prof.key_averages()
        calls = sum(e.count for e in events if not e.key.startswith("ProfilerStep"))
        print(f"\n===== {args.model} batch {args.batch}, {mode}: {wall * 1e3:.1f} ms per step "
              f"(under the profiler), {calls / args.steps:.0f} op records per step")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if dev.type == "cuda":
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        del tr
    return 0


if __name__ == "__main__":
    sys.exit(main())
