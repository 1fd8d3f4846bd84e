"""The norms' fused CPU paths (``_C.batch_norm_forward_codes``, ``layer_norm_forward_codes``,
``group_norm_forward_codes`` and their backwards, cpp_ext/norm_cpu.cpp) against the Python
path they replace: the same draws, the same kernels, hence bit-identical outputs, gradients
and running statistics; and the cases that keep the Python path."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.functional import norm as fnorm

pytestmark = pytest.mark.skipif(None in (fnorm._BN_FORWARD, fnorm._LN_FORWARD,
                                        fnorm._GN_FORWARD), reason="no compiled extension")
FORWARDS = ("_BN_FORWARD", "_LN_FORWARD", "_GN_FORWARD")


class _Spy:
    """Counts the calls of ``fnorm.<name>`` while entered."""

    def __init__(self, mp: pytest.MonkeyPatch, *names: str) -> None:
        self.calls = {n: 0 for n in names}
        for n in names:
            fn = getattr(fnorm, n)

            def counted(*args, _fn=fn, _n=n):
                self.calls[_n] += 1
                return _fn(*args)
            mp.setattr(fnorm, n, counted)


def _train(layer: nn.Module, x: torch.Tensor, steps: int = 2, **convert) -> list:
    """Two training steps of the converted ``layer`` on ``x``: outputs, gradients, buffers."""
    model = az.convert_model(nn.Sequential(layer), **{"strategy": "uniform", **convert})
    out = []
    g0 = torch.Generator().manual_seed(7)
    for _ in range(steps):
        y = model(x)
        y.backward(torch.randn(y.shape, generator=g0))
        out.append(y.detach().clone())
        for t in [x] + list(layer.parameters()):
            if t.grad is not None:
                out.append(t.grad.clone())
                t.grad = None
        out.extend(b.clone() for b in layer.buffers())
    return out


def _both(make, x_of, attr: str, **convert) -> None:
    """The fused path, then the Python path (``fnorm.<attr>`` off) from the same seeds:
    every tensor equal, bit for bit."""
    got, want = [], []
    for fused, into in ((True, got), (False, want)):
        with pytest.MonkeyPatch.context() as mp:
            if not fused:
                mp.setattr(fnorm, attr, None)
            torch.manual_seed(0)
            layer = make()
            into.extend(_train(layer, x_of(), **convert))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def _affine(layer: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.uniform_(0.5, 1.5) if name == "weight" else p.uniform_(-1.0, 1.0)
    return layer


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 6), c=st.integers(1, 12), spatial=st.lists(st.integers(1, 9), max_size=2),
       bits=st.sampled_from([1, 2, 4, 8]), rounding=st.sampled_from(["stochastic", "nearest"]),
       affine=st.booleans(), x_grad=st.booleans(), momentum=st.sampled_from([0.1, None]))
def test_batch_norm_fused_equals_the_python_path(n, c, spatial, bits, rounding, affine, x_grad,
                                                 momentum):
    cls = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d}[len(spatial)]
    shape = (n, c, *spatial)
    if not affine and not x_grad:
        x_grad = True  # nothing would be saved

    def x_of():
        return (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 1
                ).requires_grad_(x_grad)
    _both(lambda: _affine(cls(c, affine=affine, momentum=momentum)), x_of, "_BN_FORWARD",
          bits=bits, rounding=rounding)


@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=2),
       normalized=st.lists(st.integers(1, 40), min_size=1, max_size=2),
       bits=st.sampled_from([1, 2, 4, 8]), rounding=st.sampled_from(["stochastic", "nearest"]),
       affine=st.booleans(), bias=st.booleans(), x_grad=st.booleans())
def test_layer_norm_fused_equals_the_python_path(lead, normalized, bits, rounding, affine, bias,
                                                 x_grad):
    shape = (*lead, *normalized)
    if not affine and not x_grad:
        x_grad = True

    def x_of():
        return (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 1
                ).requires_grad_(x_grad)
    _both(lambda: _affine(nn.LayerNorm(normalized, elementwise_affine=affine, bias=bias)), x_of,
          "_LN_FORWARD", bits=bits, rounding=rounding)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), per_group=st.integers(1, 4), groups=st.integers(1, 4),
       spatial=st.lists(st.integers(1, 7), max_size=2), bits=st.sampled_from([1, 2, 4, 8]),
       rounding=st.sampled_from(["stochastic", "nearest"]), affine=st.booleans(),
       x_grad=st.booleans())
def test_group_norm_fused_equals_the_python_path(n, per_group, groups, spatial, bits, rounding,
                                                 affine, x_grad):
    c = per_group * groups
    shape = (n, c, *spatial)
    assume(per_group * math.prod(spatial) > 1)  # torch's training check: 2+ values a group
    if not affine and not x_grad:
        x_grad = True

    def x_of():
        return (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3 + 1
                ).requires_grad_(x_grad)
    _both(lambda: _affine(nn.GroupNorm(groups, c, affine=affine)), x_of, "_GN_FORWARD",
          bits=bits, rounding=rounding)


def test_fused_paths_are_taken_in_the_common_case():
    """The Python Functions' fused calls (the compiled node, which calls the same two,
    tests/test_qlayer_nodes.py, is off here: its backward is C++, out of the spy's sight)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fnorm, "_QNORM", None)
        spy = _Spy(mp, "_BN_FORWARD", "_BN_BACKWARD", "_LN_FORWARD", "_LN_BACKWARD",
                   "_GN_FORWARD", "_GN_BACKWARD")
        _train(nn.BatchNorm2d(4), torch.randn(2, 4, 3, 3, requires_grad=True), steps=1)
        _train(nn.LayerNorm(8), torch.randn(2, 3, 8, requires_grad=True), steps=1)
        _train(nn.GroupNorm(2, 4), torch.randn(2, 4, 3, 3, requires_grad=True), steps=1)
        # the default strategy: batch norm gets the plain budget, one width
        model = az.convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        for _ in range(3):
            model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert spy.calls == {"_BN_FORWARD": 4, "_BN_BACKWARD": 4, "_LN_FORWARD": 1,
                         "_LN_BACKWARD": 1, "_GN_FORWARD": 1, "_GN_BACKWARD": 1}


