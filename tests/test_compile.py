"""torch.compile over a converted model at the default settings (actnn strategy, capture on).

The strategy's hooks and the capture store are host bookkeeping that runs eagerly under
compile (``actnn_zoo._compile``); these tests train through the strategy's re-allocations,
where a traced hook used to crash (``AttributeError: 'NoneType' object has no attribute
'item'`` in ``allocate_samples`` after 12 eager steps). The aot_eager backend keeps the test
free of C++ code generation. A plain torch.compile of a converted model still breaks the graph
at each Q-layer; the path without breaks, with its saved bytes measured, is actnn_zoo.compile
(tests/test_compiled.py).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az
from actnn_zoo.convert import precision_strategy


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.mark.parametrize("eager_steps", [0, 12], ids=["compiled-from-start", "after-12-eager"])
def test_default_trains_compiled_through_reallocations(eager_steps):
    torch.manual_seed(0)
    model = az.convert_model(_model().train())
    strategy = precision_strategy(model)
    assert strategy is not None and strategy.name == "actnn"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    compiled = torch.compile(model, backend="aot_eager")
    losses = []
    for step in range(eager_steps + 14):
        run = model if step < eager_steps else compiled
        loss = F.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0]
    assert strategy.step >= eager_steps + 14  # the strategy saw every compiled step
    # per-sample widths were in use while compiled (what crashed before)
    assert model[0].sample_bits is not None


def test_compiled_gradients_match_eager_fp32_at_8_bits():
    torch.manual_seed(0)
    ref = _model().train()
    q = az.convert_model(copy.deepcopy(ref), bits=8)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    F.cross_entropy(ref(x), y).backward()
    F.cross_entropy(torch.compile(q, backend="aot_eager")(x), y).backward()
    for (name, a), b in zip(ref.named_parameters(), q.parameters()):
        cos = F.cosine_similarity(a.grad.flatten().double(), b.grad.flatten().double(), dim=0)
        assert cos >= 0.9999, name
