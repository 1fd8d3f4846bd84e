"""scripts/bench_layer_overhead.py: its table (a tiny run) and its argument errors."""
from __future__ import annotations

import re

import pytest
import torch

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
        _script().main(["--layers", "conv,transformer"])
    err = capsys.readouterr().err
    assert "transformer" in err and "conv" in err.split("known:")[1]


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


def test_floor_column_for_the_linear_layer_only(capsys):
    """``--floor`` adds the minimal Python layer's column (linear only; other layers are
    refused by name)."""
    mod = _script()
    assert mod.main(["--layers", "linear", "--floor", "--calls", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "python floor" in out
    row = next(line for line in out.splitlines() if line.startswith("linear "))
    assert len(row.split("|")[1:]) == len(mod.VARIANTS) + 1
    with pytest.raises(SystemExit):
        mod.main(["--layers", "conv", "--floor"])
    assert "--floor needs --layers linear" in capsys.readouterr().err


def test_floor_layer_computes_the_linear_gradients():
    """The floor is a lower bound on cost only if it does a linear layer's work: its input
    and bias gradients are exact, its weight gradient torch's within 2-bit rounding."""
    mod = _script()
    torch.manual_seed(0)
    floor = mod._FloorLinear(128, 64)
    ref = torch.nn.Linear(128, 64)
    ref.load_state_dict(floor.state_dict())
    x = torch.randn(4, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    floor(x).sum().backward()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(floor.bias.grad, ref.bias.grad)
    cos = torch.nn.functional.cosine_similarity(floor.weight.grad.flatten(),
                                                ref.weight.grad.flatten(), dim=0)
    assert cos > 0.8  # 2-bit codes of 4 rows: noisy, but the same direction


def test_chain_reports_per_layer_and_refuses_a_shrinking_layer(capsys, monkeypatch):
    mod = _script()
    lengths = []
    real = mod.step_fn

    def spy(layer, overrides, batch=0, chain=1):
        lengths.append(chain)
        return real(layer, overrides, batch, chain)
    monkeypatch.setattr(mod, "step_fn", spy)
    assert mod.main(["--layers", "relu", "--calls", "2", "--rounds", "1", "--chain", "3"]) == 0
    assert lengths == [3] * len(mod.VARIANTS)
    assert "a chain of 3 layers, per layer" in capsys.readouterr().out
    for bad, why in ((["--chain", "0"], "--chain must be >= 1"),
                     (["--layers", "maxpool", "--chain", "2"], "maxpool halves it")):
        with pytest.raises(SystemExit):
            mod.main(bad)
        assert why in capsys.readouterr().err


def test_attention_row_runs_the_zoos_attention_with_capture_only(capsys, monkeypatch):
    """The attention "layer" is a functional call: tier 2 routes it to the zoo's attention
    (with capture), while without capture it stays torch's own op."""
    from actnn_zoo.functional import attention as fattn

    calls = []
    real = fattn.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(fattn, "scaled_dot_product_attention", counting)
    mod = _script()
    capture = mod.step_fn("attention", {"bits": 2, "strategy": "uniform"}, chain=2)
    capture()
    assert len(calls) == 2
    plain = mod.step_fn("attention", {"bits": 2, "strategy": "uniform", "capture": False}, chain=2)
    plain()
    assert len(calls) == 2
    assert mod.main(["--layers", "attention", "--calls", "2", "--rounds", "1", "--chain",
                     "2"]) == 0
    assert any(line.startswith("attention ") for line in capsys.readouterr().out.splitlines())
