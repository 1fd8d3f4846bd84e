"""Batch, layer and group norm's backward read from the codes of their saved x_hat
(``quant.norm_backward``).

The CPU kernels (``_C.batch_norm_backward_codes``, ``_C.layer_norm_backward_codes``) against
their torch twins in ``quant.reference`` (float64 sums on the decoded x_hat) over shapes, widths
and group sizes (hypothesis); the formulas against aten's ``native_batch_norm_backward`` /
``native_layer_norm_backward`` in float64; the same bits at one and two threads; bad input; and
QBatchNorm / QLayerNorm / QGroupNorm taking the path (batch and group norm leaving
channels-last gradients to aten)
with gradients equal to the decoded path's up to float rounding, including a retained graph run
twice.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo.functional.norm as fnorm
from actnn_zoo import convert_model
from actnn_zoo.quant import QuantizedTensor, SampleBits, dequantize, quantize, reference
from actnn_zoo.quant.norm_backward import (batch_norm_backward_codes, group_norm_backward_codes,
                                           layer_norm_backward_codes, reads_codes)

from _ext import compiled_extension


def compiled():
    from actnn_zoo.quant.backend import kernels
    return getattr(kernels(torch.device("cpu")), "batch_norm_backward_codes", None)


def _payload(shape, widths, group, seed):
    """(generator, codes of a random x_hat of ``shape`` at ``widths``, a random gradient)."""
    g = torch.Generator().manual_seed(seed)
    x_hat = torch.randn(shape, generator=g) * 1.5
    n = shape[0]
    if widths == "sample":
        b = torch.tensor([2, 4, 1, 8, 2, 2][:n], dtype=torch.uint8)
        bits = SampleBits(b, int(b.sum()) + 3)
    else:
        bits = int(widths)
    return g, quantize(x_hat, bits, group, seed=seed), torch.randn(shape, generator=g)


def _codes(n, c, spatial, widths, group, seed):
    g, q, grad = _payload((n, c) + spatial, widths, group, seed)
    invstd = torch.rand(c, generator=g) + 0.5
    weight = torch.rand(c, generator=g) + 0.5
    return q, grad, invstd, weight


def _reference(grad, q, invstd, weight, need_input=True):
    n, c = grad.shape[:2]
    row_bits, offsets = q.row_layout()
    gi, gw, gb = reference.batch_norm_backward_codes(
        grad.reshape(n, c, -1), q.data, q.lo, q.step, row_bits, offsets, q.group_size, invstd,
        weight, need_input)
    return (gi.view(grad.shape) if gi is not None else None), gw, gb


def _close(a, b, what):
    scale = max(float(b.abs().max()), 1.0) if b.numel() else 1.0
    assert torch.allclose(a, b, rtol=0, atol=2e-5 * scale), \
        f"{what}: max diff {float((a - b).abs().max())} at scale {scale}"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), c=st.integers(1, 9),
       spatial=st.sampled_from([(), (1,), (5,), (3, 7), (4, 4), (2, 3, 5)]),
       widths=st.sampled_from(["1", "2", "4", "8", "sample"]),
       group=st.sampled_from([8, 32, 64, 256]), seed=st.integers(0, 2 ** 31 - 1),
       affine=st.booleans(), need_input=st.booleans())
def test_kernel_matches_the_torch_formula(n, c, spatial, widths, group, seed, affine,
                                          need_input):
    compiled_extension()
    q, grad, invstd, weight = _codes(n, c, spatial, widths, group, seed)
    w = weight if affine else None
    assert reads_codes(grad, q, invstd, w)
    gi, gw, gb = batch_norm_backward_codes(grad, q, invstd, w, need_input)
    ri, rw, rb = _reference(grad, q, invstd, w, need_input)
    _close(gw, rw, "grad_weight")
    _close(gb, rb, "grad_bias")
    if need_input:
        assert gi.shape == grad.shape and gi.dtype == torch.float32
        _close(gi, ri, "grad_input")
    else:
        assert gi is None


def test_formula_is_aten_batch_norm_backward():
    """From x = x_hat / invstd + mean, aten's training backward gives the same three gradients
    (float64, so only the formula is compared)."""
    q, grad, invstd, weight = _codes(5, 4, (3, 6), "8", 64, 3)
    x_hat = dequantize(q).double()
    mean = torch.randn(4, dtype=torch.float64)
    x = x_hat / invstd.double()[None, :, None, None] + mean[None, :, None, None]
    gi, gw, gb = torch.ops.aten.native_batch_norm_backward(
        grad.double(), x, weight.double(), None, None, mean, invstd.double(), True, 1e-5,
        [True, True, True])
    ri, rw, rb = _reference(grad.double(), q, invstd.double(), weight.double())
    assert torch.allclose(ri, gi, atol=1e-9) and torch.allclose(rw, gw.float(), atol=1e-5)
    assert torch.allclose(rb, gb.float(), atol=1e-5)


def test_same_bits_at_any_thread_count():
    compiled_extension()
    q, grad, invstd, weight = _codes(6, 5, (9, 11), "sample", 64, 5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = batch_norm_backward_codes(grad, q, invstd, weight)
        torch.set_num_threads(2)
        two = batch_norm_backward_codes(grad, q, invstd, weight)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_bad_input_is_named():
    q, grad, invstd, weight = _codes(3, 4, (5,), "2", 32, 1)
    with pytest.raises(ValueError, match="shape"):
        batch_norm_backward_codes(grad[:2], q, invstd, weight)
    with pytest.raises(ValueError, match="invstd"):
        batch_norm_backward_codes(grad, q, invstd[:3], weight)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        batch_norm_backward_codes(grad, grad, invstd, weight)
    ext = compiled_extension()
    g3 = grad.reshape(3, 4, -1)
    off = reference.uniform_offsets(3, 20, 2, grad.device)
    rb = torch.full((3,), 2, dtype=torch.uint8)
    with pytest.raises((RuntimeError, ValueError), match="grad must be float32"):
        ext.batch_norm_backward_codes(g3.double(), q.data, q.lo, q.step, rb, off, 32, invstd,
                                      weight, True)
    with pytest.raises((RuntimeError, ValueError), match="lo must be"):
        ext.batch_norm_backward_codes(g3, q.data, q.lo[:2], q.step, rb, off, 32, invstd,
                                      weight, True)
    with pytest.raises((RuntimeError, ValueError), match="does not fit"):
        ext.batch_norm_backward_codes(g3, q.data[:5], q.lo, q.step, rb, off, 32, invstd,
                                      weight, True)


def _layer_grads(model, x, g, kernel: str, reads: bool, monkeypatch):
    """Gradients of ``model`` (input first, then parameters) with the codes path on or off
    (``reads``), checked equal when the retained graph is run again, and how many times the
    ``kernel`` wrapper of functional/norm.py ran. The norms' fused forward and backward
    (tests/test_norm_fused.py: equal to this path) are off, so the Python path runs."""
    monkeypatch.setattr(fnorm, "_BN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_LN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_GN_FORWARD", None)
    calls = []
    real = getattr(fnorm, kernel)
    monkeypatch.setattr(fnorm, kernel, lambda *a: calls.append(1) or real(*a))
    if not reads:
        monkeypatch.setattr(fnorm, "reads_codes", lambda *a: False)
    xx = x.clone().requires_grad_()
    torch.manual_seed(0)
    y = model(xx)
    y.backward(g, retain_graph=True)
    grads = [xx.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    xx.grad = None
    for p in model.parameters():
        p.grad = None
    y.backward(g)
    again = [xx.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads, again):
        assert torch.equal(a, b)
    for p in model.parameters():
        p.grad = None
    monkeypatch.undo()
    return grads, len(calls)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("layer", ["batch", "group", "group, no affine"])
@pytest.mark.parametrize("config", [{"bits": 2, "strategy": "uniform"}, None])
def test_qbatchnorm_and_qgroupnorm_read_the_codes(memory_format, layer, config, monkeypatch):
    """Batch and group norm take the codes path for (N, C, *spatial)-contiguous gradients (a
    channels-last one is not: aten's path) with the decoded path's gradients, twice over a
    retained graph."""
    compiled_extension()
    torch.manual_seed(0)
    affine = layer != "group, no affine"
    norm = nn.BatchNorm2d(6) if layer == "batch" else nn.GroupNorm(3, 12, affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-1, 1)
    model = convert_model(nn.Sequential(norm), config)
    shape = (8, 6, 5, 7) if layer == "batch" else (6, 12, 5, 7)
    x = (torch.randn(shape) * 2 + 1).contiguous(memory_format=memory_format)
    g = torch.randn(x.shape).contiguous(memory_format=memory_format)
    kernel = f"{layer.split(',')[0]}_norm_backward_codes"
    codes, n_codes = _layer_grads(model, x, g, kernel, True, monkeypatch)
    decoded, n_decoded = _layer_grads(model, x, g, kernel, False, monkeypatch)
    assert n_decoded == 0
    # a channels-last gradient is not contiguous in (N, C, H, W) order: aten's path
    assert n_codes == (2 if memory_format == torch.contiguous_format else 0)
    assert len(codes) == (3 if affine else 1)
    for a, b in zip(codes, decoded):
        assert a.shape == b.shape
        _close(a, b, "gradient")


def test_non_float32_gradients_keep_the_decoded_path():
    q, grad, invstd, weight = _codes(3, 4, (5,), "2", 32, 1)
    assert not reads_codes(grad.double(), q, invstd, weight)
    assert not reads_codes(grad, q, invstd, weight.half())
    g4 = torch.randn(3, 4, 5, 2)
    q4 = quantize(torch.randn(3, 4, 5, 2), 2, 32)
    assert not reads_codes(g4.contiguous(memory_format=torch.channels_last), q4, invstd, weight)
    # any other strides are read through a contiguous copy, as aten's backward would make
    odd = grad.transpose(0, 2).contiguous().transpose(0, 2)
    assert reads_codes(odd, q, invstd, weight) == (compiled() is not None)
    expanded = torch.ones(()).expand(grad.shape)
    got = batch_norm_backward_codes(expanded, q, invstd, weight)
    want = batch_norm_backward_codes(expanded.contiguous(), q, invstd, weight)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert isinstance(q, QuantizedTensor)


# ------------------------------------------------------------------------------ layer norm ----
def _ln_codes(n, t, f, widths, group, seed):
    shape = (n, t, f) if t else (n, f)
    g, q, grad = _payload(shape, widths, group, seed)
    rstd = torch.rand(shape[:-1] + (1,), generator=g) + 0.5
    weight = torch.rand(f, generator=g) + 0.5
    return q, grad, rstd, weight


def _ln_reference(grad, q, rstd, weight, need_input=True):
    f = grad.shape[-1]
    row_bits, offsets = q.row_layout()
    gi, gw, gb = reference.layer_norm_backward_codes(
        grad.reshape(-1, f), q.data, q.lo, q.step, row_bits, offsets, q.group_size,
        rstd.reshape(-1), weight, need_input)
    return (gi.view(grad.shape) if gi is not None else None), gw, gb


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), t=st.integers(0, 7), f=st.integers(1, 70),
       widths=st.sampled_from(["1", "2", "4", "8", "sample"]),
       group=st.sampled_from([8, 32, 64, 256]), seed=st.integers(0, 2 ** 31 - 1),
       affine=st.booleans(), need_input=st.booleans())
def test_layer_norm_kernel_matches_the_torch_formula(n, t, f, widths, group, seed, affine,
                                                     need_input):
    compiled_extension()
    q, grad, rstd, weight = _ln_codes(n, t, f, widths, group, seed)
    w = weight if affine else None
    assert reads_codes(grad, q, rstd, w, "layer_norm_backward_codes")
    gi, gw, gb = layer_norm_backward_codes(grad, q, rstd, f, w, need_input)
    ri, rw, rb = _ln_reference(grad, q, rstd, w, need_input)
    _close(gw, rw, "grad_weight")
    _close(gb, rb, "grad_bias")
    if need_input:
        assert gi.shape == grad.shape
        _close(gi, ri, "grad_input")
    else:
        assert gi is None


def test_layer_norm_formula_is_aten_layer_norm_backward():
    q, grad, rstd, weight = _ln_codes(4, 6, 24, "8", 64, 2)
    x_hat = dequantize(q).double()
    mean = torch.randn(4, 6, 1, dtype=torch.float64)
    x = x_hat / rstd.double() + mean
    gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
        grad.double(), x, [24], mean, rstd.double(), weight.double(), weight.double(),
        [True, True, True])
    ri, rw, rb = _ln_reference(grad.double(), q, rstd.double(), weight.double())
    assert torch.allclose(ri.double(), gi, atol=1e-5)
    assert torch.allclose(rw, gw.float(), atol=1e-5) and torch.allclose(rb, gb.float(), atol=1e-5)


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_layer_and_group_norm_same_bits_at_any_thread_count(norm):
    compiled_extension()
    if norm == "layer":
        q, grad, stat, weight = _ln_codes(5, 300, 40, "sample", 64, 8)  # several tasks
        run = lambda: layer_norm_backward_codes(grad, q, stat, 40, weight)  # noqa: E731
    else:
        q, grad, stat, weight = _gn_codes(6, 64, 32, (40, 40), "sample", 64, 3)  # 20 tasks
        run = lambda: group_norm_backward_codes(grad, q, stat, 32, weight)  # noqa: E731
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_layer_norm_bad_input_is_named():
    q, grad, rstd, weight = _ln_codes(3, 4, 10, "2", 32, 1)
    with pytest.raises(ValueError, match="shape"):
        layer_norm_backward_codes(grad[:2], q, rstd, 10, weight)
    with pytest.raises(ValueError, match="do not divide"):
        layer_norm_backward_codes(grad, q, rstd, 7, weight)
    with pytest.raises(ValueError, match="rstd has"):
        layer_norm_backward_codes(grad, q, rstd[:2], 10, weight)
    with pytest.raises(ValueError, match="weight has"):
        layer_norm_backward_codes(grad, q, rstd, 10, weight[:5])
    with pytest.raises(TypeError, match="QuantizedTensor"):
        layer_norm_backward_codes(grad, grad, rstd, 10, weight)
    ext = compiled_extension()
    g2 = grad.reshape(-1, 10)
    off = reference.uniform_offsets(3, 40, 2, grad.device)
    rb = torch.full((3,), 2, dtype=torch.uint8)
    with pytest.raises((RuntimeError, ValueError), match="not whole samples"):
        ext.layer_norm_backward_codes(g2[:11], q.data, q.lo, q.step, rb, off, 32,
                                      rstd.reshape(-1)[:11], weight, True)
    with pytest.raises((RuntimeError, ValueError), match="rstd must be"):
        ext.layer_norm_backward_codes(g2, q.data, q.lo, q.step, rb, off, 32, rstd.reshape(-1)[:5],
                                      weight, True)


@pytest.mark.parametrize("shape,normalized", [((4, 9, 32), (32,)), ((6, 20), (20,)),
                                              ((2, 3, 4, 10), (4, 10))])
@pytest.mark.parametrize("config", [{"bits": 2, "strategy": "uniform"}, None])
def test_qlayernorm_reads_the_codes(shape, normalized, config, monkeypatch):
    compiled_extension()
    torch.manual_seed(0)
    ln = nn.LayerNorm(normalized)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    model = convert_model(nn.Sequential(ln), config)
    x = torch.randn(shape) * 2 + 1
    g = torch.randn(shape)

    codes, n_codes = _layer_grads(model, x, g, "layer_norm_backward_codes", True, monkeypatch)
    decoded, n_decoded = _layer_grads(model, x, g, "layer_norm_backward_codes", False,
                                      monkeypatch)
    assert (n_codes, n_decoded) == (2, 0)
    for a, b in zip(codes, decoded):
        assert a.shape == b.shape
        _close(a, b, "gradient")


def test_layer_norm_over_the_batch_dimension_keeps_the_decoded_path(monkeypatch):
    """normalized_shape covering dim 0 (rows of codes are samples): not read from codes."""
    torch.manual_seed(0)
    ln = nn.LayerNorm([3, 10])
    model = convert_model(nn.Sequential(ln), {"bits": 8, "strategy": "uniform"})
    x = torch.randn(3, 10) * 2
    g = torch.randn(3, 10)
    got, calls = _layer_grads(model, x, g, "layer_norm_backward_codes", True, monkeypatch)
    assert calls == 0
    xx = x.clone().requires_grad_()
    nn.functional.layer_norm(xx, [3, 10], ln.weight, ln.bias).backward(g)
    assert torch.allclose(got[0], xx.grad, atol=0.05 * float(xx.grad.abs().max()))
    q, grad, rstd, weight = _ln_codes(3, 0, 10, "8", 32, 0)
    with pytest.raises(ValueError, match="do not tile"):
        layer_norm_backward_codes(grad, q, rstd.reshape(-1)[:1], 30, None)


# ------------------------------------------------------------------------------ group norm ----
def _gn_codes(n, c, groups, spatial, widths, group, seed):
    g, q, grad = _payload((n, c) + spatial, widths, group, seed)
    rstd = torch.rand(n, groups, generator=g) + 0.5
    weight = torch.rand(c, generator=g) + 0.5
    return q, grad, rstd, weight


def _gn_aten(grad, q, rstd, groups, weight):
    """aten's group-norm backward in float64 on x rebuilt from the decoded x_hat."""
    n, c = grad.shape[:2]
    hw = grad[0, 0].numel()
    x_hat = dequantize(q).double()
    mean = torch.randn(n, groups, dtype=torch.float64)
    per = (n, groups, -1)
    x = (x_hat.reshape(per) / rstd.double().reshape(n, groups, 1)
         + mean.reshape(n, groups, 1)).reshape(grad.shape)
    return torch.ops.aten.native_group_norm_backward(
        grad.double(), x, mean, rstd.double(), None if weight is None else weight.double(),
        n, c, hw, groups, [True, weight is not None, weight is not None])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), cg=st.integers(1, 4), groups=st.integers(1, 4),
       spatial=st.sampled_from([(), (1,), (5,), (3, 7), (2, 2, 3)]),
       widths=st.sampled_from(["1", "2", "4", "8", "sample"]),
       group=st.sampled_from([8, 32, 256]), seed=st.integers(0, 2 ** 31 - 1),
       affine=st.booleans(), need_input=st.booleans())
