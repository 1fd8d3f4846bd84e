"""scripts/bench_weight_layout.py: its report (a tiny GPT-2) and its argument errors."""
from __future__ import annotations

import re

import pytest

from _scripts import load_script


def _script():
    pytest.importorskip("transformers")
    return load_script("bench_weight_layout.py")


def test_reports_copies_and_matmuls_per_step(capsys):
    """A one-layer GPT-2 of width 64: one line per operator with its calls and milliseconds
    per step, and the total (the layout itself is tested in test_layers_conv_linear.py)."""
    mod = _script()
    assert mod.main(["--layers", "1", "--width", "64", "--tokens", "8", "--steps", "1",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    counts = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^(aten::\w+)\s+(\d+) calls\s+[\d.]+ ms$", out, re.M)}
    assert set(counts) == {"aten::copy_", "aten::mm", "aten::addmm"}, out
    assert re.search(r"^total self\s+[\d.]+ ms$", out, re.M)


def test_width_must_be_a_multiple_of_64(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--width", "100"])
    assert "--width must be a positive multiple of 64" in capsys.readouterr().err
