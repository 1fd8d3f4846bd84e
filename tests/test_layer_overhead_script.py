"""scripts/bench_layer_overhead.py: its table (a tiny run) and its argument errors."""
from __future__ import annotations

import re

import pytest

from _scripts import load_script


def _script():
    return load_script("bench_layer_overhead.py")


def test_one_row_per_layer_with_the_extra_time_of_each_variant(capsys):
    mod = _script()
    assert mod.main(["--layers", "relu,maxpool", "--calls", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("relu ", "maxpool "))]
    assert [r.split()[0] for r in rows] == ["relu", "maxpool"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:]]
        assert len(cells) == len(mod.VARIANTS)
        torch_us = float(cells[0])
        for cell in cells[1:]:  # "<total> (+<extra>)": the extra is total minus the torch layer
            total, extra = map(float, re.fullmatch(r"([\d.]+) \(\+\s*(-?[\d.]+)\)", cell).groups())
            assert total > 0 and extra == pytest.approx(total - torch_us, abs=1)


def test_unknown_layer_is_named(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--layers", "conv,attention"])
    err = capsys.readouterr().err
    assert "attention" in err and "conv" in err.split("known:")[1]


def test_batch_option_sets_the_input_batch(capsys, monkeypatch):
    mod = _script()
    shapes = []
    real = mod.torch.randn

    def recording(*shape, **kw):
        shapes.append(tuple(shape[0]) if len(shape) == 1 else shape)
        return real(*shape, **kw)

    monkeypatch.setattr(mod.torch, "randn", recording)
    assert mod.main(["--layers", "bn", "--calls", "2", "--rounds", "1", "--batch", "3"]) == 0
    assert "batch 3" in capsys.readouterr().out
    assert shapes and all(s == (3, 16, 8, 8) for s in shapes)
    with pytest.raises(SystemExit):
        mod.main(["--batch", "-1"])
    assert "--batch" in capsys.readouterr().err
