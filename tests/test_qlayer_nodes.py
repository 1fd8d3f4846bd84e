"""The layers' compiled autograd nodes (``_C.qlinear`` / ``_C.qconv``, cpp_ext/qlayers.cpp)
against their Python Functions: the same codes, hence bit-identical outputs and gradients, and
the same guarantees (double backward, retain_graph, autograd's in-place check, the capture
store's accounting)."""
from __future__ import annotations

import contextlib
import math
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional import _saving
from actnn_zoo.functional import conv as fconv
from actnn_zoo.functional import linear as flinear
from actnn_zoo.nn import QConv2d, QLinear
from actnn_zoo.quant import SampleBits

from _graphs import grad_nodes

pytestmark = pytest.mark.skipif(flinear._QLINEAR is None, reason="no compiled extension")


def _node(t: torch.Tensor) -> str:
    return t.grad_fn.name()


def _widths(kind: str, n: int) -> object:
    """One width, or per-sample widths (1, 2, 4, 8 in turn) for ``n`` samples."""
    if kind == "mixed":
        w = torch.tensor([(1, 2, 4, 8)[i % 4] for i in range(n)], dtype=torch.uint8)
        return SampleBits(w, int(w.sum()))
    return int(kind)


def _compare(run, node: str, python: str, module, attr: str = "") -> torch.Tensor:
    """``run()`` -> (output, grads) with the compiled node (``module.<attr>``), then with the
    Python Function at the same seed: bit-identical. Returns the node's output."""
    attr = attr or ("_QLINEAR" if module is flinear else "_QCONV")
    torch.manual_seed(3)
    out, got = run()
    assert node in out.grad_fn.name(), out.grad_fn.name()
    saved = getattr(module, attr)
    try:
        setattr(module, attr, None)
        torch.manual_seed(3)
        out2, want = run()
    finally:
        setattr(module, attr, saved)
    assert out2.grad_fn.name() == python
    assert torch.equal(out, out2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    return out


def _train_both(model: nn.Module, x: torch.Tensor, module, attr: str, steps: int,
                monkeypatch, **convert) -> list:
    """``steps`` training steps of ``model`` converted with ``convert``, first with the
    compiled node, then with ``module.<attr>`` off (the Python Function), from the same seeds:
    [(grad node names, capture report, parameter gradients and buffers)] for each."""
    results = []
    for node in (True, False):
        q = az.convert_model(copy.deepcopy(model), **convert)
        if not node:
            monkeypatch.setattr(module, attr, None)
        for step in range(steps):
            q.zero_grad()
            torch.manual_seed(7 + step)
            out = q(x)
            out.square().sum().backward()
        monkeypatch.undo()
        results.append((grad_nodes(out), str(az.capture_report(q)),
                        [p.grad for p in q.parameters()] + list(q.buffers())))
    assert results[0][1] == results[1][1]
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b)
    return results


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       n_in=st.integers(1, 70), n_out=st.integers(1, 9), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bits=st.sampled_from(["1", "2", "8", "mixed"]), transposed=st.booleans())
def test_linear_node_equals_the_python_function(lead, n_in, n_out, bias, dtype, bits,
                                                transposed):
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    # GPT-2's Conv1D: the weight stored (in, out), passed as its transpose
    weight = nn.Parameter(layer.weight.detach().t().contiguous()) if transposed else layer.weight
    g0 = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, n_in, generator=g0).to(dtype)
    g = torch.randn(*lead, n_out, generator=g0).to(dtype)
    if bits == "mixed" and x.dim() < 2:
        bits = "2"  # per-sample widths need a batch dim
    widths = _widths(bits, x.shape[0] if x.dim() > 1 else 1)
    params = [weight] + ([layer.bias] if bias else [])

    def run():
        xi = x.clone().requires_grad_(True)
        w = weight.t() if transposed else weight
        out = flinear.linear(xi, w, layer.bias, LayerQConfig(bits=2), widths)
        out.backward(g)
        grads = [xi.grad] + [p.grad for p in params]
        for p in params:
            p.grad = None
        return out, grads

    _compare(run, "QLinearFunction", "LinearFunctionBackward", flinear)


