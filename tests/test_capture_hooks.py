"""Capture composes with the user's saved-tensor hooks (issue 30, "Hooks compose").

Saved-tensor hooks do not chain: torch calls only the innermost pair, and a converted model's
capture hooks are innermost during its forward. Hooks the user enters *around* the model
(``save_on_cpu``, an offloading or counting pair) must still receive what the library keeps --
the compressed payloads, as tensors -- so offloading keeps working and offloads compressed
activations. Hooks entered *inside* the forward are innermost themselves: what the zoo's
Functions save (tiers 1 and 2) reaches them already compressed.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.capture.store import outer_hooks_present

from _spy import OwnSavesSpy

pytestmark = pytest.mark.usefixtures("one_thread")


class _Net(nn.Module):
    """All three tiers: Q-layers (Linear, LayerNorm), a routed functional call (gelu), products
    only tier 3 sees (``h * h``: one tensor saved twice, compressed once), a bool mask saved by
    ``where`` (tier 3's 1-bit masks) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.b = nn.Linear(128, 64)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.norm(self.a(x)))
        h = torch.where(h > 0.1, h * h, h)
        return self.b(F.dropout(h, 0.1, training=self.training))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 64, generator=g)


def _grads(model: nn.Module, x: Tensor, hooks=None, seed: int = 1):
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    torch.manual_seed(seed)  # dropout and stochastic rounding draw the same numbers
    if hooks is None:
        out = model(xi)
    else:
        with hooks:
            out = model(xi)
    out.square().sum().backward()
    return [xi.grad] + [p.grad for p in model.parameters()]


class _Counting:
    """A user's pair that records every tensor it packs and copies it (as an offloader does),
    counting unpacks."""

    def __init__(self) -> None:
        self.packed: list = []
        self.unpacked = 0

    def pack(self, t: Tensor):
        self.packed.append((t.dtype, tuple(t.shape), t.numel()))
        return t.clone()

    def unpack(self, t: Tensor) -> Tensor:
        self.unpacked += 1
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def test_outer_hooks_receive_the_compressed_payloads():
    """Before: the user's hooks saw 0 of the model's saves. Now they see every kept tensor:
    uint8 codes, bf16 ranges, the masks, the weights -- and no activation-sized float tensor
    (the largest activation here is 256 x 128 = 32768 values)."""
    torch.manual_seed(0)
    q = az.convert_model(_Net(), bits=2, strategy="uniform")
    user = _Counting()
    grads = _grads(q, _data(), user.hooks())
    assert user.packed, "the user's hooks saw nothing"
    dtypes = {d for d, _, _ in user.packed}
    assert torch.uint8 in dtypes and torch.bfloat16 in dtypes, dtypes
    weights = {tuple(p.shape) for p in q.parameters()}
    big_float = [(d, s) for d, s, n in user.packed
                 if d.is_floating_point and n >= 4096 and s not in weights]
    assert not big_float, big_float
    assert user.unpacked > 0  # backward read them back through the user's unpack
    assert all(torch.isfinite(g).all() for g in grads)


def test_save_on_cpu_gives_the_same_gradients():
    """``save_on_cpu`` around a converted model: the gradients are bit-equal to those without it
    (same seed: the same stochastic rounding and dropout)."""
    torch.manual_seed(0)
    q = az.convert_model(_Net(), bits=2, strategy="uniform")
    x = _data()
    plain = _grads(q, x)
    offloaded = _grads(q, x, torch.autograd.graph.save_on_cpu())
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)


def test_a_box_owns_its_node():
    """What the store keeps for a boxed save is the :class:`_Box` call's output, which owns
    the node that holds the outer hooks' packs. Before torch 2.13 the ``grad_fn`` object of a
    custom Function (its ``ctx``) holds the node only weakly: a store that kept ``grad_fn``
    alone found the saves freed at the first read ("saved tensors ... already freed"). With
    torch 2.11, five tests of this file failed that way (``save_on_cpu`` on an H200 among
    them) and pass with the output kept; torch 2.13 keeps the node either way, so here the
    test checks the holder's type and that the saves read back after a collection."""
    import gc

    from actnn_zoo.capture.store import _box, _box_saved

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t.clone(),
                                                  lambda t: t.clone()):
        box = _box(torch.empty(0, requires_grad=True), (torch.arange(3.0), torch.ones(2)))
    gc.collect()
    assert isinstance(box, Tensor) and box.grad_fn is not None and len(packed) == 2
    a, b = _box_saved(box)
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b, torch.ones(2))


