#!/usr/bin/env python
"""The rounding variances' two calls alone: a batch norm's sample (forward) and correction
(backward), per call, for shapes from the host-cost sizes to a training batch.

Both are compiled CPU loops over every ``stride``-th value (``cpp_ext/variance_cpu.cpp``); this
times them through the Python entries the norms call (``sample_variance``, ``correct_``), one
thread, the best of ``--repeat`` runs of ``--number`` calls. Run it in two checkouts to compare
kernels (docs/results.md, twenty-seventh session).

    .venv/bin/python scripts/bench_rounding_variance.py
    .venv/bin/python scripts/bench_rounding_variance.py --shapes 2x256x8x8 --number 200
"""
from __future__ import annotations

import argparse
import math
import sys
import timeit
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from actnn_zoo.functional import _rounding_variance as rv  # noqa: E402
from actnn_zoo.quant import quantize  # noqa: E402

SHAPES = "2x256x8x8,2x1024x2x2,64x256x56x56"


def parse_shapes(text: str) -> List[Tuple[int, ...]]:
    """``NxCxHxW`` shapes, comma separated (batch-norm inputs: 4 positive sizes)."""
    shapes = []
    for part in text.split(","):
        try:
            shape = tuple(int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"bad shape {part!r}: expected NxCxHxW, e.g. 2x256x8x8") from None
        if len(shape) != 4 or min(shape) < 1:
            raise SystemExit(f"bad shape {part!r}: expected 4 positive sizes NxCxHxW")
        shapes.append(shape)
    return shapes


def time_shape(shape: Tuple[int, ...], number: int, repeat: int) -> Tuple[int, float, float]:
    """(stride, sample us, correction us) of a batch norm over ``shape``, as the norms call
    them: the input normalized per channel at 2 bits, the norm's stride, both factors."""
    g = torch.Generator().manual_seed(0)
    n, c = shape[:2]
    hw = math.prod(shape[2:])
    x = torch.randn(shape, generator=g)
    view = [1, c, 1, 1]
    shift = (torch.randn(c, generator=g) * 0.1).view(view)
    scale = (torch.rand(c, generator=g) + 0.5).view(view)
    q = quantize((x - shift) * scale, 2, 256, seed=1)
    stride = rv.norm_stride(n * hw)

    def sample():
        return rv.sample_variance(q, x, "stochastic", stride, draw=(1, 7), shift=shift,
                                  scale=scale, stat=(hw, c))

    drawn, codes = sample()
    go, gi = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.randn(c, generator=g)

    def correct():
        return rv.correct_(gi, go, drawn, codes, scale=scale.reshape(-1), weight=w,
                           stat=(hw, c), weight_stat=(hw, c), divisor=7.0)

    t_s = min(timeit.repeat(sample, number=number, repeat=repeat)) / number
    t_c = min(timeit.repeat(correct, number=number, repeat=repeat)) / number
    return stride, t_s * 1e6, t_c * 1e6


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="NxCxHxW, comma separated")
    p.add_argument("--number", type=int, default=2000,
                   help="calls per run (a tenth of it, at least 10, for 1M values or more)")
    p.add_argument("--repeat", type=int, default=5, help="runs; the best is reported")
    args = p.parse_args(argv)
    if args.number < 1 or args.repeat < 1:
        p.error("--number and --repeat must be >= 1")
    shapes = parse_shapes(args.shapes)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, best of {args.repeat} runs, us per call")
    print(f"{'shape':20s} | {'stride':>6s} | {'sample':>8s} | {'correct':>8s}")
    for shape in shapes:
        big = math.prod(shape) >= 1 << 20
        number = max(10, args.number // 10) if big else args.number
        stride, t_s, t_c = time_shape(shape, number, args.repeat)
        print(f"{'x'.join(map(str, shape)):20s} | {stride:6d} | {t_s:8.1f} | {t_c:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
