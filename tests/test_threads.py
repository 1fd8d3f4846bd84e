"""Threads running one converted model at once (as ``nn.DataParallel``'s replicas, which share
the modules' state, or a user's own threads): each thread pairs its own capture session and
ReLU claims.

Before: the root's open sessions were one list, so a thread closed the other's session
("Token ... was created in a different Context"), and a ReLU's pending claim was one attribute,
so a thread could register the other thread's claim (the wrong mask in its backward).
"""
from __future__ import annotations

import copy
import threading
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 64, 10))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# Uniform widths only: the adaptive strategies (actnn, gact, acgc) keep one set of per-step
# statistics per model, which threads running that model share; their re-allocation is not
# thread-safe yet (docs/design.md, "Known limits").
@pytest.mark.parametrize("strategy", ["uniform"])
def test_two_threads_one_model_match_fp32_at_8_bits(strategy):
    torch.manual_seed(0)
    ref = _model().train()
    model = az.convert_model(copy.deepcopy(ref), bits=8, strategy=strategy)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(2)]
    # fp32 gradients of each thread's batch (batch norm in training: one forward per batch)
    expect = []
    for x, y in batches:
        expect.append(torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters())))
    errors: List[str] = []
    cosines: Dict[int, List[float]] = {0: [], 1: []}
    start = threading.Barrier(2)

    def run(i: int) -> None:
        x, y = batches[i]
        try:
            start.wait()
            for _ in range(25):
                grads = torch.autograd.grad(F.cross_entropy(model(x), y),
                                            list(model.parameters()))
                cosines[i] += [_cos(a, b) for a, b in zip(grads, expect[i])]
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    # 8-bit rounding noise alone: the mean cosine over 25 steps x 7 parameters >= 0.9999, the
    # worst single one (batch norm's 16 weights) >= 0.9995 (single-threaded, the worst of 50
    # draws measured 0.99989). A mask or payload of the other thread's batch gives < 0.99.
    for i, cs in cosines.items():
        assert len(cs) == 25 * 7
        assert sum(cs) / len(cs) >= 0.9999 and min(cs) >= 0.9995, (i, min(cs))


def test_deepcopy_and_pickle_keep_what_relu_learned():
    model = az.convert_model(_model().train(), bits=2, strategy="uniform")
    x = torch.randn(8, 3, 8, 8)
    F.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
    relu = model[2]
    slot = relu.__dict__.get("_zero_codes")
    assert slot is not None and slot.probed
    twin = copy.deepcopy(model)
    tslot = twin[2].__dict__["_zero_codes"]
    assert tslot is not slot and (tslot.enabled, tslot.probed) == (slot.enabled, slot.probed)
    assert tslot.waiting is None
    F.cross_entropy(twin(x), torch.randint(0, 10, (8,))).backward()  # the copy still trains
