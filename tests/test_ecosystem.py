"""A converted model inside the tools people train with: torch.save / torch.load, pickling,
restore_model after training, torch.compile, DistributedDataParallel and FSDP2's fully_shard
(2 gloo processes).

Gradients are compared with the unconverted model's exact fp32 autograd at 8 bits
(cosine >= 0.9999 per parameter: 8-bit stochastic rounding leaves ~0.4% relative noise).
"""
from __future__ import annotations

import copy
import io
import os
import pickle
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

import actnn_zoo as az
from actnn_zoo.nn._base import QModule


def cos(a: Tensor, b: Tensor) -> float:
    return F.cosine_similarity(a.detach().double().flatten(), b.detach().double().flatten(),
                               dim=0).item()


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.GELU(),
                         nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 8 * 8, 10))


def _batch(seed: int = 0, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _train(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        x, y = _batch(s)
        opt.zero_grad()
        with az.capturing(model):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()


def _eval_out(model: nn.Module) -> Tensor:
    model.eval()
    with torch.no_grad():
        out = model(_batch(99)[0])
    model.train()
    return out


def test_torch_save_load_of_a_trained_converted_model_and_its_state_dict():
    torch.manual_seed(0)
    plain = small_cnn()
    model = az.convert_model(copy.deepcopy(plain))  # the default: auto precision, capture
    _train(model)
    # the state_dict has the torch model's keys: a converted checkpoint loads into torch
    assert list(model.state_dict()) == list(plain.state_dict())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert any(isinstance(m, QModule) for m in loaded.modules())
    torch.testing.assert_close(_eval_out(loaded), _eval_out(model), rtol=0, atol=0)
    _train(loaded, 2)  # trains on, strategy and capture included

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)  # weights_only: plain tensors only
    fresh = az.convert_model(small_cnn())
    fresh.load_state_dict(sd)
    plain.load_state_dict(sd)
    torch.testing.assert_close(_eval_out(fresh), _eval_out(model), rtol=0, atol=0)
    torch.testing.assert_close(_eval_out(plain), _eval_out(model), rtol=0, atol=0)


def test_pickle_and_deepcopy_after_training_keep_training():
    torch.manual_seed(0)
    model = az.convert_model(small_cnn())
    _train(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        torch.testing.assert_close(_eval_out(clone), _eval_out(model), rtol=0, atol=0)
        _train(clone, 2)
        assert all(torch.isfinite(p).all() for p in clone.parameters())
        # the clone owns its parameters: training it left the original alone
        assert not any(p is q for p, q in zip(clone.parameters(), model.parameters()))


def test_restore_model_after_training_is_plain_torch_with_the_trained_weights():
    torch.manual_seed(0)
    model = az.convert_model(small_cnn())
    _train(model)
    expect = _eval_out(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    plain = az.restore_model(model)
    assert not any(isinstance(m, QModule) for m in plain.modules())
    assert not hasattr(plain, "actnn_zoo_capture")
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    torch.testing.assert_close(_eval_out(plain), expect, rtol=0, atol=0)


def test_torch_compile_trains_with_correct_gradients():
    """The Q-layers' traced forms (custom operators, no host work) in one graph, as the plain
    model's (aot_eager backend: no C++ code generation in the test); tests/test_compile.py
    checks the graphs and the saved codes. Dynamo starts afresh: earlier tests' compiles of
    the same frames would count against its recompile limit."""
    torch.compiler.reset()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 10))
    q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform")
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    F.cross_entropy(ref(x), y).backward()
    compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
    F.cross_entropy(compiled(x), y).backward()
    for a, b in zip(ref.parameters(), q.parameters()):
        assert cos(b.grad, a.grad) >= 0.9999


# ------------------------------------------------------------------- DDP and FSDP
# One spawn of 2 gloo processes runs both wrappers (a spawn costs seconds); each test reads
# its part of the results.
def _sharded(model: nn.Module) -> nn.Module:
    """FSDP2 as its docs show it: every layer that holds parameters, then the root."""
    for m in model.children():
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    fully_shard(model)
    return model


def _ddp_part(rank: int, base: nn.Module) -> dict:
    x, y = _batch(10 + rank, 8)  # each rank its own shard of the data
    grads = {}
    for name, model in (("plain", copy.deepcopy(base)),
                        ("q8", az.convert_model(copy.deepcopy(base), bits=8,
                                                strategy="uniform"))):
        ddp = nn.parallel.DistributedDataParallel(model)
        F.cross_entropy(ddp(x), y).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    q2 = nn.parallel.DistributedDataParallel(az.convert_model(copy.deepcopy(base)))
    opt = torch.optim.SGD(q2.parameters(), lr=0.05)
    losses = []
    for s in range(3):
        xs, ys = _batch(20 + 2 * s + rank, 8)
        opt.zero_grad()
        loss = F.cross_entropy(q2(xs), ys)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"grads": grads, "losses": losses,
            "params": [p.detach().clone() for p in q2.parameters()]}


