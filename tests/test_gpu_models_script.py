"""scripts/bench_gpu_models.py without a GPU: the largest-batch search (its step peak replaced
by a linear model of memory) finds the largest batch under the cap, stops starting tries when
its time is up, and the script's CPU smoke run prints its tables."""
from __future__ import annotations

import subprocess
import sys

import pytest

from _scripts import SCRIPTS, load_script

MiB = 2 ** 20


@pytest.fixture()
def bench(monkeypatch):
    mod = load_script("bench_gpu_models.py")
    calls = []

    def fake_peak(tr, n):  # 3 MiB a sample over a 10 MiB base
        calls.append(n)
        return 10 * MiB + 3 * MiB * n

    monkeypatch.setattr(mod, "step_peak", fake_peak)
    return mod, calls


def test_largest_batch_is_within_two_percent_below_the_largest_that_fits(bench):
    mod, calls = bench
    res = mod.largest_batch(object(), 1000 * MiB, 8)  # the largest that fits: 330
    assert "stopped" not in res
    assert 0.98 * 330 <= res["batch"] <= 330
    assert res["batch"] == max(n for n in calls if 10 + 3 * n <= 1000)
    assert res["upper_bound_failed"] > 330  # a batch that did not fit


def test_largest_batch_stops_when_its_time_is_up(bench):
    mod, calls = bench
    res = mod.largest_batch(object(), 1000 * MiB, 8, seconds=0.0)
    # the two fit batches always run; no try after them
    assert calls == [8, 16] and res["stopped"] == "time" and res["batch"] == 16


def test_cpu_smoke_run_prints_the_tables():
    res = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu_models.py"), "--device",
                          "cpu", "--quick", "--models", "gpt2", "--modes", "fp32",
                          "2-bit uniform", "--time-steps", "2"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| mode | held after forward MiB |" in res.stdout
    assert "| 2-bit uniform |" in res.stdout
