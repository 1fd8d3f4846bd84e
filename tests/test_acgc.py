"""strategy: acgc -- widths from the error fraction: monotone in e, configuration and
validation of ``error_fraction``, the schedule, and training."""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.config import QuantConfig
from actnn_zoo.convert import precision_strategy
from actnn_zoo.precision import STRATEGY_CLASSES, ACGCStrategy
from actnn_zoo.precision import readback

from test_gact import Net, problem, train


def widths_after(e: float, steps: int = 4, **cfg) -> ACGCStrategy:
    """The strategy after ``steps`` training steps, solving every step unless ``cfg`` says."""
    torch.manual_seed(0)
    cfg.setdefault("update_interval", 1)
    model = az.convert_model(Net(), strategy="acgc", error_fraction=e, **cfg)
    train(model, steps, n=32, lr=0.01)
    return precision_strategy(model)


def test_bits_fall_monotonically_as_e_grows():
    es = [1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0]
    reports = [widths_after(e).report() for e in es]
    avg = [r["average_bits"] for r in reports]
    assert all(a >= b for a, b in zip(avg, avg[1:])), avg
    assert avg[0] > avg[-1]
    for r1, r2 in zip(reports, reports[1:]):  # layer by layer too
        assert all(r1["widths"][n] >= r2["widths"][n] for n in r1["widths"])
    assert set(reports[0]["widths"].values()) <= {1.0, 2.0, 4.0, 8.0}


def test_the_bound_does_not_depend_on_the_input_scale():
    """Scaling a linear layer's input by 30 scales its weight gradient by 30 and its range by
    30: the allowed error and the rounding error grow alike, so the width is the same."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(256, 8)
            self.b = nn.Linear(256, 8)

        def forward(self, x: Tensor) -> Tensor:
            return torch.cat([self.a(x), self.b(30.0 * x)], 1)

    for e in (1e-3, 1e-2, 0.1):
        torch.manual_seed(0)
        model = az.convert_model(Heads(), strategy="acgc", error_fraction=e, capture=False)
        model.b.weight.data.copy_(model.a.weight.data / 30.0)
        x = torch.randn(32, 256)
        for _ in range(3):
            model(x).square().sum().backward()
        w = precision_strategy(model).layer_budgets()
        assert w["a"] == w["b"], (e, w)


def test_yaml_selection_and_bad_values_name_the_key(tmp_path):
    assert STRATEGY_CLASSES["acgc"] is ACGCStrategy
    path = tmp_path / "acgc.yaml"
    path.write_text("strategy: acgc\nerror_fraction: 0.05\nupdate_interval: 100\n")
    model = az.convert_model(Net(), path)
    s = precision_strategy(model)
    assert isinstance(s, ACGCStrategy) and s.error_fraction == 0.05 and s.window == 10
    for bad in (0, -1, "0.1", float("nan"), True, 1e9):
        p = tmp_path / "bad.yaml"
        p.write_text(f"strategy: acgc\nerror_fraction: {bad!r}\n".replace("nan", ".nan"))
        with pytest.raises(ValueError, match="error_fraction"):
            QuantConfig.from_yaml(p)
        with pytest.raises(ValueError, match="error_fraction"):
            QuantConfig(strategy="acgc", error_fraction=bad)
    # the default is not written out; a set value round-trips
    assert "error_fraction" not in QuantConfig().to_dict()
    cfg = QuantConfig(strategy="acgc", error_fraction=0.3)
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg


def test_schedule_window_and_one_read_per_update(monkeypatch):
    reads: List[int] = []
    real = readback.DeferredRead.read

    def counted(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(readback.DeferredRead, "read", counted)
    s = widths_after(0.1, steps=13, update_interval=5)
    # windows: steps 1-5, 6-10 (all 5 recorded: window = min(10, 5)); computed at 6 and 11,
    # applied at 7 and 12
    assert s.window == 5 and s.updates == 2 and len(reads) == 2


def test_pinned_layers_keep_their_width():
    torch.manual_seed(0)
    model = az.convert_model(Net(), {"strategy": "acgc", "error_fraction": 100.0,
                                     "update_interval": 1,
                                     "rules": [{"name": "fc2", "bits": 8}]})
    train(model, 4, n=16)
    s = precision_strategy(model)
    assert "fc2" not in s.layer_budgets() and model.fc2.qconfig.bits == 8
    assert model.fc2.sample_bits is None
    assert set(s.layer_budgets().values()) == {1.0}


def test_converted_model_trains():
    torch.manual_seed(0)
    model = az.convert_model(Net(), strategy="acgc", error_fraction=0.5, update_interval=5)
    losses = train(model, 60)
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10, losses
    s = precision_strategy(model)
    assert s.updates >= 10 and 1.0 <= s.report()["average_bits"] <= 8.0