class _RawLinear(nn.Module):
    """No mapped class: its ``F.linear`` reaches tier 3, which must keep the weight exact."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)  # 4096 values: not "small"

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def _fsdp_part(rank: int, base: nn.Module) -> dict:
    x, y = _batch(40 + rank, 8)
    grads = {}
    for name, model in (("plain", copy.deepcopy(base)),
                        ("q8", az.convert_model(copy.deepcopy(base), bits=8,
                                                strategy="uniform"))):
        _sharded(model)
        F.cross_entropy(model(x), y).backward()
        # full_tensor(): the all-gathered (reduce-scattered, then gathered) gradient
        grads[name] = [p.grad.full_tensor().clone() for p in model.parameters()]
    q2 = _sharded(az.convert_model(copy.deepcopy(base)))  # the 2-bit default, capture on
    shards = [(p.to_local().numel(), p.numel()) for p in q2.parameters()]
    opt = torch.optim.SGD(q2.parameters(), lr=0.05)
    xs, ys = _batch(50 + rank, 8)  # one fixed batch per rank: the loss must go down
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(q2(xs), ys)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # tier 3 under fully_shard: the all-gathered weight exists only while its layer runs
    raw = _sharded(az.convert_model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), _RawLinear())))
    raw(torch.randn(8, 32)).sum().backward()
    kept = raw.actnn_zoo_capture.last_stats.passed.get("parameter or buffer", [0, 0])
    return {"grads": grads, "losses": losses, "shards": shards, "raw_weight_kept": kept,
            "strategy": type(az.precision_strategy(q2)).__name__}


def _dist_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)  # the same initial weights on both ranks
        base = small_cnn()
        for m in base.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        out = {"ddp": _ddp_part(rank, base), "fsdp": _fsdp_part(rank, base)}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        # Both ranks done before either tears its connections down: a rank that destroyed
        # the group while its peer was still finishing aborted once in CI ("terminate called
        # without an active exception" in gloo).
        dist.barrier()
    finally:
        dist.destroy_process_group()


RANKS_TIMEOUT_S = 300  # measured ~20 s on 2 busy cores; a hung rank must not hang the run


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """Both ranks' results. A rank that hangs (a gloo peer lost in a collective) is killed
    after RANKS_TIMEOUT_S and the tests fail: a plain ``mp.spawn(join=True)`` would wait
    forever, and its non-daemon children would keep pytest from exiting even after a
    per-test timeout."""
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        ctx = mp.start_processes(_dist_worker, args=(2, init, d), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    pytest.fail(f"the gloo ranks did not finish in {RANKS_TIMEOUT_S} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(os.path.join(d, f"rank{i}.pt")) for i in range(2)]


def _assert_8bit_grads_match(grads: dict) -> None:
    """8 bits: the synchronised gradient equals the plain wrapper's to quantization noise."""
    scale = max(g.norm() for g in grads["plain"])
    for a, b in zip(grads["plain"], grads["q8"]):
        if a.norm() < 1e-5 * scale:  # the conv bias before BatchNorm: zero in theory
            assert b.norm() < 1e-3 * scale
        else:
            assert cos(b, a) >= 0.9999


def test_distributed_data_parallel_on_two_gloo_processes(two_ranks):
    for rank in two_ranks:
        _assert_8bit_grads_match(rank["ddp"]["grads"])
        assert all(torch.isfinite(torch.tensor(rank["ddp"]["losses"])))
    # 2-bit default: both ranks hold the same weights after three synchronised steps
    for a, b in zip(two_ranks[0]["ddp"]["params"], two_ranks[1]["ddp"]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fsdp2_fully_shard_on_two_gloo_processes(two_ranks):
    """torch 2.13's fully_shard runs on CPU with gloo: parameters and gradients are DTensors
    sharded along dim 0; the Q-layers see the all-gathered weight in forward and backward."""
    for rank in two_ranks:
        fsdp = rank["fsdp"]
        _assert_8bit_grads_match(fsdp["grads"])
        # really sharded: each rank holds half of the final Linear's weight, not all of it
        local, full = fsdp["shards"][-2]
        assert local == full // 2
        losses = torch.tensor(fsdp["losses"])
        assert torch.isfinite(losses).all()
        assert losses[-1] < losses[0], losses  # six 2-bit steps on one batch: it learns
        assert fsdp["strategy"] == "ActNNStrategy"  # auto precision stayed attached
        # the unsharded weight that F.linear saved was recognised as a parameter (64 x 64
        # fp32 = 16 KiB), not compressed as if it were an activation
        assert fsdp["raw_weight_kept"] == [1, 64 * 64 * 4]
    # the reduce-scatter makes both ranks' gradients (and so their updates) the same
    for a, b in zip(two_ranks[0]["fsdp"]["grads"]["q8"], two_ranks[1]["fsdp"]["grads"]["q8"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
