"""The CPU kernels give the same bits on the portable path and the AVX2 path (cpp_ext/isa_cpu.h).

A portable build runs its hot loops through an AVX2 copy when the CPU has AVX2; the process-wide
choice is made once, so the portable path is run in a child process with
ACTNN_ZOO_CPU_ISA=baseline and its outputs compared with this process's, bit for bit: codes,
metadata and decoded values at every width and dtype, per-sample widths, the
fused mask backward, sparse codes (byte shuffles), the packed comparisons, the actnn strategy's
range statistic, the norms' backward from codes (batch, layer, group) and DIVISION's kernels,
on odd sizes (tails shorter than a vector).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _ext import compiled_extension  # tests/_ext.py: skip here, fail in CI when not built

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, torch
from actnn_zoo import _C
import actnn_zoo.quant as Q
from actnn_zoo.quant.division import division_dequantize, division_quantize
from actnn_zoo.quant import SampleBits
from actnn_zoo.quant.api import masked_grad

def outputs():
    out = {"isa": _C.cpu_isa()}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(5, 3, 331, generator=g) * 3).to(dtype)
        for bits in (1, 2, 4, 8):
            q = Q.quantize(x, bits, 64, seed=11)
            out[f"{dtype}-{bits}"] = (q.data, q.lo, q.step, Q.dequantize(q))
        sb = torch.tensor([1, 2, 4, 8, 2], dtype=torch.uint8)
        q = Q.quantize(x, sb, 128, seed=3)
        out[f"{dtype}-sample"] = (q.data, q.lo, q.step, Q.dequantize(q))
        r = torch.relu(x)
        grad = torch.randn(r.shape, generator=g).to(dtype)
        packed = Q.pack_compare(x, "not_le")
        out[f"{dtype}-mask"] = (packed, Q.pack_compare(x, "between", -1.0, 1.0),
                                masked_grad(grad, packed), masked_grad(grad, packed, 2.0, 0.0))
        out[f"{dtype}-range"] = (_C.range_statistic(x.reshape(5, -1), 64),)
        for bits in (2, torch.tensor([1, 2, 4, 8, 2], dtype=torch.uint8)):
            s = Q.quantize_sparse(r, bits, 64, seed=7)  # byte shuffles on both paths
            out[f"{dtype}-sparse-{bits}"] = (s.data, s.lo, s.step, s.mask,
                                            Q.dequantize_sparse(s))
        if dtype == torch.float32:  # batch norm's backward from codes (float32 only)
            from actnn_zoo.quant.norm_backward import batch_norm_backward_codes
            xh = torch.randn(5, 3, 7, 9, generator=g)
            grad_out = torch.randn(xh.shape, generator=g)
            inv, w = torch.rand(3, generator=g) + 0.5, torch.rand(3, generator=g)
            for bits in (2, SampleBits(torch.tensor([1, 2, 4, 8, 2], dtype=torch.uint8), 20)):
                q = Q.quantize(xh, bits, 64, seed=13)
                out[f"bn-codes-{bits!r}"] = batch_norm_backward_codes(grad_out, q, inv, w)
            from actnn_zoo.quant.norm_backward import layer_norm_backward_codes
            rows = torch.rand(5, 7, 1, generator=g) + 0.5
            lw = torch.rand(9, generator=g)
            q = Q.quantize(xh.reshape(5, 7, 27)[..., :9].contiguous(), 2, 32, seed=17)
            gl = torch.randn(5, 7, 9, generator=g)
            out["ln-codes"] = layer_norm_backward_codes(gl, q, rows, 9, lw)
            from actnn_zoo.quant.norm_backward import group_norm_backward_codes
            xg = torch.randn(5, 6, 7, 9, generator=g)
            q = Q.quantize(xg, 2, 64, seed=19)
            out["gn-codes"] = group_norm_backward_codes(
                torch.randn(xg.shape, generator=g), q, torch.rand(5, 3, generator=g) + 0.5, 3,
                torch.rand(6, generator=g))
        maps = (torch.randn(3, 5, 19, 13, generator=g) * 2).to(dtype)
        d = division_quantize(maps, 2, 8, seed=9)
        out[f"{dtype}-division"] = (d.data, d.low, d.lo, d.step, division_dequantize(d))
    return out

torch.save(outputs(), sys.argv[1])
"""


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as their bit patterns (-0.0 differs from 0.0 there)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def test_portable_and_avx2_paths_agree_bit_for_bit(tmp_path):
    compiled_extension()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    results = {}
    for isa in ("baseline", "auto"):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("ACTNN_ZOO_CPU_ISA", None)
        if isa == "baseline":
            env["ACTNN_ZOO_CPU_ISA"] = "baseline"
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, str(script), str(path)], env=env, check=True,
                       timeout=600)
        results[isa] = torch.load(path)
    base, auto = results["baseline"], results["auto"]
    assert base.pop("isa") in ("baseline", "native")
    assert auto.pop("isa") in ("avx2", "baseline", "native")
    assert base.keys() == auto.keys()
    for key in base:
        for a, b in zip(base[key], auto[key]):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(bits_of(a), bits_of(b)), key


def test_cpu_isa_names_the_path():
    ext = compiled_extension()
    assert ext.cpu_isa() in ("avx2", "baseline", "native")
