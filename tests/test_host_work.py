"""actnn_zoo.bench.host_work: a step's Python calls and torch operators, counted."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import actnn_zoo as az
from actnn_zoo.bench import HostWork, host_work


def _step(model: nn.Module, x: torch.Tensor):
    def step() -> None:
        model(x).sum().backward()
    return step


def test_counts_are_the_same_every_run_and_see_the_library():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).train()
    conv = az.convert_model(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)))
    x = torch.randn(4, 32)
    for model in (plain, conv):
        for _ in range(3):  # past the strategy's first steps
            _step(model, x)()
    # 10 steps: a whole cycle of the default strategy (re-allocation, gradient recording)
    a, b = host_work(_step(conv, x)), host_work(_step(conv, x))
    # counted, not timed: no run-to-run spread (1% allowed for what the garbage collector may
    # call back at a different moment; in practice the counts are equal)
    assert isinstance(a, HostWork)
    assert b.python_calls == pytest.approx(a.python_calls, rel=0.01)
    assert b.aten_ops == pytest.approx(a.aten_ops, rel=0.01)
    base = host_work(_step(plain, x))
    # the converted step quantizes, saves through the store and decodes: more of both
    assert a.python_calls > base.python_calls > 0
    assert a.aten_ops > base.aten_ops > 0


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        host_work(lambda: None, steps=0)
