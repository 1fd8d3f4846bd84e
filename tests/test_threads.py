"""Threads running one converted model at once (as ``nn.DataParallel``'s replicas, which share
the modules' state, or a user's own threads): each thread pairs its own capture session and
ReLU claims, and gets the widths its precision strategy made for its own batch.

Before: the root's open sessions were one list, so a thread closed the other's session
("Token ... was created in a different Context"), and a ReLU's pending claim was one attribute,
so a thread could register the other thread's claim (the wrong mask in its backward). The
adaptive strategies kept one record of a step per layer and one ``sample_bits``: actnn's
re-allocation split one thread's rows by the other's counts ("split_with_sizes ... [32, 64]"),
a forward could use the other batch's widths, and gact's probe closed the other thread's seed
stream (docs/design.md, "Known limits", Threads).
"""
from __future__ import annotations

import copy
import threading
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 64, 10))


def _run_two(run: Callable[[int], None], timeout: float) -> None:
    """``run(0)`` and ``run(1)`` in two threads, joined (each waits at most ``timeout`` s)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# Every strategy: the adaptive ones (actnn, the default, gact, acgc) hand each forward the
# widths made for its own batch (a per-thread slot on the layer), and what they accumulate
# across steps changes under the strategy's lock. update_interval=3: each run re-allocates /
# probes about 16 times while both threads run. Batches of 32 and 64 samples: one thread's
# per-sample widths meet the other's input unless they are kept apart. Before the fix, of 10
# runs: gact failed 10 (a seed stream's Context), actnn 1 and 5 (same / unequal sizes;
# split_with_sizes), acgc 1 and 2 (its window's sums reset by the other thread mid-add).
STRATEGIES = ["uniform", "actnn", "gact", "acgc"]


@pytest.mark.parametrize("sizes", [(32, 32), (32, 64)], ids=["same", "unequal"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_threads_one_model_match_fp32_at_8_bits(strategy, sizes):
    torch.manual_seed(0)
    ref = _model().train()
    # acgc: an error fraction small enough that every width stays 8 (the bound's widths)
    extra = {"error_fraction": 1e-9} if strategy == "acgc" else {}
    model = az.convert_model(copy.deepcopy(ref), bits=8, strategy=strategy,
                             update_interval=3, **extra)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
               for n in sizes]
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

    _run_two(run, timeout=300)
    assert not errors, errors
    # 8-bit rounding noise alone: the mean cosine over 25 steps x 7 parameters >= 0.9999, the
    # worst single one (batch norm's 16 weights) >= 0.9995 (single-threaded, the worst of 50
    # draws measured 0.99989). A mask or payload of the other thread's batch gives < 0.99.
    for i, cs in cosines.items():
        assert len(cs) == 25 * 7
        assert sum(cs) / len(cs) >= 0.9999 and min(cs) >= 0.9995, (i, min(cs))


def test_each_thread_gets_the_widths_made_for_its_batch():
    """Both threads' pre-hooks choose widths before either forward reads them (a barrier in
    a later pre-hook): each forward still gets the widths of its own samples. Before, the
    layer's one ``sample_bits`` held the last thread's: the 32-sample batch met 64 widths
    (and fell back to the plain width), the 64-sample one widths ranked for other samples."""
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Linear(16, 8)), bits=2, strategy="actnn")
    layer = model[0]
    both_chose = threading.Barrier(2, timeout=60)
    seen: Dict[int, object] = {}
    errors: List[str] = []

    def read(mod: nn.Module, args) -> None:
        both_chose.wait()
        seen[threading.get_ident()] = mod.bits_for(args[0])

    layer.register_forward_pre_hook(read)  # after the strategy's pre-hook
    # thread 0: sample ranges grow with the index, thread 1: they shrink (twice as many)
    ramps = {0: torch.linspace(0.1, 30.0, 32), 1: torch.linspace(30.0, 0.1, 64)}
    idents: Dict[int, int] = {}

    def run(i: int) -> None:
        idents[i] = threading.get_ident()
        x = torch.randn(ramps[i].numel(), 16) * ramps[i][:, None]
        try:
            model(x).sum().backward()
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(f"thread {i}: {exc!r}")

    _run_two(run, timeout=120)
    assert not errors, errors
    for i, n in ((0, 32), (1, 64)):
        widths = seen[idents[i]]
        assert not isinstance(widths, int), (i, widths)  # per-sample widths, not the fallback
        bits = widths.bits.int()  # type: ignore[attr-defined]
        assert bits.shape == (n,)
        assert int(bits.sum()) <= 2 * n
        # wider samples get more bits: the low end of thread 0's ramp, the high end of 1's
        low, high = bits[: n // 4].double().mean(), bits[-n // 4:].double().mean()
        assert (high > low) if i == 0 else (low > high), (i, bits.tolist())


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