@settings(max_examples=40, deadline=None)
@given(dims=st.sampled_from([1, 2, 3]), batch=st.integers(1, 3), c_in=st.integers(1, 4),
       c_out=st.integers(1, 4), kernel=st.integers(1, 3), stride=st.integers(1, 2),
       padding=st.integers(0, 2), dilation=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       bias=st.booleans(), channels_last=st.booleans(),
       bits=st.sampled_from(["2", "4", "mixed"]), large=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_conv_node_equals_the_python_function(dims, batch, c_in, c_out, kernel, stride, padding,
                                              dilation, groups, bias, channels_last, bits,
                                              large, dtype):
    c_in, c_out = c_in * groups, c_out * groups
    size = (dilation * (kernel - 1) + 1) + stride + 1
    torch.manual_seed(0)
    layer = getattr(nn, f"Conv{dims}d")(c_in, c_out, kernel, stride, padding, dilation, groups,
                                        bias, dtype=dtype)
    g0 = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c_in, *([size] * dims), generator=g0).to(dtype)
    if channels_last and dims == 2:
        x = x.contiguous(memory_format=torch.channels_last)
    spec = fconv.ConvSpec(dims, (stride,) * dims, (padding,) * dims, (dilation,) * dims, groups)
    widths = _widths(bits, batch)
    params = [layer.weight] + ([layer.bias] if bias else [])
    g = torch.randn(layer(x).shape, generator=g0).to(dtype)

    def run():
        xi = x.clone().requires_grad_(True)  # (clone keeps the memory format)
        out = fconv.conv(xi, layer.weight, layer.bias, spec, LayerQConfig(bits=2), widths)
        out.backward(g)
        grads = [xi.grad] + [p.grad for p in params]
        for p in params:
            p.grad = None
        return out, grads

    # ``large``: the weight gradient first, the input gradient as the adjoint convolution
    saved = _saving.CHUNK_MIN_BYTES
    try:
        _saving.CHUNK_MIN_BYTES = 1 if large else saved
        _compare(run, "QConvFunction", "ConvFunctionBackward", fconv)
    finally:
        _saving.CHUNK_MIN_BYTES = saved


def _layer(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, bits: int,
           transposed: bool = False) -> QLinear:
    torch.manual_seed(0)
    layer = QLinear.from_float(nn.Linear(n_in, n_out, bias=bias, dtype=dtype),
                               LayerQConfig(bits=bits))
    return layer.train()


def test_other_cases_keep_the_python_function():
    layer = _layer(8, 4, True, torch.float32, 2, False)
    x = torch.randn(3, 8, requires_grad=True)
    assert "QLinearFunction" in _node(layer(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _node(layer(x)) == "LinearFunctionBackward"
    wide = _layer(8, 4, True, torch.float64, 2, False)  # float64: codes of a float32 copy
    assert _node(wide(x.double())) == "LinearFunctionBackward"
    layer.weight.requires_grad_(False)  # nothing to save
    assert _node(layer(x)) == "LinearFunctionBackward"
    layer.weight.requires_grad_(True)
    layer.qconfig = LayerQConfig(bits=2, transform="hadamard")
    assert _node(layer(x)) == "LinearFunctionBackward"

    x = torch.randn(2, 2, 6, 6, requires_grad=True)
    for conv, node in ((nn.Conv2d(2, 2, 3), "QConvFunction"),
                       (nn.Conv2d(2, 2, 3, padding="same"), "ConvFunctionBackward"),
                       (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
                        "ConvFunctionBackward"),
                       (nn.ConvTranspose2d(2, 2, 3), "ConvFunctionBackward")):
        q = az.convert_model(nn.Sequential(conv), bits=2, strategy="uniform", capture=False)
        assert node in _node(q(x)), (conv, _node(q(x)))


def test_double_backward_input_gradient_exact_weight_gradient_raises():
    layer = _layer(6, 5, True, torch.float32, 8, False)
    ref = nn.Linear(6, 5)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(4, 6, requires_grad=True)
    out = layer(x)
    assert "QLinearFunction" in _node(out)
    v = torch.randn(4, 5)  # a gradient penalty's upstream gradient: constant
    (gx,) = torch.autograd.grad((out * v).sum(), x, create_graph=True)
    xr = x.detach().requires_grad_(True)
    (gxr,) = torch.autograd.grad((ref(xr) * v).sum(), xr, create_graph=True)
    torch.testing.assert_close(gx, gxr)
    gx.square().sum().backward()  # d/dW of the input gradient: exact, no saved input needed
    gxr.square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)

    out = layer(x)
    gw = torch.autograd.grad(out.square().sum(), layer.weight, create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="double backward"):
        gw.sum().backward()


def test_retain_graph_and_the_in_place_check():
    layer = _layer(6, 5, True, torch.float32, 2, False)
    x = torch.randn(4, 6, requires_grad=True)
    out = layer(x).sum()
    out.backward(retain_graph=True)
    first = layer.weight.grad.clone()
    out.backward()  # the codes are read again
    torch.testing.assert_close(layer.weight.grad, 2 * first)

    out = layer(x).sum()
    with torch.no_grad():
        layer.weight.add_(1.0)  # changed after it was saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_capture_counts_and_compresses_the_same():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64))
    x = torch.randn(16, 64)
    reports = []
    for fused in (True, False):
        q = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
        saved = flinear._QLINEAR
        try:
            if not fused:
                flinear._QLINEAR = None
            torch.manual_seed(5)
            q(x).sum().backward()
        finally:
            flinear._QLINEAR = saved
        reports.append((str(az.capture_report(q)), [p.grad.clone() for p in q.parameters()]))
    assert reports[0][0] == reports[1][0]
    for a, b in zip(reports[0][1], reports[1][1]):
        assert torch.equal(a, b)


def test_sparse_relu_codes_go_through_the_node(monkeypatch):
    """With capture on, a conv after a ReLU saves the ReLU output's sparse codes (shared with
    the ReLU, ``relu_codes``): the compiled node decodes them as the Python Function does."""
    kinds = []
    real = fconv.node_codes

    def spy(q, weight):
        kinds.append(type(q).__name__)
        return real(q, weight)

    monkeypatch.setattr(fconv, "node_codes", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4))
    x = torch.randn(4, 3, 6, 6)
    results = []
    for fused in (True, False):
        q = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
        saved = (fconv._QCONV, flinear._QLINEAR)
        try:
            if not fused:
                fconv._QCONV = flinear._QLINEAR = None
            for step in range(3):  # the first forward offers the ReLU outputs, later ones share
                q.zero_grad()
                torch.manual_seed(7 + step)
                out = q(x)
                out.square().sum().backward()
        finally:
            fconv._QCONV, flinear._QLINEAR = saved
        nodes = grad_nodes(out)
        results.append((nodes, str(az.capture_report(q)), [p.grad for p in q.parameters()]))
    assert {"QConvFunction", "QLinearFunction"} <= results[0][0], results[0][0]
    assert "ConvFunctionBackward" in results[1][0]
    assert kinds[-1] == "SparseQuantizedTensor", kinds  # the last step's second conv
    assert results[0][1] == results[1][1]
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       p=st.sampled_from([0.1, 0.5, 0.9]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_dropout_node_equals_the_python_function(shape, p, dtype):
    from actnn_zoo.functional import dropout as fdrop

    g0 = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g0).to(dtype)
    g = torch.randn(shape, generator=g0).to(dtype)

    def run():
        torch.manual_seed(3)
        xi = x.clone().requires_grad_(True)
        out = fdrop.dropout(xi, p)
        out.backward(g)
        return out, [xi.grad]

    torch.manual_seed(3)
    ref = torch.nn.functional.dropout(x, p, True)  # torch's own draw: the same noise
    out = _compare(run, "QDropoutFunction", "DropoutFunctionBackward", fdrop, "_QDROPOUT")
    assert torch.equal(out, ref)