def test_retain_graph_reads_boxed_saves_twice():
    torch.manual_seed(0)
    q = az.convert_model(_Net(), bits=4, strategy="uniform")
    user = _Counting()
    x = _data().requires_grad_()
    torch.manual_seed(1)
    with user.hooks():
        out = q(x).square().sum()
    start = user.unpacked  # (without the extension outer_hooks_present reads one save)
    g1 = torch.autograd.grad(out, [x] + list(q.parameters()), retain_graph=True)
    first = user.unpacked - start
    g2 = torch.autograd.grad(out, [x] + list(q.parameters()))
    assert user.unpacked - start == 2 * first > 0
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_gradients_match_fp32_at_8_bits_under_outer_hooks():
    """8 bits under ``save_on_cpu``: every gradient has cosine >= 0.9999 with fp32 (the net
    without dropout, so that the reference is deterministic)."""
    torch.manual_seed(0)
    ref_nodrop = _NoDropout(_Net())
    q_nodrop = az.convert_model(copy.deepcopy(ref_nodrop), bits=8, strategy="uniform")
    x = _data()
    want = _grads(ref_nodrop, x)
    got = _grads(q_nodrop, x, torch.autograd.graph.save_on_cpu())
    for a, b in zip(want, got):
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.9999


class _NoDropout(nn.Module):
    def __init__(self, net: _Net) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        n = self.net
        h = F.gelu(n.norm(n.a(x)))
        return n.b(torch.where(h > 0.1, h * h, h))


def test_hooks_entered_inside_the_model_still_get_compressed_payloads():
    """A user's hooks entered inside the forward are innermost: they see the Q-layers' and
    the routed calls' saves, which the zoo's Functions compressed through the store first (no
    activation-sized float tensor reaches them from those tiers)."""
    user = _Counting()

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 128)
            self.b = nn.Linear(128, 64)

        def forward(self, x: Tensor) -> Tensor:
            with user.hooks():
                return self.b(F.gelu(self.a(x)))

    torch.manual_seed(0)
    q = az.convert_model(Inner(), bits=2, strategy="uniform")
    _grads(q, _data())
    dtypes = {d for d, _, _ in user.packed}
    assert torch.uint8 in dtypes, dtypes
    weights = {tuple(p.shape) for p in q.parameters()}
    assert not [(d, s) for d, s, n in user.packed
                if d.is_floating_point and n >= 4096 and s not in weights]
    assert az.capture_report(q).routed == {"gelu": 1}


@pytest.mark.parametrize("ask", ["hook stack", "probe"])
def test_outer_hooks_present_asks_autograd(ask, monkeypatch):
    """From autograd's hook stack (the extension), or without it by a save whose version
    check the hooks skip: the same answers."""
    from actnn_zoo.capture import store

    assert store._HOOKS_ACTIVE is not None
    if ask == "probe":
        monkeypatch.setattr(store, "_HOOKS_ACTIVE", None)
    assert not outer_hooks_present()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert outer_hooks_present()
    with torch.autograd.graph.save_on_cpu():
        assert outer_hooks_present()
    assert not outer_hooks_present()


