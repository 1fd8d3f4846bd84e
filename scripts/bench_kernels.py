#!/usr/bin/env python
"""Quantize / dequantize throughput against x.clone() of the same tensor, in the same run.

    python scripts/bench_kernels.py [--size-mib 64] [--repeats 15] [--threads N]
    python scripts/bench_kernels.py --size-mib 4 --calls 3     # warm, a CNN map's size

Times the public API (actnn_zoo.quantize / dequantize, which allocate their outputs) and, when
the compiled extension is loaded, the raw actnn_zoo._C calls: quantize with the layout
precomputed (the difference is Python overhead), and dequantize into a preallocated output,
compared with `out.copy_(x)` into a preallocated output (no page faults on either side).
Measurements are interleaved round by round, so load from other processes hits all of them
alike; each number is the median over the rounds after warm-up. GB/s is the float tensor's
size over the time.

A fresh 64 MiB output costs thousands of first-touch page faults, paid alike by x.clone() and
az.dequantize (both allocate their output); THP_MEM_ALLOC_ENABLE=1 (a torch setting) makes
torch allocate large tensors on transparent huge pages, which removes most of that cost. The
extension asks for huge pages on its own large outputs (madvise, see quant_cpu.cpp), so its
dequantize pays that cost once per 2 MiB instead of per 4 KiB, whatever that setting says.

``--calls 1`` (the default) times a kernel's first call on fresh memory, page faults and cold
caches included, which dominate at 64 MiB; ``--calls 3`` times the third of three calls in a
row, the regime of a layer's small map, where the kernel's own loop is what shows.

Mask backward (ReLU / Dropout of the same tensor): torch's own backward of fp32 ReLU
(aten.threshold_backward, which reads the saved output) and Dropout (grad * float mask), the
unfused zoo path (unpack the 1-bit mask to bool, then torch.where / a product) and the fused
kernel (quant.masked_grad: grad and the bits in one pass), each as a ratio to
threshold_backward.

Mask forward (what a QReLU saves): the unfused packing (``x <= 0`` into a bool tensor, its
negation, then pack_mask) and the fused kernel (quant.pack_compare: 8 inputs -> 1 byte in one
read of x), as a ratio to torch.relu of the same tensor (the op the layer runs anyway).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
import actnn_zoo as az  # noqa: E402
from actnn_zoo.quant import reference as R  # noqa: E402
from actnn_zoo.quant.api import _masked_grad_torch, masked_grad, pack_compare, pack_mask  # noqa: E402
from actnn_zoo.quant.backend import extension  # noqa: E402
from actnn_zoo.quant.sparse import dequantize_sparse, quantize_sparse  # noqa: E402

WIDTHS = (1, 2, 4, 8)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def timed(fn, calls: int = 1):
    """(seconds of the last of ``calls`` back-to-back calls, its result). One call: a first
    touch of fresh memory and cold caches; more: the warm regime, where the allocator hands
    back the memory the previous call freed and a small tensor stays in cache."""
    for _ in range(calls - 1):
        fn()  # its result is dropped at once
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=64.0, help="tensor size (MiB) as float32")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="the input's dtype (the same number of values at any dtype)")
    ap.add_argument("--rows", type=int, default=256, help="dim 0 (samples); default 256")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--group-size", type=int, default=256)
    ap.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic")
    ap.add_argument("--calls", type=int, default=1,
                    help="calls per kernel and round, the last one timed (default 1: fresh "
                         "memory; 3: warm, e.g. with --size-mib 4, a CNN map at batch 512)")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be at least 1")

    def run(fn):
        return timed(fn, args.calls)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cols = max(1, int(args.size_mib * 2 ** 20 / 4 / args.rows))
    x = torch.randn(args.rows, cols).to(getattr(torch, args.dtype))
    nbytes = x.numel() * x.element_size()
    ext = extension()
    print(f"actnn_zoo backend: {az.backend_name()}   torch {torch.__version__}   "
          f"torch.get_num_threads() = {torch.get_num_threads()}")
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}   "
          f"transparent_hugepage: {thp}   load average: {_read('/proc/loadavg')}")
    print(f"tensor: {args.dtype} {tuple(x.shape)} = {nbytes / 2 ** 20:.1f} MiB, group_size "
          f"{args.group_size}, {args.rounding} rounding, median of {args.repeats} rounds after "
          f"{args.warmup} warm-up; per round each kernel called {args.calls}x, the last timed")

    stochastic = args.rounding == "stochastic"
    layouts = {}
    for b in WIDTHS:
        bits = torch.full((args.rows,), b, dtype=torch.uint8)
        offsets = R.row_offsets(cols, bits)
        layouts[b] = (bits, offsets, int(offsets[-1]))
    prealloc = torch.empty_like(x)
    # Mask backward inputs: ReLU's saved output and its packed mask; a dropout mask.
    relu_out = torch.relu(x)
    relu_bits = pack_mask(~(x <= 0))
    kept = torch.rand(x.shape) > 0.5
    drop_bits = pack_mask(kept)
    drop_noise = kept.to(x.dtype).div_(0.5)
    del kept
    grad = torch.randn_like(x)
    aten = torch.ops.aten

    times: dict = {}

    def record(key, seconds):
        times.setdefault(key, []).append(seconds)

    for rnd in range(args.warmup + args.repeats):
        keep = rnd >= args.warmup
        t, y = run(lambda: x.clone())
        del y
        if keep:
            record("clone", t)
            record("copy_", run(lambda: prealloc.copy_(x))[0])
        for b in WIDTHS:
            t_q, q = run(lambda: az.quantize(x, b, args.group_size, seed=rnd,
                                               rounding=args.rounding))
            t_dq, y = run(lambda: az.dequantize(q))
            del y
            if keep:
                record(("q", b), t_q)
                record(("dq", b), t_dq)
            if ext is not None:
                bits, offsets, total = layouts[b]
                t_rq, _ = run(lambda: ext.quantize(x, bits, offsets, total, args.group_size,
                                                     rnd, stochastic))
                t_rdq, _ = run(lambda: ext.dequantize(q.data, q.lo, q.step, bits, offsets,
                                                        args.group_size, prealloc))
                if keep:
                    record(("rq", b), t_rq)
                    record(("rdq", b), t_rdq)
            del q
        mask_fns = {
            "threshold_backward": lambda: aten.threshold_backward(grad, relu_out, 0.0),
            "relu unfused": lambda: _masked_grad_torch(grad, relu_bits, None, None),
            "relu fused": lambda: masked_grad(grad, relu_bits, None, None),
            "dropout torch": lambda: grad * drop_noise,
            "dropout unfused": lambda: _masked_grad_torch(grad, drop_bits, 2.0, 0.0),
            "dropout fused": lambda: masked_grad(grad, drop_bits, 2.0, 0.0),
        }
        mask_fns.update({
            "torch.relu": lambda: torch.relu(x),
            "pack unfused": lambda: pack_mask(~(x <= 0)),
            "pack_compare": lambda: pack_compare(x, "not_le"),
        })
        for name, fn in mask_fns.items():
            t, y = run(fn)
            del y
            if keep:
                record(("mask", name), t)
        # ReLU's output at 2 bits: plain codes (plus ReLU's own mask) against sparse codes
        for name, qfn, dqfn in (
                ("plain", lambda: az.quantize(relu_out, 2, args.group_size, seed=rnd),
                 az.dequantize),
                ("sparse", lambda: quantize_sparse(relu_out, 2, args.group_size, seed=rnd),
                 dequantize_sparse)):
            t_q, q = run(qfn)
            t_dq, y = run(lambda: dqfn(q))
            del y
            if keep:
                record(("relu q", name), t_q)
                record(("relu dq", name), t_dq)
                record(("relu bytes", name), q.nbytes)
            del q

    med = {k: statistics.median(v) for k, v in times.items()}
    clone, copy_ = med["clone"], med["copy_"]
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    print(f"\nx.clone():                 {clone * 1e3:8.2f} ms  {gbs(clone):6.2f} GB/s")
    print(f"out.copy_(x) preallocated: {copy_ * 1e3:8.2f} ms  {gbs(copy_):6.2f} GB/s")
    print("\npublic API (az.quantize / az.dequantize), ratio = time / x.clone() time:")
    print(f"{'bits':>4} | {'quantize ms':>11} {'x clone':>8} {'GB/s':>7} | "
          f"{'dequantize ms':>13} {'x clone':>8} {'GB/s':>7}")
    for b in WIDTHS:
        q, dq = med[("q", b)], med[("dq", b)]
        print(f"{b:>4} | {q * 1e3:11.2f} {q / clone:8.2f} {gbs(q):7.2f} | "
              f"{dq * 1e3:13.2f} {dq / clone:8.2f} {gbs(dq):7.2f}")
    if ext is not None:
        print("\nraw actnn_zoo._C calls: quantize (vs x.clone()), and dequantize into a "
              "preallocated output (vs out.copy_(x) into a preallocated output):")
        print(f"{'bits':>4} | {'quantize ms':>11} {'x clone':>8} {'GB/s':>7} | "
              f"{'dequantize ms':>13} {'x copy_':>8} {'GB/s':>7}")
        for b in WIDTHS:
            q, dq = med[("rq", b)], med[("rdq", b)]
            print(f"{b:>4} | {q * 1e3:11.2f} {q / clone:8.2f} {gbs(q):7.2f} | "
                  f"{dq * 1e3:13.2f} {dq / copy_:8.2f} {gbs(dq):7.2f}")
    else:
        print("\n(no compiled extension loaded: the numbers above are the pure-torch reference)")
    tb = med[("mask", "threshold_backward")]
    regime = "fresh outputs" if args.calls == 1 else f"warm: call {args.calls} of {args.calls}"
    print(f"\nmask backward of the same tensor ({regime}), ratio = time / "
          f"threshold_backward time ({tb * 1e3:.2f} ms):")
    for name in ("threshold_backward", "relu unfused", "relu fused", "dropout torch",
                 "dropout unfused", "dropout fused"):
        t = med[("mask", name)]
        print(f"  {name:<20} {t * 1e3:9.2f} ms  {t / tb:6.2f}x   {t / clone:6.2f}x clone")
    tr = med[("mask", "torch.relu")]
    print(f"\nReLU mask forward of the same tensor, ratio = time / torch.relu time "
          f"({tr * 1e3:.2f} ms):")
    for name in ("torch.relu", "pack unfused", "pack_compare"):
        t = med[("mask", name)]
        print(f"  {name:<20} {t * 1e3:9.2f} ms  {t / tr:6.2f}x   {t / clone:6.2f}x clone")

    print("\nReLU output (half zeros) at 2 bits, ratio = time / x.clone() time; bytes kept "
          "(plain codes need ReLU's 1-bit mask besides):")
    for name in ("plain", "sparse"):
        q, dq = med[("relu q", name)], med[("relu dq", name)]
        kept = med[("relu bytes", name)] + (x.numel() + 7) // 8 * (name == "plain")
        print(f"  {name:<11} quantize {q * 1e3:7.2f} ms {q / clone:5.2f}x   dequantize "
              f"{dq * 1e3:7.2f} ms {dq / clone:5.2f}x   kept {kept / 2 ** 20:6.2f} MiB")


if __name__ == "__main__":
    main()
