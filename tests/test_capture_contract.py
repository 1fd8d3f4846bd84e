"""Capture keeps its contract in real training: weights are never compressed as activations,
and no payload outlives its backward.

Weights: tier 3 (the saved-tensor hooks) decides by what a tensor is -- a Parameter, a view of
one, or autocast's cast of one -- not by whose storage it shares; a weight outside the converted
model used inside ``capturing`` is a weight too. Lifetime: the store holds a payload only while
the tensor it was made from lives, so gradient accumulation inside one ``capturing`` block
frees each micro-batch's payloads with its backward.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az
from actnn_zoo.capture.store import CompressedStore, is_weight


class _RawMatmul(nn.Module):
    """A weight used through ``x @ w``: no Q-layer can take it, only tier 3 sees the save."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 96) / 11)
        self.w2 = nn.Parameter(torch.randn(96, 64) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) @ self.w2  # the first product is an activation (w2's gradient)


def test_autocast_weight_copy_is_kept_exact():
    """Under CPU bf16 autocast, the matmuls save bf16 copies of the weights; the input gradient
    ((g @ w2^T) @ w^T, reading only the weights) equals plain autocast's bit for bit, while
    the activations (x and x @ w, read by the weight gradients) are compressed."""
    torch.manual_seed(0)
    plain = _RawMatmul().train()
    conv = az.convert_model(_RawMatmul().train())
    conv.load_state_dict(plain.state_dict())
    x = torch.randn(256, 128)
    grads = []
    for model in (plain, conv):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xi)
        out.float().sum().backward()
        grads.append(xi.grad)
    stats = az.capture_report(conv)
    assert stats is not None and stats.compressed >= 2
    assert torch.equal(grads[0], grads[1])


def test_parameter_outside_the_model_is_a_weight():
    torch.manual_seed(0)
    body = az.convert_model(nn.Sequential(nn.Linear(32, 64), nn.GELU()).train())
    head = nn.Parameter(torch.randn(128, 64) / 8)  # 8192 values: above the size tier 3 skips
    x = torch.randn(128, 32)
    with az.capturing(body) as stats:
        h = body(x)
        h.retain_grad()
        loss = F.linear(h, head).sum()
    loss.backward()
    # dL/dh = 1 @ head: exact only if the head weight was kept as it is
    expect = torch.ones(128, 128) @ head.detach()
    torch.testing.assert_close(h.grad, expect, rtol=1e-6, atol=1e-6)
    assert stats.passed.get("parameter or buffer", [0])[0] >= 1


def test_is_weight_follows_casts_and_views_only():
    w = nn.Parameter(torch.randn(8, 4))
    assert is_weight(w) and is_weight(w.t()) and is_weight(w[:, :2])
    assert is_weight(w.to(torch.bfloat16)) and is_weight(w.to(torch.bfloat16).t())
    assert not is_weight(w * 2)  # computed from the weight: an activation
    assert not is_weight(torch.randn(8, 4, requires_grad=True).to(torch.bfloat16))
    assert not is_weight(torch.randn(8, 4))


def _payload_refs(store: CompressedStore) -> list:
    return [weakref.ref(t) for _, q in list(store._cache.values()) for t in q.tensors()]


def test_micro_batches_inside_one_block_free_their_payloads():
    """Gradient accumulation inside one ``capturing`` block: after each micro-batch's
    backward, none of its payloads is alive (before: the store's cache kept them all)."""
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Linear(64, 128), nn.Tanh(),
                                           nn.Linear(128, 128), nn.Tanh(),
                                           nn.Linear(128, 10)).train(), bits=2,
                             strategy="uniform")
    sessions = []
    orig_open = az.capture.attach.CaptureSession.open

    def spy_open(self):
        sessions.append(self)
        return orig_open(self)

    az.capture.attach.CaptureSession.open = spy_open
    try:
        with az.capturing(model):
            store = sessions[0].store
            for k in range(4):
                x = torch.randn(256, 64)
                y = torch.randint(0, 10, (256,))
                loss = F.cross_entropy(model(x), y)
                refs = _payload_refs(store)
                loss.backward()
                del loss, x
                gc.collect()
                alive = sum(r() is not None for r in refs)
                assert alive == 0, f"micro-batch {k}: {alive} payload tensors outlive backward"
    finally:
        az.capture.attach.CaptureSession.open = orig_open


class _SharedInput(nn.Module):
    """LayerNorm's output read by three Linears and a product: one payload, four readers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(256)
        self.q, self.k, self.v = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = self.q(h) * self.k(h)
        return (a * a + self.v(h)).tanh()


def _backward_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The most bytes allocated at once during backward, counted from before the forward (so
    what the forward left saved is included): torch.profiler's memory events, each op's own
    allocations minus frees placed at its end (frees an enclosing op makes are counted late,
    which can only raise the peak, the same way for both runs)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x).sum()
        with record_function("az_backward"):
            out.backward()
        del out
    events = prof.events()
    start = next(e for e in events if e.name == "az_backward").time_range.start
    timeline = sorted((e for e in events if e.self_cpu_memory_usage and e.name != "az_backward"),
                      key=lambda e: e.time_range.end)
    live = peak = 0
    for e in timeline:
        live += e.self_cpu_memory_usage
        if e.time_range.end >= start:
            peak = max(peak, live)
    return peak


@pytest.mark.usefixtures("one_thread")
def test_backward_peak_with_the_store_is_no_higher_than_without(monkeypatch):
    """The store keeps a shared payload until its last reader's backward; without it every
    reader keeps its own copy until its own. The backward's peak (the forward's saves
    included) must not be higher with the store: measured 3.33 MB with, 3.40 MB without."""
    torch.manual_seed(0)
    model = az.convert_model(_SharedInput(), bits=2, strategy="uniform")
    x = torch.randn(512, 256)
    for _ in range(2):  # warm-up: one-time allocations out of the measurement
        _backward_peak(model, x)
    with_store = _backward_peak(model, x)
    assert az.capture_report(model).shared >= 3

    class NoCache(dict):
        def get(self, key, default=None):
            return None

        def __setitem__(self, key, value):
            pass

    init = CompressedStore.__init__

    def no_cache_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cache = NoCache()

    monkeypatch.setattr(CompressedStore, "__init__", no_cache_init)
    for _ in range(2):
        _backward_peak(model, x)
    without = _backward_peak(model, x)
    assert az.capture_report(model).shared == 0
    assert with_store <= without, (with_store, without)
