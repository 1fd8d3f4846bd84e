"""scripts/bench_conv_input_grad.py: a tiny run times both ways, leaves the conv as it found
it, and names a bad layer."""
from __future__ import annotations

import math

import pytest

from actnn_zoo.functional import conv as fconv

from _scripts import load_script


def _script():
    return load_script("bench_conv_input_grad.py")


def test_tiny_run_times_both_ways_and_restores_the_conv(capsys):
    mod = _script()
    real = fconv.ConvSpec.input_grad
    assert mod.main(["--layers", "128x32x8x8 3x3", "--models", "resnet:4", "--rounds", "1",
                     "--calls", "1", "--steps", "1", "--threads", "1"]) == 0
    assert fconv.ConvSpec.input_grad is real
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("128x32x8x8 3x3")]
    assert len(row) == 1 and len(row[0].split("|")) == 4
    for label in ("fp32", "adjoint", "stand-in"):
        assert any(line.split()[:1] == [label] for line in out.splitlines()), label


def test_stand_in_and_adjoint_agree_on_every_shape():
    mod = _script()
    for name, shape in mod.SHAPES.items():
        if math.prod(shape[0]) > 1 << 21:
            continue  # the same code on a smaller map
        fns = mod.layer_fns(*shape)
        a, b = fns["stand-in"](), fns["adjoint"]()
        assert a.shape == b.shape == shape[0], name
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), name


def test_unknown_layer_is_named(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--models", "", "--layers", "conv 1x1"])
    assert "unknown layer 'conv 1x1'" in capsys.readouterr().err
