"""QLinear's compiled autograd node (``_C.qlinear``, cpp_ext/qlinear.cpp) against its Python
Function: the same codes, hence bit-identical gradients, and the same guarantees (double
backward, retain_graph, autograd's in-place check, the capture store's accounting)."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional import linear as flinear
from actnn_zoo.nn import QLinear

pytestmark = pytest.mark.skipif(flinear._QLINEAR is None, reason="no compiled extension")


def _node(t: torch.Tensor) -> str:
    return t.grad_fn.name()


def _grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, transposed: bool):
    torch.manual_seed(3)  # the codes' seed
    xi = x.clone().requires_grad_(True)
    if transposed:  # GPT-2's Conv1D: the weight stored (in, out), passed as its transpose
        w = layer.weight_t.t()
        out = flinear.linear(xi, w, layer.bias, layer.qconfig, layer.qconfig.bits)
    else:
        out = layer(xi)
    out.backward(g)
    params = [layer.weight_t if transposed else layer.weight] + (
        [layer.bias] if layer.bias is not None else [])
    grads = [xi.grad] + [p.grad for p in params]
    for p in params:
        p.grad = None
    return out, grads


def _layer(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, bits: int,
           transposed: bool) -> QLinear:
    torch.manual_seed(0)
    layer = QLinear.from_float(nn.Linear(n_in, n_out, bias=bias, dtype=dtype),
                               LayerQConfig(bits=bits))
    layer.train()
    if transposed:
        layer.weight_t = nn.Parameter(layer.weight.detach().t().contiguous())
    return layer


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       n_in=st.integers(1, 70), n_out=st.integers(1, 9), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bits=st.sampled_from([1, 2, 8]),
       transposed=st.booleans())
def test_compiled_node_equals_the_python_function(lead, n_in, n_out, bias, dtype, bits,
                                                  transposed):
    layer = _layer(n_in, n_out, bias, dtype, bits, transposed)
    g0 = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, n_in, generator=g0).to(dtype)
    g = torch.randn(*lead, n_out, generator=g0).to(dtype)
    out, got = _grads(layer, x, g, transposed)
    assert "QLinearFunction" in _node(out)
    saved = flinear._QLINEAR
    try:
        flinear._QLINEAR = None  # the Python Function, same seed, same codes
        out2, want = _grads(layer, x, g, transposed)
    finally:
        flinear._QLINEAR = saved
    assert _node(out2) == "LinearFunctionBackward"
    assert torch.equal(out, out2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)


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
