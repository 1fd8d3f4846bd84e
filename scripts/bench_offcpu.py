#!/usr/bin/env python
"""What a GPU training step dispatches, counted without a GPU (on the meta device).

The models and sizes of ``scripts/bench_gpu_models.py`` (GPT-2 small at sequence 1024, batch 4,
the loss outside the model; torchvision ResNet-50 at 224x224, batch 64), built on the meta
device, where every off-CPU branch of the library runs and nothing is computed
(``actnn_zoo.bench.offcpu``). Per mode, one step after the warm-up: torch operators, the
extension's kernel calls and host reads, and the library functions that dispatched the most
operators. On a GPU each operator and kernel costs a launch (several microseconds of host
time, more through Python), so the counts against fp32's say how much host work a step adds
there, and what dominates it.

    .venv/bin/python scripts/bench_offcpu.py                       # both models, every mode
    .venv/bin/python scripts/bench_offcpu.py --models gpt2 --modes fp32 "2-bit default"
    .venv/bin/python scripts/bench_offcpu.py --tile-scale 1 --chunk-scale 1   # as before b0809cb
    .venv/bin/python scripts/bench_offcpu.py --quick               # tiny models, seconds

``--tile-scale`` / ``--chunk-scale`` override how many times larger attention tiles and
produced chunks are off the CPU than on it (``functional.attention.DEVICE_BLOCK_SCALE``,
``functional._saving.DEVICE_CHUNK_SCALE``), to count what another choice would dispatch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actnn_zoo.bench.offcpu import (OffCpuWork, answering_reads, offcpu_work,  # noqa: E402
                                    summary)

MODES = ("fp32", "2-bit uniform", "2-bit default", "checkpoint")


def run(model_name: str, mode: str, quick: bool, warmup: int) -> OffCpuWork:
    from bench_gpu_models import Trainer, Workload

    if model_name == "resnet50":
        from third_party import import_vision

        import_vision()
    work = Workload(model_name, quick)
    meta = torch.device("meta")
    tr = Trainer(work, mode, meta)
    x, y = work.batch(4 if model_name == "gpt2" else (8 if quick else 64), meta)
    with answering_reads():
        for _ in range(warmup):
            tr.step(x, y)
    return offcpu_work(lambda: tr.step(x, y), places=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,resnet50")
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--warmup", type=int, default=11,
                   help="steps before the counted one (the default strategy re-allocates on "
                        "step 10, then counts a plain step; default 11)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    p.add_argument("--tile-scale", type=int, default=None)
    p.add_argument("--chunk-scale", type=int, default=None)
    args = p.parse_args(argv)
    if args.tile_scale is not None:
        import actnn_zoo.functional.attention as attention
        attention.DEVICE_BLOCK_SCALE = args.tile_scale
    if args.chunk_scale is not None:
        import actnn_zoo.functional._saving as saving
        saving.DEVICE_CHUNK_SCALE = args.chunk_scale
    print(f"torch {torch.__version__}; meta device; warm-up {args.warmup} steps; tile scale "
          f"{args.tile_scale or 'default'}, chunk scale {args.chunk_scale or 'default'}")
    for name in args.models.split(","):
        base = None
        for mode in args.modes:
            w = run(name, mode, args.quick, args.warmup)
            base = w.ops if mode == "fp32" else base
            ratio = f" ({w.ops / base:.1f}x fp32's)" if base else ""
            print(f"\n== {name}, {mode}: {w.ops} operators{ratio}, {w.kernels} kernel calls, "
                  f"{w.reads} host reads")
            for title, rows in summary(w, args.top).items():
                if rows:
                    print(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