def test_dropout_node_double_backward_and_other_cases():
    from actnn_zoo.functional import dropout as fdrop

    x = torch.randn(4, 6, requires_grad=True)
    torch.manual_seed(0)
    out = fdrop.dropout(x, 0.3)
    assert "QDropoutFunction" in out.grad_fn.name()
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    (gxx,) = torch.autograd.grad(gx.sum(), x)  # d/dx sum(2 * out * keep / (1 - p))
    keep = (out != 0).to(x.dtype) / 0.7
    torch.testing.assert_close(gxx, 2 * keep * keep)
    # in place, channels_last and feature dropout keep the Python Function
    assert fdrop.dropout(x.clone(), 0.3, inplace=True).grad_fn.name() == "DropoutFunctionBackward"
    y = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert fdrop.dropout(y, 0.3).grad_fn.name() == "DropoutFunctionBackward"
    assert fdrop.dropout2d(y, 0.3).grad_fn.name() == "DropoutFunctionBackward"


# -- smooth activations: ``_C.qderivative`` ----------------------------------------------------
_ACT_OPS = {"gelu": ("none",), "gelu-tanh": ("tanh",), "silu": (), "elu": (0.7,),
            "softplus": (2.0, 5.0), "hardswish": (), "hardsigmoid": (), "mish": ()}


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(sorted(_ACT_OPS)), shape=st.lists(st.integers(1, 9), min_size=1,
                                                             max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       bits=st.sampled_from(["1", "2", "8", "mixed"]), handed=st.booleans())
def test_activation_node_equals_the_python_function(op, shape, dtype, bits, handed):
    from actnn_zoo.functional import activation as fact

    name, params = op.split("-")[0], _ACT_OPS[op]
    g0 = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g0) * 3).to(dtype)
    g = torch.randn(shape, generator=g0).to(dtype)
    if bits == "mixed" and x.dim() < 2:
        bits = "2"
    widths = _widths(bits, x.shape[0] if x.dim() > 1 else 1)

    def run():
        torch.manual_seed(3)
        xi = x.clone().requires_grad_(True)
        # a strategy's hand-off: f'(x) made from this x already
        d = fact.activation_derivative(name, x, None, params) if handed else None
        out = fact._deriv_apply(name, xi, params, LayerQConfig(bits=2), widths, False, d)
        out.backward(g)
        return out, [xi.grad]

    _compare(run, "QDerivativeFunction", "DerivativeActivationFunctionBackward", fact,
             "_QDERIVATIVE")


