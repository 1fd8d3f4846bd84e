#!/usr/bin/env python
"""Where a converted GPT-2's step copies tensors: ``aten::copy_`` calls and self CPU time per
step beside the step's total, from ``torch.profiler``.

Why: GPT-2's ``Conv1D`` keeps its weight (in, out) and the Q-layer computes with its
transpose; a weight gradient made (out, in) is copied by autograd into the Parameter's
layout, one weight-sized copy per layer and step. Run on two trees to compare them.

    .venv/bin/python scripts/bench_weight_layout.py                    # 4 layers, width 768
    .venv/bin/python scripts/bench_weight_layout.py --layers 2 --width 256 --steps 2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import actnn_zoo as az  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=768, help="n_embd (a multiple of 64)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.width % 64 or args.width <= 0:
        p.error(f"--width must be a positive multiple of 64, got {args.width}")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                     vocab_size=2048, n_positions=max(args.tokens, 1))
    ids = torch.randint(0, 2048, (args.batch, args.tokens))
    model = az.convert_model(GPT2LMHeadModel(cfg).train())

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        for param in model.parameters():
            param.grad = None

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
    print(f"torch {torch.__version__}, {args.threads} threads; GPT-2 {args.layers} layers of "
          f"width {args.width}, {args.batch} x {args.tokens} tokens, default conversion; per "
          f"step over {args.steps} profiled steps")
    for e in events:
        if e.key in ("aten::copy_", "aten::mm", "aten::addmm"):
            ms = e.self_cpu_time_total / args.steps / 1e3
            print(f"{e.key:12s} {e.count / args.steps:6.0f} calls {ms:9.2f} ms")
    print(f"{'total self':12s} {'':12s} {total:9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