def test_whole_model_inside_a_checkpoint_still_trains():
    """The converted root checkpointed from outside: the checkpoint's hooks are below the
    capture hooks, which keep the saves themselves there (not boxed), as before."""
    torch.manual_seed(0)
    ref = _NoDropout(_Net())
    q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform")
    x = _data()
    want = _grads(ref, x)

    class Outer(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Tensor) -> Tensor:
            return torch.utils.checkpoint.checkpoint(self.m, x, use_reentrant=False)

    got = _grads(Outer(q), x)
    for a, b in zip(want, got):
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.9999


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunked", [False, True])
def test_save_on_cpu_offloads_compressed_activations_on_cuda(chunked, monkeypatch):
    """On CUDA: with ``save_on_cpu(pin_memory=True)`` the device memory held after the forward
    is about what it holds with no saved activations at all (the payload-free level: the
    output); the compressed payloads went to the host. One payload may stay on the device: the
    store's cache keeps a payload while the tensor it was made from lives (here the input
    ``x``, 2 bits of 4096 x 1024 plus ranges: ~1.1 MiB).

    ``chunked``: each GELU's derivative made in 1 MiB chunks by the Python Function, the path
    this test took on an H200 (torch 2.11) before chunks off the CPU were 64x larger, where its
    backward raised "saved tensors ... already freed" in the store's boxed-group read: the
    store kept the box's ``grad_fn``, which before torch 2.13 does not own its node
    (:func:`test_a_box_owns_its_node`). Both paths are kept."""
    from actnn_zoo.functional import _saving

    if chunked:
        monkeypatch.setattr(_saving, "DEVICE_CHUNK_SCALE", 1)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU())
                            for _ in range(8)]).to(dev)
    q = az.convert_model(model, bits=2, strategy="uniform")
    x = torch.randn(4096, 1024, device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = q(x)
    free_level = torch.cuda.memory_allocated() - base
    del out
    out = q(x)  # compressed, on the device
    on_device = torch.cuda.memory_allocated() - base
    del out
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = q(x)
    offloaded = torch.cuda.memory_allocated() - base
    out.sum().backward()
    assert on_device > free_level + 8 * (4096 * 1024 // 4)  # 2-bit payloads of 16 maps
    assert offloaded <= free_level + (2 << 20), (free_level, on_device, offloaded)


class _EveryNode(nn.Module):
    """A Q-layer of every kind that runs as a compiled node (cpp_ext/qlayers.cpp) under
    capture: conv, batch norm, ReLU (its mask, then a claim on the next conv's codes), linear,
    layer norm, GELU, dropout, and attention (a routed call; q, k and v distinct tensors: a
    node that saves one tensor twice has it counted twice in the hooks' path, which pops its
    entry at the first save, and once where the hooks are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.fc = nn.Linear(64, 96)
        self.norm = nn.LayerNorm(96)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv2(self.relu(self.bn(self.conv(x)))).flatten(1)
        q, k, v = self.drop(self.act(self.norm(self.fc(h)))).view(-1, 3, 2, 4, 4).unbind(1)
        return self.head(F.scaled_dot_product_attention(q, k, v).flatten(1))


def test_compiled_nodes_save_past_the_stores_own_hooks(monkeypatch):
    """Where the store's hooks are innermost and would pass a compiled node's saves through
    unchanged (no outer hooks, no observer), the node skips them (``keep_own``): none of those
    tensors reaches the pack hook, and the gradients and the capture report are what the hooks'
    path gives, bit for bit. With ``keep_own`` answering None (the hooks' path) every one of
    them is packed, so the check can fail."""
    spy = OwnSavesSpy(monkeypatch)
    torch.manual_seed(0)
    model = _EveryNode()
    x = torch.randn(4, 3, 4, 4)
    runs = {}
    for name in ("skipped", "hooks"):
        spy.take(name)
        q = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
        grads = []
        for step in range(2):  # the ReLU claims the next conv's codes from the second step
            spy.reset()
            grads.append(_grads(q, x, seed=step))
        runs[name] = (grads, str(az.capture_report(q)), spy.own_packed(), len(spy.own))
    (g_skip, report_skip, n_packed_skip, n_own), (g_hooks, report_hooks, n_packed_hooks, _) = \
        runs["skipped"], runs["hooks"]
    assert n_own >= 25, n_own  # every node kind saved something
    assert n_packed_skip == 0
    assert n_packed_hooks == n_own
    assert report_skip == report_hooks
    assert "routed: scaled_dot_product_attention x1" in report_skip
    for a, b in zip(sum(g_skip, []), sum(g_hooks, [])):
        assert torch.equal(a, b)


def test_a_compiled_nodes_saved_weight_keeps_the_in_place_check_under_capture():
    """Saved as a plain saved variable (above), a Q-layer's weight keeps autograd's version
    check inside a converted model, as in plain PyTorch: a weight changed in place between
    forward and backward raises instead of giving a gradient computed with the new weight."""
    q = az.convert_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), bits=2,
                         strategy="uniform")
    out = q(torch.randn(4, 8)).sum()
    with torch.no_grad():
        q[1].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_node_that_raises_leaves_the_stores_hooks_running():
    """A compiled node that raises while it skips the store's hooks puts them back (the skip is
    scoped to the call): tier 3 still compresses the plain ops' saves that follow in the same
    forward, and hooks entered after it still see saves."""

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: Tensor) -> Tensor:
            with pytest.raises(RuntimeError):
                self.lin(x[:, :3])  # the node's wrong-width error, raised inside the skip
            h = self.lin(x)
            return h * h  # saves h through tier 3

    q = az.convert_model(Fails(), bits=4, strategy="uniform")
    q(torch.randn(256, 32)).sum().backward()  # h: 8192 values, over tier 3's 4096
    report = az.capture_report(q)
    assert report.compressed + report.shared == 2  # h, saved twice by mul
    user = _Counting()
    with user.hooks():
        (torch.randn(8, requires_grad=True) * torch.randn(8)).sum()
    assert len(user.packed) == 1