def test_activation_node_with_the_strategys_derivative_and_capture(monkeypatch):
    """The default strategy at a budget that is no width hands its f'(x) to the layer: the node
    takes it, and gradients and the capture report equal the Python Function's."""
    from actnn_zoo.functional import activation as fact

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8), nn.SiLU())
    x = torch.randn(8, 16) * torch.linspace(0.1, 4, 8)[:, None]
    results = _train_both(model, x, fact, "_QDERIVATIVE", 3, monkeypatch, bits=2.5,
                          strategy="actnn")
    assert "QDerivativeFunction" in results[0][0]
    assert "DerivativeActivationFunctionBackward" in results[1][0]


def test_activation_node_under_capture_at_one_width(monkeypatch):
    """Inside a capture session at one width the node quantizes f'(x) directly, past the
    store (``_saving.compress_fresh``: a tensor just made, which no other save can share),
    with the stream's seed in the Function's order: gradients, buffers and the capture
    report equal the Python Function's, which goes through the store."""
    from actnn_zoo.functional import activation as fact

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32),
                          nn.GELU(approximate="tanh"), nn.Linear(32, 8), nn.SiLU())
    x = torch.randn(8, 16)
    results = _train_both(model, x, fact, "_QDERIVATIVE", 3, monkeypatch, bits=2,
                          strategy="uniform")
    assert "QDerivativeFunction" in results[0][0]
    assert "DerivativeActivationFunctionBackward" not in results[0][0]
    assert "DerivativeActivationFunctionBackward" in results[1][0]


def test_activation_node_other_cases_and_double_backward(monkeypatch):
    from actnn_zoo.functional import activation as fact

    qc = LayerQConfig(bits=2)
    x = torch.randn(4, 6, requires_grad=True)
    out = fact.gelu(x, qconfig=qc)
    assert "QDerivativeFunction" in out.grad_fn.name()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    python = "DerivativeActivationFunctionBackward"
    # in place, an op that reads its output, channels_last, float64, autocast, a rotation
    assert fact.silu(x.clone(), inplace=True, qconfig=qc).grad_fn.name() == python
    assert fact.sigmoid(x, qconfig=qc).grad_fn.name() == python
    y = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert fact.gelu(y, qconfig=qc).grad_fn.name() == python
    assert fact.gelu(x.double(), qconfig=qc).grad_fn.name() == python
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fact.gelu(x, qconfig=qc).grad_fn.name() == python
    assert fact.gelu(x, qconfig=LayerQConfig(bits=2, transform="hadamard")).grad_fn.name() \
        == python
    # f'(x) made in chunks (a large map), or decoded in chunks in backward
    monkeypatch.setattr(_saving, "PRODUCE_CHUNK_BYTES", 32)
    assert fact.gelu(x, qconfig=qc).grad_fn.name() == python
    monkeypatch.undo()
    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 32)
    assert fact.gelu(x, qconfig=LayerQConfig(bits=2, backward_chunks=2)).grad_fn.name() == python


# -- mask activations: ``_C.qmask`` ------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(["relu", "leaky_relu", "leaky_relu_0", "leaky_relu_neg", "hardtanh",
                           "relu6"]),
       shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       inplace=st.booleans())
