"""scripts/bench_norm_codes.py: a tiny run prints both paths, leaves the norms as it found them,
and names a bad layer."""
from __future__ import annotations

import pytest

import actnn_zoo.functional.norm as fnorm

from _scripts import load_script


def _script():
    return load_script("bench_norm_codes.py")


def test_tiny_run_times_both_paths_and_restores_the_norms(capsys):
    mod = _script()
    real = fnorm.reads_codes
    assert mod.main(["--models", "resnet:4", "--layers", "ln 32x128x128", "--steps", "1",
                     "--rounds", "1", "--threads", "1"]) == 0
    assert fnorm.reads_codes is real
    out = capsys.readouterr().out
    for label in ("fp32", "codes", "decoded"):
        assert any(line.split()[:1] == [label] for line in out.splitlines()), label
    row = [line for line in out.splitlines() if line.strip().startswith("ln 32x128x128")]
    assert len(row) == 1 and len(row[0].split("|")) == 3


def test_unknown_layer_is_named(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--models", "", "--layers", "bn 1x1"])
    assert "unknown layer 'bn 1x1'" in capsys.readouterr().err
