#!/usr/bin/env python
"""Speed of the CUDA kernels against a device-to-device copy (``x.clone()``).

    python scripts/bench_cuda.py                 # 1 GiB float32, 2 bits, group size 256
    python scripts/bench_cuda.py --bits 1 2 4 8 --json results/gpu/kernels.json
    python scripts/bench_cuda.py --gib 0.25 --bits 4 --repeats 50

Times quantize (x -> packed codes + bf16 lo/step) and dequantize (codes -> float32, into a
preallocated tensor) of one tensor with CUDA events, the median of ``--repeats`` runs after
warm-up, and reports each as:

* time relative to a device-to-device copy into a preallocated tensor (``out.copy_(x)``, 8
  bytes per value; quantize at 2 bits must move about 4.3, so about 0.53x is its floor), and
* achieved bandwidth (bytes the kernel must move / time) as a fraction of the copy's.

Without a CUDA device, or with an extension built without CUDA kernels, it says so and exits
with status 0 without measuring anything.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_ms(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="tensor size in GiB of float32")
    p.add_argument("--bits", type=int, nargs="+", default=[2], choices=(1, 2, 4, 8))
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--rows", type=int, default=256, help="samples (dim 0) of the tensor")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nearest", action="store_true", help="round to nearest instead")
    p.add_argument("--lean", action="store_true",
                   help="also time _C.quantize_lean (the lean kernel, not yet the default)")
    p.add_argument("--json", type=Path, help="write the figures here as well")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_cuda: SKIPPED: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built with CUDA {torch.version.cuda}). Nothing measured.")
        return 0

    from actnn_zoo.quant import backend
    from actnn_zoo.quant.reference import row_offsets

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ext = backend.extension()
    if ext is None or not getattr(ext, "has_cuda", False):
        print("bench_cuda: SKIPPED: actnn_zoo._C has no CUDA kernels (not built, or built "
              "without ACTNN_ZOO_CUDA). Nothing measured.")
        return 0

    dev = torch.device("cuda")
    numel = int(args.gib * (1 << 30)) // 4
    n = args.rows
    d = numel // n
    numel = n * d
    gs = args.group_size
    stochastic = not args.nearest
    x = torch.randn(n, d, device=dev)
    out = torch.empty_like(x)
    t_clone = _median_ms(lambda: x.clone(), args.repeats, args.warmup)
    t_copy = _median_ms(lambda: out.copy_(x), args.repeats, args.warmup)
    bytes_copy = 2 * numel * 4                 # read + write float32
    bw_copy = bytes_copy / t_copy / 1e6        # GB/s (ms -> s, bytes -> GB)
    name = torch.cuda.get_device_name(dev)
    print(f"device: {name}; tensor {n} x {d} float32 ({numel * 4 / 2 ** 30:.2f} GiB), group "
          f"size {gs}, {'stochastic' if stochastic else 'nearest'}; median of {args.repeats} "
          f"runs; copy_ = out.copy_(x) into a preallocated tensor")
    print(f"{'op':<16}{'ms':>10}{'x copy_ time':>14}{'GB/s':>10}{'of copy BW':>12}")
    rows = [("clone", None, t_clone, bytes_copy), ("copy_", None, t_copy, bytes_copy)]
    for b in args.bits:
        bits = torch.full((n,), b, dtype=torch.uint8, device=dev)
        offsets = row_offsets(d, bits)
        total = n * ((d * b + 7) // 8)
        data, lo, step = ext.quantize(x, bits, offsets, total, gs, 1234, stochastic)
        t_q = _median_ms(lambda: ext.quantize(x, bits, offsets, total, gs, 1234, stochastic),
                         args.repeats, args.warmup)
        t_dq = _median_ms(lambda: ext.dequantize(data, lo, step, bits, offsets, gs, out),
                          args.repeats, args.warmup)
        meta = lo.numel() * 2 + step.numel() * 2
        rows.append(("quantize", b, t_q, numel * 4 + total + meta))     # read x, write codes
        if args.lean and hasattr(ext, "quantize_lean"):
            lean = ext.quantize_lean(x, bits, offsets, total, gs, 1234, stochastic)
            same = all(torch.equal(u, v) for u, v in zip(lean, (data, lo, step)))
            t_l = _median_ms(lambda: ext.quantize_lean(x, bits, offsets, total, gs, 1234,
                                                       stochastic), args.repeats, args.warmup)
            rows.append(("quant. lean" if same else "lean DIFFERS", b, t_l,
                         numel * 4 + total + meta))
            del lean
        rows.append(("dequantize", b, t_dq, total + meta + numel * 4))  # read codes, write x
        del data, lo, step
    results = []
    for label, b, t, nbytes in rows:
        bw = nbytes / t / 1e6
        tag = label if b is None else f"{label} {b}-bit"
        print(f"{tag:<16}{t:>10.3f}{t / t_copy:>13.2f}x{bw:>10.1f}{bw / bw_copy:>11.0%}")
        results.append({"op": label, "bits": b, "ms": t, "vs_copy_time": t / t_copy,
                        "gbps": bw, "of_copy_bandwidth": bw / bw_copy})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": name, "gib": numel * 4 / 2 ** 30,
                                         "group_size": gs, "stochastic": stochastic,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
