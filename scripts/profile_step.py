#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler over a few steps, fp32 against converted.

    python scripts/profile_step.py                                  # resnet b128 + transformer
    python scripts/profile_step.py --models resnet --batch 128 --modes fp32 2-bit
    python scripts/profile_step.py --models resnet50 --batch 64 --device cuda   # GPU workloads

For each model it prints, per mode, the wall time per step and the number of operator records,
then one table per model with the operators side by side: self CPU milliseconds per step in
every mode and the difference from fp32, sorted by the largest difference (what the converted
step adds) and the largest totals. The extension's kernels are profiler scopes named
``actnn_zoo::quantize`` / ``dequantize`` / ``pack_mask`` / ``unpack_mask`` / ``masked_grad``
(opened in the C++ bindings), so they appear in the table like operators; an autograd
Function's backward is its ``...Backward`` node, whose self time is the Python code of the
backward around the ops it calls. ``--full`` also prints torch's own table per mode.

Models: those of actnn_zoo/models.py (``resnet``, ``transformer``, ``unet``, ``conv1d``, ...,
built by actnn_zoo.bench.build_step, modes ``fp32``, ``<k>-bit`` (uniform), ``default``
(the 2-bit default, actnn strategy), ``checkpoint``) and the
GPU benchmark's ``resnet50`` / ``gpt2`` (bench_gpu_models.py, its modes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPU_MODELS = ("resnet50", "gpt2")
DEFAULT_BATCH = {"resnet": 128, "transformer": 32}


def _zoo_step(model: str, mode: str, batch: int, device: str) -> Callable[[], object]:
    from actnn_zoo.bench import StepSpec, build_step

    if mode == "fp32":
        spec = StepSpec(model, batch, device=device)
    elif mode == "checkpoint":
        spec = StepSpec(model, batch, mode="checkpoint", device=device)
    elif mode == "default":  # the 2-bit default configuration (actnn strategy)
        spec = StepSpec(model, batch, mode="bits", bits=None, device=device)
    elif mode.endswith("-bit"):
        spec = StepSpec(model, batch, mode="bits", bits=int(mode[:-4]), strategy="uniform",
                        device=device)
    else:
        raise SystemExit(f"unknown mode {mode!r} for {model}: fp32, <k>-bit, default or "
                         "checkpoint")
    return build_step(spec)


def _gpu_step(model: str, mode: str, batch: int, device: str, quick: bool
              ) -> Callable[[], object]:
    from bench_gpu_models import MODES, Trainer, Workload

    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r} for {model}: one of {MODES}")
    work = Workload(model, quick)
    dev = torch.device(device)
    tr = Trainer(work, mode, dev)
    x, y = work.batch(batch, dev)
    return lambda: tr.step(x, y)


def profile_mode(step: Callable[[], object], steps: int, warmup: int, device: str
                 ) -> Tuple[float, Dict[str, Tuple[float, int]], object]:
    """(wall seconds per step under the profiler, {op: (self CPU ms per step, calls per step)},
    torch's key averages)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    ops = {e.key: (e.self_cpu_time_total / 1e3 / steps, round(e.count / steps))
           for e in events if not e.key.startswith("ProfilerStep")}
    return wall, ops, events


def comparison_table(per_mode: Dict[str, Dict[str, Tuple[float, int]]], rows: int) -> str:
    """Ops side by side, self CPU ms per step; the rows that add most over the first mode,
    then the remaining largest ones."""
    modes = list(per_mode)
    base = modes[0]
    names = set().union(*(set(v) for v in per_mode.values()))

    def ms(m: str, k: str) -> float:
        return per_mode[m].get(k, (0.0, 0))[0]

    def calls(m: str, k: str) -> int:
        return per_mode[m].get(k, (0.0, 0))[1]

    last = modes[-1]
    by_diff = sorted(names, key=lambda k: ms(last, k) - ms(base, k), reverse=True)
    by_total = sorted(names, key=lambda k: max(ms(m, k) for m in modes), reverse=True)
    chosen: List[str] = []
    for k in by_diff[: rows // 2] + by_total:
        if k not in chosen:
            chosen.append(k)
        if len(chosen) >= rows:
            break
    chosen.sort(key=lambda k: max(ms(m, k) for m in modes), reverse=True)
    width = max(40, max((len(k) for k in chosen), default=0))
    head = f"{'op (self CPU ms per step, calls)':<{width}}" + "".join(
        f" | {m:>18}" for m in modes) + f" | {'diff ' + last:>16}"
    lines = [head, "-" * len(head)]
    for k in chosen:
        cells = "".join(f" | {ms(m, k):10.2f} {calls(m, k):>7}" for m in modes)
        lines.append(f"{k[:width]:<{width}}{cells} | {ms(last, k) - ms(base, k):+16.2f}")
    totals = "".join(f" | {sum(v[0] for v in per_mode[m].values()):10.2f} {'':>7}"
                     for m in modes)
    lines.append(f"{'total self CPU':<{width}}{totals} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet", "transformer"])
    p.add_argument("--modes", nargs="+", default=None,
                   help="default: fp32 2-bit (models.py), fp32 '2-bit uniform' (GPU models)")
    p.add_argument("--batch", type=int, default=None, help="default: 128 resnet, 32 transformer")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny GPU models")
    p.add_argument("--full", action="store_true", help="also torch's own table per mode")
    p.add_argument("--json", default=None, help="write {model: {mode: {op: [ms, calls]}}}")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from actnn_zoo import backend_name

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}, "
          f"actnn_zoo backend {backend_name()}; {args.steps} profiled steps after "
          f"{args.warmup} warm-up")
    report: Dict[str, Dict[str, Dict[str, Tuple[float, int]]]] = {}
    for model in args.models:
        gpu_model = model in GPU_MODELS
        modes = args.modes or (["fp32", "2-bit uniform"] if gpu_model else ["fp32", "2-bit"])
        batch = args.batch or DEFAULT_BATCH.get(model, 64 if gpu_model else 32)
        per_mode: Dict[str, Dict[str, Tuple[float, int]]] = {}
        for mode in modes:
            step = (_gpu_step(model, mode, batch, args.device, args.quick) if gpu_model
                    else _zoo_step(model, mode, batch, args.device))
            wall, ops, events = profile_mode(step, args.steps, args.warmup, args.device)
            per_mode[mode] = ops
            n_calls = sum(c for _, c in ops.values())
            print(f"\n===== {model} batch {batch}, {mode}: {wall * 1e3:.1f} ms per step (under "
                  f"the profiler), {n_calls} op records per step")
            if args.full:
                print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
                if torch.device(args.device).type == "cuda":
                    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
            del step
        print(f"\n===== {model} batch {batch}: self CPU time per step by op")
        print(comparison_table(per_mode, args.rows))
        report[model] = per_mode
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
