"""scripts/bench_chunk_cost.py: it prints the chunk and tile counts at the GPU benchmark's
shapes (those tests/test_produced_chunks.py asserts) and a host time for each piece."""
from __future__ import annotations

import re
import subprocess
import sys

from _scripts import SCRIPTS


def test_prints_counts_and_host_costs():
    res = subprocess.run([sys.executable, str(SCRIPTS / "bench_chunk_cost.py")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "cpu sizes: attention tiles per layer 48, layer-norm chunks 4, GELU chunks 4" in out
    assert "cuda sizes: attention tiles per layer 6, layer-norm chunks 1, GELU chunks 1" in out
    # ResNet-50's counts need torchvision (installed for the benchmarks only)
    assert ("1868 at the CPU's chunk size, 74 off the CPU" in out
            or "ResNet-50 chunk counts: skipped" in out), out
    assert re.search(r"64 chunks \d+ us: -?\d+\.\d us a chunk", out), out
    assert len(re.findall(r"us a tile \(fwd \+ bwd\)", out)) == 2, out
