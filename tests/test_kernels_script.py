"""scripts/bench_kernels.py: a tiny run prints every table, and --calls is checked."""
from __future__ import annotations

import re
import subprocess
import sys

from _scripts import SCRIPTS


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_kernels.py"), "--size-mib",
                           "0.25", "--rows", "16", "--repeats", "1", "--warmup", "0",
                           "--threads", "1", *args], capture_output=True, text=True,
                          timeout=300)


def test_tiny_warm_run_prints_every_table():
    res = _run("--calls", "2")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "each kernel called 2x, the last timed" in out
    for label in ("threshold_backward", "relu fused", "dropout fused", "pack_compare",
                  "sparse"):
        rows = [line for line in out.splitlines() if line.strip().startswith(label + " ")]
        assert len(rows) == 1, label
        assert re.search(r"\d+\.\d+ ms", rows[0]), rows[0]


def test_calls_below_one_is_refused():
    res = _run("--calls", "0")
    assert res.returncode != 0 and "--calls must be at least 1" in res.stderr