def test_mask_node_equals_the_python_function(op, shape, dtype, inplace):
    from actnn_zoo.functional import activation as fact

    g0 = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g0) * 8).to(dtype)
    x.view(-1)[0] = 0.0  # the predicates' edge
    g = torch.randn(shape, generator=g0).to(dtype)
    call = {"relu": lambda t: fact.relu(t, inplace),
            "leaky_relu": lambda t: fact.leaky_relu(t, 0.2, inplace),
            "leaky_relu_0": lambda t: fact.leaky_relu(t, 0.0, inplace),
            "leaky_relu_neg": lambda t: fact.leaky_relu(t, -0.5, inplace),
            "hardtanh": lambda t: fact.hardtanh(t, -1.3, 2.7, inplace),
            "relu6": lambda t: fact.relu6(t, inplace)}[op]

    def run():
        leaf = x.clone().requires_grad_(True)
        out = call(leaf * 1.0)  # a non-leaf: in place is allowed on it
        gv = g.clone().requires_grad_(True)
        # create_graph: differentiable in the incoming gradient (d/dg sum(grad_in) = slopes)
        (gx,) = torch.autograd.grad(out, leaf, gv, create_graph=True)
        (gg,) = torch.autograd.grad(gx.sum(), gv)
        (plain,) = torch.autograd.grad(call(leaf * 1.0), leaf, g)
        return out.detach(), gx.detach(), gg, plain

    got = run()
    saved = fact._QMASK
    try:
        fact._QMASK = None
        want = run()
    finally:
        fact._QMASK = saved
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_mask_node_is_taken_where_no_codes_are_shared():
    from actnn_zoo.functional import activation as fact

    x = torch.randn(4, 6, requires_grad=True)
    assert "QMaskFunction" in fact.relu(x * 1.0).grad_fn.name()
    assert "QMaskFunction" in fact.leaky_relu(x * 1.0, 0.1, inplace=True).grad_fn.name()
    y = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert fact.relu(y * 1.0).grad_fn.name() == "MaskActivationFunctionBackward"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(2, 3, 8, 8)
    # without capture, the ReLU's mask through the node; with capture its codes are the next
    # conv's (ZeroCodeSlot), and the node saves the buffer those codes' mask is written into
    plain = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform", capture=False)
    assert "QMaskFunction" in grad_nodes(plain(x))
    shared = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
    for _ in range(2):
        out = shared(x)
    assert "QMaskFunction" in grad_nodes(out)
    assert "MaskActivationFunctionBackward" not in grad_nodes(out)
    assert shared[1]._zero_codes.enabled  # the claim was answered by the conv's sparse codes
    out.sum().backward()


def test_linear_node_raises_torchs_error_for_a_wrong_width():
    """An input that does not fit the weight raises what nn.Linear raises (a RuntimeError
    with torch's message), not a ValueError of the node's own: code that catches torch's
    error keeps working after conversion."""
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    q = az.convert_model(copy.deepcopy(ref), bits=2, strategy="uniform")
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError) as want:
        ref(x)
    with pytest.raises(RuntimeError) as got:
        q(x)
    assert str(got.value) == str(want.value)


class _ReluConsumers(nn.Module):
    """Convs around ReLUs whose outputs go to a conv (sparse codes shared), to a max-pool
    (nothing compresses them), to a conv and a max-pool in turn (r1: a claim made after a
    conv consumed the output, answered by nobody in the next forward, whose mask is then
    packed into the node's buffer at the end of the forward) and, in place, to a conv again;
    every ReLU is a module (a ZeroCodeSlot each)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.c0, self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3), \
            nn.Conv2d(8, 4, 1)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.r0, self.r1, self.r2, self.r3 = nn.ReLU(), nn.ReLU(inplace), nn.ReLU(inplace), \
            nn.ReLU()
        self.bn = nn.BatchNorm2d(8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.c1(self.r0(self.c0(x)))
        h = self.r1(self.bn(h))
        h = self.c3(h) if self.calls % 2 else F.max_pool2d(h, 2)
        h = F.max_pool2d(self.r3(h), 1)
        return self.c2(self.r2(h * 1.0))


@pytest.mark.parametrize("inplace,dtype,convert", [
    (False, torch.float32, {"bits": 2, "strategy": "uniform"}),
    (True, torch.float32, {"bits": 2, "strategy": "uniform"}),
    (False, torch.float64, {"bits": 2, "strategy": "uniform"}),
    (True, torch.float64, {"bits": 2, "strategy": "uniform"}),
    (True, torch.float32, {}),  # the default: the consumers' per-sample widths (actnn)
])
def test_claim_node_equals_the_python_function(inplace, dtype, convert, monkeypatch):
    """ReLUs inside a capture session as the compiled node (activation._claim_node) against
    the Python Function, over steps that learn the slots (a mask and an offer first, then a
    claim): gradients, buffers and the capture report equal; the shared codes are the
    consumer's sparse codes, whose mask buffer the node reads in backward."""
    from actnn_zoo.functional import activation as fact

    torch.manual_seed(0)
    model = _ReluConsumers(inplace).to(dtype)
    x = torch.randn(2, 3, 9, 9, dtype=dtype)
    seen = {"fall_back": 0}
    fall_back = fact._HeldClaim.fall_back

    def counted(self):
        seen["fall_back"] += self.out is not None
        fall_back(self)
    monkeypatch.setattr(fact._HeldClaim, "fall_back", counted)
    node, python = _train_both(model, x, fact, "_QCLAIM", 5, monkeypatch, **convert)
    assert seen["fall_back"] >= 1  # r1's claim, answered by nobody, packed its mask
    assert "QMaskFunction" in node[0] and "MaskActivationFunctionBackward" not in node[0]
    assert "MaskActivationFunctionBackward" in python[0]
    converted = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
    for _ in range(2):
        converted(x).sum().backward()
    # r0 and r2 feed convs (their codes are shared), r3 a max-pool (its own mask)
    assert [r._zero_codes.enabled for r in (converted.r0, converted.r3, converted.r2)] == \
        [True, False, True]