def test_group_norm_kernel_matches_aten(n, cg, groups, spatial, widths, group, seed, affine,
                                        need_input):
    """The kernel (or its torch twin without the extension) against aten's float64 group-norm
    backward on x rebuilt from the same decoded x_hat: float rounding only."""
    q, grad, rstd, weight = _gn_codes(n, cg * groups, groups, spatial, widths, group, seed)
    w = weight if affine else None
    gi, gw, gb = group_norm_backward_codes(grad, q, rstd, groups, w, need_input)
    ri, rw, rb = _gn_aten(grad, q, rstd, groups, w)
    if affine:
        _close(gw, rw.float(), "grad_weight")
        _close(gb, rb.float(), "grad_bias")
    else:
        assert gw.shape == gb.shape == (cg * groups,)  # per channel all the same
    if need_input:
        assert gi.shape == grad.shape
        _close(gi, ri.float(), "grad_input")
    else:
        assert gi is None


def test_group_norm_bad_input_is_named():
    q, grad, rstd, weight = _gn_codes(3, 6, 3, (4,), "2", 32, 1)
    with pytest.raises(ValueError, match="shape"):
        group_norm_backward_codes(grad[:2], q, rstd, 3, weight)
    with pytest.raises(ValueError, match="do not split into 4 groups"):
        group_norm_backward_codes(grad, q, rstd, 4, weight)
    with pytest.raises(ValueError, match="rstd has"):
        group_norm_backward_codes(grad, q, rstd[:2], 3, weight)
    with pytest.raises(ValueError, match="weight must have shape"):
        group_norm_backward_codes(grad, q, rstd, 3, weight[:5])
    with pytest.raises(TypeError, match="QuantizedTensor"):
        group_norm_backward_codes(grad, grad, rstd, 3, weight)
    ext = compiled_extension()
    off = reference.uniform_offsets(3, 24, 2, grad.device)
    rb = torch.full((3,), 2, dtype=torch.uint8)
    g3 = grad.reshape(3, 6, 4)
    with pytest.raises((RuntimeError, ValueError), match="do not split into 4 groups"):
        ext.group_norm_backward_codes(g3, q.data, q.lo, q.step, rb, off, 32, rstd.reshape(-1),
                                      weight, True, 4)
    with pytest.raises((RuntimeError, ValueError), match="rstd must be"):
        ext.group_norm_backward_codes(g3, q.data, q.lo, q.step, rb, off, 32,
                                      rstd.reshape(-1)[:8], weight, True, 3)
    with pytest.raises((RuntimeError, ValueError), match="weight must be"):
        ext.group_norm_backward_codes(g3, q.data, q.lo, q.step, rb, off, 32, rstd.reshape(-1),
                                      torch.ones(4), True, 3)
