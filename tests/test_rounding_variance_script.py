"""scripts/bench_rounding_variance.py: a tiny run times both calls; a bad shape is named."""
from __future__ import annotations

import pytest

from _scripts import load_script


def test_tiny_run_prints_both_calls(capsys):
    mod = load_script("bench_rounding_variance.py")
    assert mod.main(["--shapes", "2x8x4x4", "--number", "2", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("2x8x4x4")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")]
    assert int(cells[1]) >= 1 and float(cells[2]) > 0 and float(cells[3]) > 0


@pytest.mark.parametrize("shapes, message", [("2x8x4", "4 positive sizes"),
                                             ("2xax4x4", "expected NxCxHxW")])
def test_bad_shape_is_named(shapes, message, capsys):
    mod = load_script("bench_rounding_variance.py")
    with pytest.raises(SystemExit, match=message):
        mod.main(["--shapes", shapes])
