#!/usr/bin/env python
"""Host cost of the per-step loops that chunk work: their counts at the GPU benchmark's shapes
and the host time of one piece, measured on the CPU with tiny tensors (host work only).

    python scripts/bench_chunk_cost.py

* the normalized copy of a norm's input and an activation's derivative are made and quantized
  a chunk of samples at a time (``_saving.compress_produced``; the CPU's batch norm takes its
  fused kernel instead): chunks per ResNet-50 step at batch 64 and 552, on the CPU's chunk size
  and off the CPU's, and the host time of one more chunk;
* attention walks tiles of scores (``functional/attention.py``): tiles per GPT-2 small layer
  at batch 4, sequence 1024, on each device's tile size, and the host time of one more tile
  (forward and backward, dropout 0 and 0.1).

On a GPU every piece also launches its kernels (a few microseconds of host time each), which
this does not count. ResNet-50's shapes need torchvision (scripts/third_party.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actnn_zoo.config import LayerQConfig  # noqa: E402
from actnn_zoo.functional import _saving  # noqa: E402
from actnn_zoo.functional import attention as fattn  # noqa: E402
from actnn_zoo.quant import quantize  # noqa: E402

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # device objects: no GPU needed


def pieces(bounds) -> int:
    return 1 if bounds is None else len(bounds) - 1


def resnet_counts() -> None:
    from third_party import import_vision

    tv, _, why = import_vision()
    if tv is None:
        print(f"ResNet-50 chunk counts: skipped ({why})")
        return
    model = tv.models.resnet50(weights=None).eval()
    shapes = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape[1:])))
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    for n in (64, 552):
        cpu = sum(pieces(_saving.produce_bounds(torch.Size((n,) + s), CPU)) for s in shapes)
        gpu = sum(pieces(_saving.produce_bounds(torch.Size((n,) + s), GPU)) for s in shapes)
        print(f"ResNet-50, batch {n}: {len(shapes)} batch norms, normalized-copy chunks a step: "
              f"{cpu} at the CPU's chunk size, {gpu} off the CPU")


def gpt2_counts() -> None:
    for dev in (CPU, GPU):
        nb, nr = fattn._tiles(48, 1024, 1024, fattn.tile_budget(dev))
        tiles = -(-48 // nb) * -(-1024 // nr)
        ln = pieces(_saving.produce_bounds(torch.Size((4, 1024, 768)), dev))
        gelu = pieces(_saving.produce_bounds(torch.Size((4, 1024, 3072)), dev))
        print(f"GPT-2 small, batch 4, sequence 1024, {dev.type} sizes: attention tiles per "
              f"layer {tiles}, layer-norm chunks {ln}, GELU chunks {gelu}")


def best(fn, reps: int = 5, inner: int = 30) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return min(out)


def chunk_cost() -> None:
    qc, x = LayerQConfig(bits=2), torch.randn(64, 64)

    def produced(chunk_bytes: int):
        def run():
            old = _saving.PRODUCE_CHUNK_BYTES
            _saving.PRODUCE_CHUNK_BYTES = chunk_bytes
            try:
                q = _saving.compress_produced(lambda a, b: x[a:b] * 1.0, x.shape, qc, 2)
                if q is None:
                    quantize(x * 1.0, 2, 256)
            finally:
                _saving.PRODUCE_CHUNK_BYTES = old
        return run

    whole, chunked = best(produced(1 << 30)), best(produced(256))
    print(f"compress_produced of (64, 64): whole {whole * 1e6:.0f} us, 64 chunks "
          f"{chunked * 1e6:.0f} us: {(chunked - whole) / 63 * 1e6:.1f} us a chunk")


def tile_cost() -> None:
    q, k, v = (torch.randn(1, 48, 16, 8, requires_grad=True) for _ in range(3))
    qc = LayerQConfig(bits=2)
    for p in (0.0, 0.1):
        def run(block: int):
            def go():
                old = fattn.BLOCK_ELEMENTS
                fattn.BLOCK_ELEMENTS = block
                try:
                    fattn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                       qconfig=qc).sum().backward()
                finally:
                    fattn.BLOCK_ELEMENTS = old
            return go

        whole, tiled = best(run(1 << 20), inner=10), best(run(16 * 16), inner=10)
        print(f"attention (1, 48, 16, 8), dropout {p}: one tile {whole * 1e6:.0f} us, 48 tiles "
              f"{tiled * 1e6:.0f} us: {(tiled - whole) / 47 * 1e6:.0f} us a tile (fwd + bwd)")


def main() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    resnet_counts()
    gpt2_counts()
    chunk_cost()
    tile_cost()
    return 0


if __name__ == "__main__":
    sys.exit(main())
