"""A conv's input gradient without its input: the adjoint op against aten's stand-in input.

When a conv's saved input is large, its backward computes the weight gradient first and frees
the decoded input before the input gradient exists (docs/design.md, "The step's peak"). The
input gradient then needs no input values. Two ways to get it:

* ``stand-in``: ``aten::convolution_backward`` with an expanded zero-stride input, what
  ``torch.nn.grad.conv2d_input`` does. oneDNN copies that input to a contiguous map first: a
  pass that writes a full map the size of the input.
* ``adjoint``: the transposed conv of grad_out (``ConvSpec.input_grad``), which reads no input.

Both are timed round-robin in one process (a machine shared with other jobs slows them alike),
on the shapes of the ResNet-style CNN and on other kinds of conv (depthwise, 1d, 3d, transposed),
and the whole training step with each (the ``adjoint``
step is the default; ``stand-in`` is the same model with ``ConvSpec.input_grad`` disabled).

    .venv/bin/python scripts/bench_conv_input_grad.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from actnn_zoo.functional import conv as fconv  # noqa: E402
from actnn_zoo.bench import StepSpec, build_step, interleaved_step_times  # noqa: E402

# (input shape, output channels, kernel, stride, groups, transposed): the CNN's convs at batch
# 512, one at 128, a larger map, and other kinds (depthwise, 1d, 3d, transposed) that take
# the same path. Padding 1 (0 for the transposed ones).
SHAPES: Dict[str, Tuple[Tuple[int, ...], int, int, int, int, bool]] = {
    "512x32x8x8 3x3": ((512, 32, 8, 8), 32, 3, 1, 1, False),
    "512x32x8x8 3x3 s2": ((512, 32, 8, 8), 64, 3, 2, 1, False),
    "512x64x4x4 3x3": ((512, 64, 4, 4), 64, 3, 1, 1, False),
    "128x32x8x8 3x3": ((128, 32, 8, 8), 32, 3, 1, 1, False),
    "64x64x28x28 3x3": ((64, 64, 28, 28), 64, 3, 1, 1, False),
    "64x128x28x28 dw3x3": ((64, 128, 28, 28), 128, 3, 1, 128, False),
    "64x128x28x28 dw3x3 s2": ((64, 128, 28, 28), 128, 3, 2, 128, False),
    "64x64x1024 k3 (1d)": ((64, 64, 1024), 64, 3, 1, 1, False),
    "8x32x16x32x32 3x3x3": ((8, 32, 16, 32, 32), 32, 3, 1, 1, False),
    "8x16x8x16x16 3x3x3": ((8, 16, 8, 16, 16), 16, 3, 1, 1, False),
    "64x64x16x16 T4x4 s2": ((64, 64, 16, 16), 32, 4, 2, 1, True),
}
_OPS = {(1, False): F.conv1d, (2, False): F.conv2d, (3, False): F.conv3d,
        (1, True): F.conv_transpose1d, (2, True): F.conv_transpose2d,
        (3, True): F.conv_transpose3d}


def layer_fns(shape: Tuple[int, ...], cout: int, k: int, s: int, groups: int = 1,
              transposed: bool = False) -> Dict[str, Callable[[], torch.Tensor]]:
    """The input gradient of one conv both ways (equal values are checked by the caller)."""
    dims = len(shape) - 2
    x = torch.randn(shape)
    pad = 0 if transposed else 1
    if transposed:
        w = torch.randn((shape[1], cout // groups) + (k,) * dims)
        go = torch.randn_like(_OPS[dims, True](x, w, None, s, pad, 0, groups))
    else:
        w = torch.randn((cout, shape[1] // groups) + (k,) * dims)
        go = torch.randn_like(_OPS[dims, False](x, w, None, s, pad, 1, groups))
    spec = fconv.ConvSpec(dims=dims, stride=(s,) * dims, padding=(pad,) * dims,
                          dilation=(1,) * dims, groups=groups, transposed=transposed,
                          output_padding=(0,) * dims)

    def stand_in() -> torch.Tensor:
        return torch.ops.aten.convolution_backward(
            go, go.new_empty(()).expand(shape), w, None, [s] * dims, [pad] * dims, [1] * dims,
            transposed, [0] * dims, groups, [True, False, False])[0]

    def adjoint() -> torch.Tensor:
        out = spec.input_grad(go, w, [pad] * dims, torch.Size(shape))
        assert out is not None
        return out

    return {"stand-in": stand_in, "adjoint": adjoint}


def timed(fns: Dict[str, Callable[[], object]], n: int, rounds: int) -> Dict[str, List[float]]:
    """ms per call of each function (``interleaved_step_times``: ``rounds`` round-robin chunks
    of ``n`` calls)."""
    t = interleaved_step_times(fns, n=n * rounds, warmup=1, rounds=rounds)
    return {k: [v * 1e3 for v in vs] for k, vs in t.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default=",".join(SHAPES), help="comma list of " + "; ".join(SHAPES))
    p.add_argument("--models", default="resnet:512,resnet:128",
                   help="comma list of model:batch (models.py names) for whole steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5, help="timed layer calls per round")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.threads} threads, wall clock; median and minimum over the timed calls "
          f"({args.rounds} round-robin rounds)")

    layers = [s for s in args.layers.split(",") if s]
    for name in layers:
        if name not in SHAPES:
            p.error(f"unknown layer {name!r}; choose from {', '.join(SHAPES)}")
    if layers:
        print(f"\n{'input gradient of':22s} | {'stand-in ms':>19s} | {'adjoint ms':>19s} | "
              "adjoint / stand-in")
    for name in layers:
        fns = layer_fns(*SHAPES[name])
        a, b = fns["stand-in"](), fns["adjoint"]()
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(a.abs().max())):
            raise SystemExit(f"{name}: the two input gradients differ")
        t = timed(fns, args.calls, args.rounds)
        med = {k: statistics.median(v) for k, v in t.items()}
        mins = {k: min(v) for k, v in t.items()}
        print(f"{name:22s} | {med['stand-in']:8.2f} (min {mins['stand-in']:6.2f}) | "
              f"{med['adjoint']:8.2f} (min {mins['adjoint']:6.2f}) | "
              f"{med['adjoint'] / med['stand-in']:.2f}x (min {mins['adjoint'] / mins['stand-in']:.2f}x)")

    real = fconv.ConvSpec.input_grad
    for case in [c for c in args.models.split(",") if c]:
        model, batch = case.split(":")
        steps = {"fp32": build_step(StepSpec(model, int(batch))),
                 "adjoint": build_step(StepSpec(model, int(batch), mode="bits", bits=None)),
                 "stand-in": build_step(StepSpec(model, int(batch), mode="bits", bits=None))}

        def on_path(step: Callable[[], object], adjoint: bool) -> Callable[[], object]:
            def call() -> object:
                fconv.ConvSpec.input_grad = (  # type: ignore[method-assign]
                    real if adjoint else (lambda *a, **k: None))
                return step()
            return call

        try:
            t = timed({k: on_path(v, k != "stand-in") for k, v in steps.items()}, args.steps,
                      args.rounds)
        finally:
            fconv.ConvSpec.input_grad = real  # type: ignore[method-assign]
        base_med, base_min = statistics.median(t["fp32"]), min(t["fp32"])
        print(f"\n{case}: training step, 2-bit default")
        for name, v in t.items():
            print(f"  {name:9s} median {statistics.median(v):8.1f} ms "
                  f"({statistics.median(v) / base_med:.2f}x)  min {min(v):8.1f} ms "
                  f"({min(v) / base_min:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
