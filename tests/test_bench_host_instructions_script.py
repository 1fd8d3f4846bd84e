"""scripts/bench_host_instructions.py: its worker (the counted steps, without valgrind) and its
argument errors. The counting itself needs valgrind and minutes a mode; its output is in
docs/results.md."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_host_instructions.py"


def test_the_worker_runs_the_steps_and_leaves_at_once():
    """The process valgrind counts: builds the CNN's default step, runs warm-up and counted
    steps around the getppid mark, and exits 0 through os._exit."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--worker", "--models", "cnn",
                          "--modes", "default", "--warmup", "1", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--models", "vgg"], "unknown model 'vgg'"),
    (["--modes", "fp32,fast"], "unknown mode 'fast'"),
    (["--steps", "0"], "--steps and --jobs must be >= 1"),
])
def test_bad_arguments_are_named(argv, message, capsys, monkeypatch):
    mod = load_script("bench_host_instructions.py")
    monkeypatch.setattr(mod.shutil, "which", lambda name: "/usr/bin/valgrind")
    with pytest.raises(SystemExit):
        mod.main(argv)
    assert message in capsys.readouterr().err
