"""The norms' backward from codes against the decoded path, in one process.

Batch, layer and group norm read their saved x_hat from the codes (``actnn_zoo.quant.norm_backward``);
the decoded path (decode x_hat, rebuild x, aten's backward) is what ran before. Both are timed
round-robin in one process, so a machine shared with other jobs slows them alike: the training
step of a model (fp32 as the base of the ratios) and forward + backward of the norm layers alone.

    .venv/bin/python scripts/bench_norm_codes.py --models resnet:512,transformer_encoder:32
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import actnn_zoo.functional.norm as fnorm  # noqa: E402
from actnn_zoo import convert_model  # noqa: E402
from actnn_zoo.bench import StepSpec, build_step, interleaved_step_times  # noqa: E402

LAYERS = {  # name -> (torch layer, input shape)
    "bn 512x32x8x8": (lambda: nn.BatchNorm2d(32), (512, 32, 8, 8)),
    "bn 64x64x28x28": (lambda: nn.BatchNorm2d(64), (64, 64, 28, 28)),
    "ln 32x128x128": (lambda: nn.LayerNorm(128), (32, 128, 128)),
    "ln 32x128x768": (lambda: nn.LayerNorm(768), (32, 128, 768)),
    "gn 64x64x28x28": (lambda: nn.GroupNorm(32, 64), (64, 64, 28, 28)),
    "gn 16x128x16x16": (lambda: nn.GroupNorm(8, 128), (16, 128, 16, 16)),
}


def timed(fns: Dict[str, Callable[[], object]], paths: Dict[str, bool], n: int, rounds: int,
          clock: Callable[[], float]) -> Dict[str, List[float]]:
    """ms per call of each function (``interleaved_step_times``: ``rounds`` round-robin chunks,
    ``n`` calls each); ``paths`` says for each whether the norms read codes (False: the decoded
    path)."""
    real = fnorm.reads_codes

    def on_path(fn: Callable[[], object], codes: bool) -> Callable[[], object]:
        def call() -> object:
            fnorm.reads_codes = real if codes else (lambda *a: False)
            return fn()
        return call

    try:
        t = interleaved_step_times({k: on_path(fn, paths[k]) for k, fn in fns.items()},
                                   n=n * rounds, warmup=1, rounds=rounds, clock=clock)
    finally:
        fnorm.reads_codes = real
    return {k: [v * 1e3 for v in vs] for k, vs in t.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet:512,resnet:128,transformer_encoder:32",
                   help="comma list of model:batch (models.py names)")
    p.add_argument("--layers", default=",".join(LAYERS), help="comma list of " + ", ".join(LAYERS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"{args.threads} threads, {'thread CPU time' if args.threads == 1 else 'wall clock'}; "
          f"median and minimum over the timed calls ({args.rounds} round-robin rounds)")
    for case in filter(None, args.models.split(",")):
        model, batch = case.split(":")
        fp32 = build_step(StepSpec(model, int(batch)))
        bits = build_step(StepSpec(model, int(batch), mode="bits", bits=None))
        res = timed({"fp32": fp32, "codes": bits, "decoded": bits},
                    {"fp32": True, "codes": True, "decoded": False}, args.steps, args.rounds,
                    clock)
        med0, min0 = statistics.median(res["fp32"]), min(res["fp32"])
        print(f"\n{case}: training step, 2-bit default")
        for k, v in res.items():
            print(f"  {k:8s} median {statistics.median(v):7.1f} ms ({statistics.median(v) / med0:.2f}x)"
                  f"  min {min(v):7.1f} ms ({min(v) / min0:.2f}x)")
    names = [n for n in args.layers.split(",") if n]
    for name in names:
        if name not in LAYERS:
            p.error(f"unknown layer {name!r}; choose from {', '.join(LAYERS)}")
    if names:
        print("\nforward + backward of one layer, ms (min over calls): torch | codes | decoded")
    for name in names:
        build, shape = LAYERS[name]
        layer = build()
        q = convert_model(nn.Sequential(build()), {"bits": 2, "strategy": "uniform",
                                                   "capture": False})
        x = torch.randn(shape, requires_grad=True)
        g = torch.randn(shape)
        res = timed({"torch": lambda: layer(x).backward(g), "codes": lambda: q(x).backward(g),
                     "decoded": lambda: q(x).backward(g)},
                    {"torch": True, "codes": True, "decoded": False}, 10, max(3, args.rounds // 2),
                    time.perf_counter)
        print(f"  {name:16s} " + " | ".join(f"{min(v):7.2f}" for v in res.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