@pytest.mark.parametrize("case", ["channels_last", "float64", "per-sample", "division",
                                  "hadamard", "1-d layer norm"])
def test_other_cases_keep_the_python_path(case):
    """What the fused call does not compute exactly as the Python path runs that path."""
    torch.manual_seed(0)
    convert = {"strategy": "uniform"}
    if case == "1-d layer norm":
        layer, x = nn.LayerNorm(8), torch.randn(8, requires_grad=True)
    else:
        layer, x = nn.BatchNorm2d(4), torch.randn(2, 4, 5, 5, requires_grad=True)
    if case == "channels_last":
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    elif case == "float64":
        layer, x = layer.double(), x.detach().double().requires_grad_()
    elif case == "division":
        convert["compressor"] = "division"
    elif case == "hadamard":
        convert["transform"] = "hadamard"
    model = az.convert_model(nn.Sequential(layer), **convert)
    if case == "per-sample":
        model[0].sample_bits = torch.tensor([1, 4], dtype=torch.uint8)
    with pytest.MonkeyPatch.context() as mp:
        spy = _Spy(mp, *FORWARDS)
        model(x).sum().backward()
    assert sum(spy.calls.values()) == 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_channels_last_gradient_takes_the_python_backward():
    """The Function's fused backward reads (N, C, *) order; a channels-last gradient goes to
    aten as in the Python path (so the two paths still agree). The compiled node makes such a
    gradient contiguous for the fused backward instead: the same gradient up to rounding."""
    def run(fused: bool, node: bool = False):
        with pytest.MonkeyPatch.context() as mp:
            if not node:
                mp.setattr(fnorm, "_QNORM", None)
            if not fused:
                mp.setattr(fnorm, "_BN_FORWARD", None)
            spy = _Spy(mp, "_BN_BACKWARD")
            torch.manual_seed(0)
            layer = _affine(nn.BatchNorm2d(4))
            model = az.convert_model(nn.Sequential(layer), bits=2, strategy="uniform")
            x = torch.randn(2, 4, 5, 5, requires_grad=True)
            g = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
            model(x).backward(g)
        return spy.calls["_BN_BACKWARD"], x.grad, layer.weight.grad
    calls, gi, gw = run(True)
    _, gi2, gw2 = run(False)
    assert calls == 0
    assert torch.equal(gi, gi2) and torch.equal(gw, gw2)
    _, gi3, gw3 = run(True, node=True)
    torch.testing.assert_close(gi3, gi, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw3, gw, rtol=1e-5, atol=1e-6)


def test_fused_norms_refuse_double_backward():
    for layer, shape in ((nn.BatchNorm2d(3), (2, 3, 4, 4)), (nn.LayerNorm(6), (2, 6)),
                         (nn.GroupNorm(2, 4), (2, 4, 3))):
        model = az.convert_model(nn.Sequential(layer), strategy="uniform")
        x = torch.randn(shape, requires_grad=True)
        with pytest.MonkeyPatch.context() as mp:
            spy = _Spy(mp, *FORWARDS)
            y = model(x)
        assert sum(spy.calls.values()) == 1
        with pytest.raises(NotImplementedError, match="double backward"):
            torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_fused_calls_check_their_arguments():
    from actnn_zoo.quant.backend import extension
    C = extension()
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="contiguous float32"):
        C.batch_norm_forward_codes(x.transpose(1, 2), None, None, None, None, 0.1, 1e-5, 2, 256,
                                   0, True, 4)
    with pytest.raises(ValueError, match="contiguous float32"):
        C.batch_norm_forward_codes(x.double(), None, None, None, None, 0.1, 1e-5, 2, 256, 0,
                                   True, 4)
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8"):
        C.batch_norm_forward_codes(x, None, None, None, None, 0.1, 1e-5, 3, 256, 0, True, 4)
    with pytest.raises(ValueError, match="at least 2 dims"):
        C.layer_norm_forward_codes(torch.randn(4), [4], None, None, 1e-5, 2, 256, 0, True, 4)
    with pytest.raises(ValueError, match="var_stride"):
        C.layer_norm_forward_codes(x, [4], None, None, 1e-5, 2, 256, 0, True, -1)
    with pytest.raises(ValueError, match="do not split into 5 groups"):
        C.group_norm_forward_codes(x, 5, None, None, 1e-5, 2, 256, 0, True, 4)
    with pytest.raises(ValueError, match="do not tile"):
        C.layer_norm_backward_fused(torch.randn(2, 5), torch.zeros(4, dtype=torch.uint8),
                                    torch.zeros(2, 1, dtype=torch.bfloat16),
                                    torch.zeros(2, 1, dtype=torch.bfloat16), 2, 256,
                                    torch.ones(2), None, None, 0, 0, 3, True)