def test_claim_node_leaves_the_claim_to_the_function_under_outer_hooks():
    """Under the user's own saved-tensor hooks (which may copy what they are given, as
    save_on_cpu does) the node's buffer, filled after the forward, could be copied empty: the
    claim then stays with the Python Function, and the gradients equal those without hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(2, 3, 8, 8)
    grads, nodes = [], []
    for hooks in (False, True):
        q = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
        for step in range(2):
            q.zero_grad()
            torch.manual_seed(3 + step)
            if hooks:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                    out = q(x)
            else:
                out = q(x)
            out.square().sum().backward()
        grads.append([p.grad for p in q.parameters()])
        nodes.append(grad_nodes(out))
    assert "MaskActivationFunctionBackward" not in nodes[0]
    assert "MaskActivationFunctionBackward" in nodes[1]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_claim_node_retains_the_graph_and_raises_on_a_changed_output():
    """The node's buffer is read again by a second backward (retain_graph); an output changed
    in place after the ReLU, before anything saved it, leaves the flag unset and its backward
    raises as the Function's does."""
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)),
                             bits=2, strategy="uniform")
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()  # the slot learns that the conv compresses the output
    model.zero_grad()
    out = model(x)
    assert "QMaskFunction" in grad_nodes(out)
    out.sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out.sum().backward()
    for a, p in zip(first, model.parameters()):
        assert torch.equal(a, p.grad)

    class ChangedAfterRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c0, self.relu, self.c1 = nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)
            self.change = False

        def forward(self, t):
            h = self.relu(self.c0(t))
            if self.change:
                h.mul_(2.0)  # after the ReLU, before the conv saves it
            return self.c1(h)

    changed = az.convert_model(ChangedAfterRelu(), bits=2, strategy="uniform")
    changed(x).sum().backward()
    changed.change = True
    out = changed(x)
    assert "QMaskFunction" in grad_nodes(out)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the ReLU"):
        out.sum().backward()


# -- attention: ``_C.qattention`` --------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), L=st.integers(1, 12), S=st.integers(1, 12),
       e=st.integers(1, 9), ev=st.integers(1, 9), causal=st.booleans(),
       dropout=st.sampled_from([0.0, 0.3]), transposed=st.booleans(),
       bits=st.sampled_from([2, 4, 8]),
       grads=st.sampled_from([(True, True, True), (True, False, False), (False, True, False),
                              (False, False, True), (False, True, True)]))
def test_attention_node_equals_the_python_function(b, h, L, S, e, ev, causal, dropout,
                                                   transposed, bits, grads):
    from actnn_zoo.functional import attention as fattn

    if causal:
        S = min(S, L)  # a causal call holds every key in its one tile only then
    g0 = torch.Generator().manual_seed(1)
    if transposed:  # (B, L, H, E) transposed, as transformers pass q: its rows are a copy
        q = torch.randn(b, L, h, e, generator=g0).transpose(1, 2)
    else:
        q = torch.randn(b, h, L, e, generator=g0)
    k, v = torch.randn(b, h, S, e, generator=g0), torch.randn(b, h, S, ev, generator=g0)
    g = torch.randn(b, h, L, ev, generator=g0)

    def run():
        qi, ki, vi = (t.clone().requires_grad_(r) for t, r in zip((q, k, v), grads))
        out = fattn.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout,
                                                 is_causal=causal,
                                                 qconfig=LayerQConfig(bits=bits))
        out.backward(g)
        return out, [t.grad for t in (qi, ki, vi) if t.requires_grad]

    _compare(run, "QAttentionFunction", "ScaledDotProductAttentionFunctionBackward", fattn,
             "_QATTENTION")


def test_attention_node_in_a_model_with_capture(monkeypatch):
    """GPT-2's pattern (q, k, v split from one projection, heads transposed, causal, dropout),
    converted: the node's gradients and capture report equal the Python Function's, and it
    saves only codes (the store keeps them, tier 3 adds nothing)."""
    from actnn_zoo.functional import attention as fattn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.out = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, -1))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1,
                                                                 is_causal=True)
            return self.out(o.transpose(1, 2).reshape(2, 16, 32))

    torch.manual_seed(0)
    results = _train_both(Attention(), torch.randn(2, 16, 32), fattn, "_QATTENTION", 2,
                          monkeypatch, bits=2, strategy="uniform")
    assert "QAttentionFunction" in results[0][0]
    assert "ScaledDotProductAttentionFunctionBackward" in results[1][0]
    assert "scaled_dot_product_attention" in results[0][1]


