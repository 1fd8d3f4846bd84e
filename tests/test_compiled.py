"""actnn_zoo.compile: one torch.compile graph whose saves are compressed inside it.

Checked against the plain model in one process, backend aot_eager (no C++ code generation):
no more graphs than torch.compile of the plain model, 8-bit gradients with cosine >= 0.9999
against eager fp32 (dropout off: its masks differ between the runs), the bytes a forward
leaves alive (glibc's allocator count, whoever holds them) within 1.2x of the eager
converted model's, training through 30 steps, and the wrapper's contract (one copy of the
parameters, the switch off after every call, errors that name the argument).
"""
from __future__ import annotations

import copy
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az
from actnn_zoo._compile import INLINE_ATTR
from actnn_zoo._torch_private import compiled_saved_hooks_supported

from _graphs import (counting, grad_nodes, held_bytes, min_cosine, no_dropout,
                     train_30_steps)

# actnn_zoo.compile refuses a torch without compiled saved-tensor hooks (torch 2.6;
# test_compile.py::test_a_torch_without_compiled_saved_hooks_is_refused, which runs there
# too); CI's torch has them
pytestmark = pytest.mark.skipif(not compiled_saved_hooks_supported(),
                                reason="this torch cannot compile saved-tensor hooks")


def _cnn() -> nn.Module:
    """Conv-BN-ReLU blocks with an in-place ReLU and a max-pool (no conv bias before a BN: its
    exact gradient is zero, so a cosine with it measures rounding noise)."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(inplace=True), nn.Conv2d(16, 32, 3, padding=1, bias=False),
                         nn.BatchNorm2d(32),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 32, 3, padding=1, bias=False),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


def _check_model(make: Callable[[], nn.Module], loss_of: Callable[[nn.Module], torch.Tensor]):
    torch.manual_seed(0)
    base = no_dropout(make().train())
    counts: Dict[str, int] = {}
    plain = torch.compile(copy.deepcopy(base), backend=counting(counts, "plain"))
    eager_q = az.convert_model(copy.deepcopy(base))
    compiled = az.compile(az.convert_model(copy.deepcopy(base)),
                          backend=counting(counts, "zoo"))
    held = {}
    for name, m in (("fp32", base), ("plain", plain), ("eager", eager_q), ("zoo", compiled)):
        for _ in range(3):  # compiled on the first; the strategy's first allocations
            held[name] = held_bytes(lambda: loss_of(m))  # noqa: B023
            m.zero_grad(set_to_none=True)
    assert counts["zoo"] <= counts["plain"], counts
    assert held["zoo"] <= 1.2 * held["eager"], held
    assert held["zoo"] * 6 < held["fp32"], held

    ref = copy.deepcopy(base)
    q8 = az.convert_model(copy.deepcopy(base), bits=8)
    loss_of(ref).backward()
    loss_of(az.compile(q8, backend="aot_eager")).backward()
    cos = min_cosine(ref, q8)
    assert cos >= 0.9999, cos
    return base, compiled


@pytest.mark.parametrize("bits", [2])
def test_cnn_one_graph_compressed_and_exact_at_8_bits(one_thread, bits):
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2))
    _check_model(_cnn, lambda m: F.cross_entropy(m(x), y))


def test_cnn_trains_30_steps(one_thread):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
    model = az.convert_model(_cnn())
    compiled = az.compile(model, backend="aot_eager")
    train_30_steps(compiled, torch.optim.Adam(compiled.parameters(), lr=0.01), x, y)
    # the running statistics moved as torch's would (updated in the compiled graph)
    assert float(model[1].num_batches_tracked) == 30
    assert not torch.allclose(model[1].running_var, torch.ones(16))


def test_batch_norm_running_stats_match_torch():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=0.3)).train()
    zoo = az.compile(az.convert_model(copy.deepcopy(base)), backend="aot_eager")
    x = torch.randn(4, 3, 9, 9) * 2 + 1
    for _ in range(3):
        base(x).sum().backward()
        zoo(x).sum().backward()
    bn, qbn = base[1], zoo.module[1]
    assert torch.allclose(bn.running_mean, qbn.running_mean, atol=1e-5)
    assert torch.allclose(bn.running_var, qbn.running_var, atol=1e-5)
    assert int(bn.num_batches_tracked) == int(qbn.num_batches_tracked) == 3


def test_gpt2_one_graph_compressed_and_exact_at_8_bits(one_thread):
    transformers = pytest.importorskip("transformers")
    # use_cache=False, as in training: the compiled graph keeps the returned key/value cache
    # alive with the loss (the eager model frees it with the output object)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64, use_cache=False)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    _check_model(lambda: transformers.GPT2LMHeadModel(cfg), lambda m: m(ids, labels=ids).loss)


def test_wrapper_keeps_one_copy_and_switches_off():
    model = az.convert_model(_cnn())
    compiled = az.compile(model, backend="aot_eager")
    assert list(compiled.state_dict()) == ["module." + k for k in model.state_dict()]
    assert len(list(compiled.parameters())) == len(list(model.parameters()))
    switch = getattr(model, INLINE_ATTR)
    with pytest.raises(RuntimeError):
        compiled(torch.randn(2, 5, 8, 8))  # wrong channel count
    assert switch.on is False  # off again after an error
    compiled(torch.randn(2, 3, 8, 8)).sum().backward()
    assert switch.on is False
    # the model itself, called eagerly, still runs its Q-layers' Functions
    out = model(torch.randn(2, 3, 8, 8, requires_grad=True))
    names = grad_nodes(out)
    assert {"QConvFunction", "QNormFunction",
            "QLinearFunction"} <= names, names
    assert az.capture_report(model) is not None


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="nn.Module"):
        az.compile(lambda x: x)
    with pytest.raises(ValueError, match="bits"):
        az.compile(_cnn(), bits=3)
    with pytest.raises(ValueError, match="group_size"):
        az.compile(_cnn(), group_size=10)
    with pytest.raises(ValueError, match="min_numel"):
        az.compile(_cnn(), min_numel=0)


def test_resnet50_one_graph_compressed_and_trains(one_thread):
    """torchvision ResNet-50 at the default (batch 2, 32x32): no more graphs than torch.compile
    of the plain model, allocator bytes within 1.2x of the eager converted model's, and 30
    compiled training steps. Its 8-bit gradient cosine is measured by
    scripts/bench_compile.py at batch 8, 64x64 (0.99979; the eager converted model's 0.99973):
    below 0.9999 on batch-norm weights for both, so not asserted here at 0.9999."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    base = tv.models.resnet50(weights=None, num_classes=10).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    counts: Dict[str, int] = {}
    plain = torch.compile(copy.deepcopy(base), backend=counting(counts, "plain"))
    eager_q = az.convert_model(copy.deepcopy(base))
    model = az.convert_model(copy.deepcopy(base))
    compiled = az.compile(model, backend=counting(counts, "zoo"))
    held = {}
    for name, m in (("fp32", base), ("plain", plain), ("eager", eager_q), ("zoo", compiled)):
        for _ in range(2):
            held[name] = held_bytes(lambda: F.cross_entropy(m(x), y))  # noqa: B023
            m.zero_grad(set_to_none=True)
    assert counts["zoo"] <= counts["plain"], counts
    assert held["zoo"] <= 1.2 * held["eager"], held
    train_30_steps(compiled, torch.optim.SGD(compiled.parameters(), lr=0.05, momentum=0.9),
                    x, y)
    assert counts["zoo"] <= counts["plain"], counts  # no recompilation into more graphs


def test_inductor_gradients_match_at_8_bits(one_thread):
    """The default backend (inductor: generated C++ around the custom operators), dynamic
    shapes on: 8-bit gradients as close to fp32's as aot_eager's."""
    torch.manual_seed(0)
    base = _cnn().train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    ref = copy.deepcopy(base)
    F.cross_entropy(ref(x), y).backward()
    q8 = az.convert_model(copy.deepcopy(base), bits=8)
    F.cross_entropy(az.compile(q8, dynamic=True)(x), y).backward()
    assert min_cosine(ref, q8) >= 0.9999


class _RawWeight(nn.Module):
    """``x @ w`` with a raw Parameter: under autocast the matmul saves bfloat16 copies of the
    weight and of the input, which the graph makes (intermediates, not inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 96))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_autocast_weight_copies_stay_exact():
    """Casts of graph inputs (autocast's weight copy) are not activations: kept as they are,
    so both gradients are bit-equal to plain eager autocast's. Rounded to 2 bits, the weight
    copy gave the input gradient a cosine of about 0.8."""
    torch.manual_seed(0)
    model = _RawWeight()
    x = torch.randn(48, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    gx, gw = torch.autograd.grad(out.float().sum(), (x, model.w))
    compiled = az.compile(model, bits=2, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_c = compiled(x)
    gx_c, gw_c = torch.autograd.grad(out_c.float().sum(), (x, model.w))
    assert torch.equal(out_c, out)
    assert torch.equal(gx_c, gx) and torch.equal(gw_c, gw)


@pytest.mark.parametrize("pool", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                  dict(kernel_size=2, ceil_mode=True),
                                  dict(kernel_size=3, stride=1, dilation=2)], ids=str)
def test_relu_mask_and_pool_positions_are_exact(pool):
    """ReLU's packed mask and max-pool's window codes keep exactly what the backward reads:
    the input gradient (through the head, the pool, the ReLU and the conv, none of which reads
    a rounded value) equals eager fp32's to rounding of the sums."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(**pool),
                        nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(4, 3, 11, 11, requires_grad=True)
    ref(x)  # materialise the lazy head
    model = az.compile(az.convert_model(copy.deepcopy(ref), bits=2), backend="aot_eager")
    (expect,) = torch.autograd.grad(ref(x).square().sum(), x)
    (got,) = torch.autograd.grad(model(x).square().sum(), x)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


def test_eager_fallback_keeps_gradients_exact():
    """When dynamo runs the model without a graph (here forced by ``set_stance``; also after
    its recompile limit or in a frame it skips), the hooks keep every save as it is and the
    Q-layers compress eagerly. Before, the pack hook rounded whatever reached it (parameters
    and the eager layers' own saves included), so the input gradient read a rounded weight."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(8 * 25, 16))  # a weight of >= min_numel
    model = az.compile(az.convert_model(copy.deepcopy(ref), bits=8), backend="aot_eager")
    x = torch.randn(4, 3, 11, 11, requires_grad=True)
    expect = torch.autograd.grad(ref(x).square().sum(), [x] + list(ref.parameters()))
    with torch.compiler.set_stance("force_eager"):
        got = torch.autograd.grad(model(x).square().sum(), [x] + list(model.parameters()))
    torch.testing.assert_close(got[0], expect[0], rtol=1e-5, atol=1e-6)
    for g, e in zip(got[1:], expect[1:]):
        assert F.cosine_similarity(g.flatten(), e.flatten(), dim=0) > 0.9999