@pytest.mark.parametrize("case", ["mask", "float64", "bfloat16", "broadcast", "tiles",
                                  "causal S > L", "autocast", "hadamard", "division"])
def test_attention_node_other_cases_keep_the_python_function(case, monkeypatch):
    from actnn_zoo.functional import attention as fattn

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    mask, kw, qc = None, {}, LayerQConfig(bits=4)
    context = contextlib.nullcontext()
    if case == "mask":
        mask = torch.randn(6, 6, generator=g)
    elif case in ("float64", "bfloat16"):
        q, k, v = (t.to(getattr(torch, case)) for t in (q, k, v))
    elif case == "broadcast":
        k, v = k[:1], v[:1]
    elif case == "tiles":
        monkeypatch.setattr(fattn, "BLOCK_ELEMENTS", 12)
    elif case == "causal S > L":
        q, kw = q[:, :, :3], {"is_causal": True}
    elif case == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "hadamard":
        qc = LayerQConfig(bits=4, group_size=32, transform="hadamard")
    else:
        qc = LayerQConfig(bits=4, compressor="division")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with context:
        out = fattn.scaled_dot_product_attention(q, k, v, mask, qconfig=qc, **kw)
    assert out.grad_fn.name() == "ScaledDotProductAttentionFunctionBackward"


def test_attention_node_double_backward_retain_graph_and_arguments():
    from actnn_zoo.functional import attention as fattn

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, 4, generator=g).requires_grad_() for _ in range(3))
    out = fattn.scaled_dot_product_attention(q, k, v, qconfig=LayerQConfig(bits=8))
    assert "QAttentionFunction" in out.grad_fn.name()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    loss = fattn.scaled_dot_product_attention(q, k, v, qconfig=LayerQConfig(bits=8)).sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (q, k, v)]
    loss.backward()  # the codes are read again
    for t, f in zip((q, k, v), first):
        torch.testing.assert_close(t.grad, 2 * f)

    x = q.detach()
    data, lo, step = fattn.extension().quantize_uniform(x, 8, 256, 1, True)
    codes = [data, lo, step, None, None, None]
    with pytest.raises(ValueError, match="six entries each"):
        fattn._QATTENTION(q, k, v, x, x, x, (2, 5, 4), 0.5, False, -1, 0, 0, 1.0, codes, [8],
                          256)
    with pytest.raises(ValueError, match="lacks its data"):
        fattn._QATTENTION(q, k, v, x, x, x, (2, 5, 4), 0.5, False, -1, 0, 0, 1.0,
                          codes + [data, None, step, None, None, None], [8, 8], 256)
    with pytest.raises(ValueError, match="as \\(N, rows, features\\)"):
        fattn._QATTENTION(q, k, v, x[:1], x, x, (2, 5, 4), 0.5, False, -1, 0, 0, 1.0,
                          codes * 2, [8, 8], 256)


# -- norms: ``_C.qnorm`` -----------------------------------------------------------------------
def _norm_call(kind: str, x, w, b, stats, qc, bits):
    from actnn_zoo.functional import norm as fnorm

    if kind == "batch":
        return fnorm.batch_norm_train(x, w, b, *stats, 0.1, 1e-5, qc, bits)
    if kind == "layer":
        return fnorm.layer_norm_train(x, x.shape[-2:] if x.dim() > 3 else x.shape[-1:], w, b,
                                      1e-5, qc, bits)
    return fnorm.group_norm_train(x, 2, w, b, 1e-5, qc, bits)


_NORM_FUNCTIONS = {"batch": "BatchNormFunctionBackward", "layer": "LayerNormFunctionBackward",
                   "group": "GroupNormFunctionBackward"}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["batch", "layer", "group"]), n=st.integers(1, 4),
       c=st.sampled_from([2, 4, 6]), spatial=st.lists(st.integers(1, 5), min_size=0, max_size=2),
       affine=st.sampled_from(["both", "weight", "none"]), bits=st.sampled_from([1, 2, 4, 8]),
       rounding=st.sampled_from(["stochastic", "nearest"]),
       grads=st.sampled_from(["all", "input", "params"]))
def test_norm_node_equals_the_python_function(kind, n, c, spatial, affine, bits, rounding,
                                              grads):
    from actnn_zoo.functional import norm as fnorm

    if kind == "batch" and n * math.prod(spatial) < 2:
        n = 2  # a batch norm needs more than one value per channel
    if grads == "params" and affine == "none":
        affine = "weight"
    g0 = torch.Generator().manual_seed(1)
    x = torch.randn(n, c, *spatial, generator=g0) * 3 + 1
    feat = list(x.shape[-2:]) if kind == "layer" and x.dim() > 3 else [x.shape[-1]]
    pshape = feat if kind == "layer" else [c]
    w = torch.randn(pshape, generator=g0) if affine != "none" else None
    b = torch.randn(pshape, generator=g0) if affine == "both" else None
    g = torch.randn(x.shape, generator=g0)
    qc = LayerQConfig(bits=bits, rounding=rounding)

    def run():
        xi = x.clone().requires_grad_(grads != "params")
        wi = w.clone().requires_grad_(grads != "input") if w is not None else None
        bi = b.clone().requires_grad_(grads != "input") if b is not None else None
        stats = (torch.zeros(c), torch.ones(c)) if kind == "batch" else ()
        out = _norm_call(kind, xi, wi, bi, stats, qc, bits)
        out.backward(g)
        leaves = [t for t in (xi, wi, bi) if t is not None and t.requires_grad]
        return out, [t.grad for t in leaves] + list(stats)

    _compare(run, "QNormFunction", _NORM_FUNCTIONS[kind], fnorm, "_QNORM")


def test_norm_node_in_a_model_with_capture_and_an_in_place_relu(monkeypatch):
    """A ResNet block (conv, batch norm, in-place ReLU) and a layer norm, converted: the nodes'
    gradients, running statistics and capture report equal the Python Functions'; the ReLU
    modifies the node's output in place (its own output, not a view of an input)."""
    from actnn_zoo.functional import norm as fnorm

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.gn(self.relu(self.bn(self.conv(x))))
            return self.ln(h.permute(0, 2, 3, 1).contiguous())

    torch.manual_seed(0)
    results = _train_both(Block(), torch.randn(2, 3, 6, 6), fnorm, "_QNORM", 2, monkeypatch,
                          bits=2, strategy="uniform")
    functions = {"BatchNormFunctionBackward", "LayerNormFunctionBackward",
                 "GroupNormFunctionBackward"}
    assert any("QNormFunction" in name for name in results[0][0])
    assert not functions & results[0][0] and functions <= results[1][0]


@pytest.mark.parametrize("case", ["channels_last", "float64", "autocast", "hadamard",
                                  "division", "per-sample", "bias only", "no grad"])
def test_norm_node_other_cases_keep_the_python_function(case):
    from actnn_zoo.functional import norm as fnorm

    x = torch.randn(2, 4, 3, 3)
    w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    qc, bits = LayerQConfig(bits=2), 2
    context = contextlib.nullcontext()
    if case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "float64":
        x, w, b = x.double(), w.detach().double().requires_grad_(), b.detach().double()
    elif case == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "hadamard":
        qc = LayerQConfig(bits=2, group_size=32, transform="hadamard")
    elif case == "division":
        qc = LayerQConfig(bits=2, compressor="division")
    elif case == "per-sample":
        bits = _widths("mixed", 2)
    elif case == "bias only":
        w = w.detach()
    x.requires_grad_(case not in ("bias only", "no grad"))
    if case == "no grad":
        context = torch.no_grad()
    with context:
        for kind in ("batch", "group"):
            out = _norm_call(kind, x, w, b, (None, None) if kind == "batch" else (), qc, bits)
            name = out.grad_fn.name() if out.grad_fn is not None else None
            assert name == (None if case == "no grad" else _NORM_FUNCTIONS[kind]), (kind, name)


def test_norm_node_double_backward_retain_graph_and_arguments():
    from actnn_zoo.functional import norm as fnorm

    x = torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    qc = LayerQConfig(bits=8)
    out = fnorm.layer_norm_train(x, [6], w, b, 1e-5, qc, 8)
    assert "QNormFunction" in out.grad_fn.name()
    with pytest.raises(NotImplementedError, match=r"double backward.*QLayerNorm"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    loss = fnorm.layer_norm_train(x, [6], w, b, 1e-5, qc, 8).square().sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (x, w, b)]
    loss.backward()  # the codes are read again
    for t, f in zip((x, w, b), first):
        torch.testing.assert_close(t.grad, 2 * f)

    made = list(fnorm._LN_FORWARD(x.detach(), [6], None, None, 1e-5, 8, 256, 1, True, 0))[:6]
    with pytest.raises(ValueError, match="made must be"):
        fnorm._QNORM(x, None, None, made[:5], 1, 6, 8, 256, 0, 0, False, "ln")
    with pytest.raises(ValueError, match="kind must be"):
        fnorm._QNORM(x, None, None, made, 3, 6, 8, 256, 0, 0, False, "ln")
    with pytest.raises(ValueError, match="outside autograd"):
        fnorm._QNORM(x, None, None, [made[0][:2]] + made[1:], 1, 6, 8, 256, 0, 0, False, "ln")
