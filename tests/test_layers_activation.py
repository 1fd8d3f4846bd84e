"""Q-activations, Q-dropouts and QSoftmax: outputs identical to torch, what they save, and the
quality of their gradients (exact for masks, unbiased for compressed derivatives)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo.nn as qnn
from actnn_zoo.config import LayerQConfig
from hypothesis import given, settings
from hypothesis import strategies as st

from actnn_zoo.functional.activation import (_DERIVATIVE as _C_DERIVATIVE,
                                             _derivative_torch, activation_derivative)
from actnn_zoo.functional._rounding_variance import VARIANCE_STRIDE, variance_nbytes
from actnn_zoo.nn import QModule

from _checks_b import (assert_identical, cosine, q2, q8, quantized_bytes, run, saved_bytes,
                       unbiasedness)
from _graphs import node_name


def _input(shape=(4, 3, 6, 7), dtype=torch.float32, channels_last=False, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1)
    # exact kinks and boundaries: 0 (ReLU, LeakyReLU), -0.5 / 0.7 (Hardtanh), 6 (ReLU6)
    flat[:6] = torch.tensor([0.0, -0.0, -0.5, 0.7, 6.0, 1e-30])
    x = x.to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


# ----------------------------------------------------------------------------------------------
# Mask-based activations: identical outputs, EXACT gradients, 1 bit per value saved
# ----------------------------------------------------------------------------------------------
MASK_LAYERS = {
    "relu": lambda ip: nn.ReLU(inplace=ip),
    "relu6": lambda ip: nn.ReLU6(inplace=ip),
    "leaky": lambda ip: nn.LeakyReLU(0.1, inplace=ip),
    "hardtanh": lambda ip: nn.Hardtanh(-0.5, 0.7, inplace=ip),
}


def _q(float_mod: nn.Module, qconfig: LayerQConfig = None) -> QModule:
    return getattr(qnn, "Q" + type(float_mod).__name__).from_float(float_mod, qconfig)


@pytest.mark.parametrize("name", list(MASK_LAYERS))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.float32, True),
                                                 (torch.bfloat16, False)])
def test_mask_layers_identical_forward_and_exact_grads(name, inplace, dtype, channels_last):
    x = _input(dtype=dtype, channels_last=channels_last)
    ref = MASK_LAYERS[name](inplace)
    q = _q(MASK_LAYERS[name](inplace))
    y_ref, g_ref, grad = run(ref, x)
    y_q, g_q, _ = run(q, x, grad)
    # the compiled node (cpp_ext/qlayers.cpp) for a contiguous input, the Python Function for
    # the channels-last one (its bits in memory order)
    want = "MaskActivationFunctionBackward" if channels_last else "QMaskFunction"
    assert node_name(y_q.grad_fn) == want
    assert_identical(y_q, y_ref)
    assert_identical(g_q, g_ref)


def test_mask_layers_nan_inputs_follow_torch():
    x = _input()
    x.view(-1)[10:14] = float("nan")
    nan = torch.isnan(x)
    for name, make in MASK_LAYERS.items():
        y_ref, g_ref, grad = run(make(False), x)
        y_q, g_q, _ = run(_q(make(False)), x, grad)
        assert_identical(y_q, y_ref)
        if name in ("relu6", "hardtanh"):
            # torch's hardtanh backward passes the gradient at NaN in its scalar tail loop and
            # not in its vectorised loop; ours consistently passes none.
            assert not g_q[nan].any()
            g_q, g_ref = g_q[~nan], g_ref[~nan]
        assert_identical(g_q, g_ref)


def test_leaky_relu_inplace_negative_slope_supported():
    # torch's in-place LeakyReLU backward rejects slope < 0; the mask is taken before the
    # update here, so it works and equals the out-of-place torch gradient.
    x = _input()
    y_ref, g_ref, grad = run(nn.LeakyReLU(-0.3), x)
    y_q, g_q, _ = run(qnn.QLeakyReLU(-0.3, inplace=True), x, grad)
    assert_identical(y_q, y_ref)
    assert_identical(g_q, g_ref)


def test_inplace_relu_modifies_input_and_marks_it():
    leaf = _input().requires_grad_(True)
    h = leaf * 1
    out = qnn.QReLU(inplace=True)(h)
    assert out is h and h._version > 0
    assert torch.equal(h, F.relu(leaf.detach()))
    with pytest.raises(RuntimeError, match="in-place"):
        qnn.QReLU(inplace=True)(leaf)  # a leaf requiring grad, rejected as torch does


@pytest.mark.parametrize("name", list(MASK_LAYERS))
def test_mask_layers_save_one_bit_per_value(name):
    x = _input((4, 3, 10, 10)).requires_grad_(True)  # 1200 values
    nbytes, _ = saved_bytes(lambda: _q(MASK_LAYERS[name](False))(x * 1))
    assert nbytes == math.ceil(x.numel() / 8) == 150
    ref_bytes, _ = saved_bytes(lambda: MASK_LAYERS[name](False)(x * 1))
    assert ref_bytes >= 4 * x.numel()  # torch keeps a float32 tensor


def test_relu_mask_channels_last_saved_in_memory_order_still_one_bit():
    x = _input((2, 8, 5, 5), channels_last=True).requires_grad_(True)
    nbytes, y = saved_bytes(lambda: qnn.QReLU()(x * 1))
    assert nbytes == math.ceil(x.numel() / 8)
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_relu_double_backward_linear_in_grad():
    # grad_in = mask * g is linear in g, so create_graph works and equals torch's.
    x = _input((2, 3, 4, 4))
    res = []
    for mod in (nn.ReLU(), qnn.QReLU()):
        leaf = x.clone().requires_grad_(True)
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        (gi,) = torch.autograd.grad(mod(leaf * 1), leaf, g, create_graph=True)
        (gg,) = torch.autograd.grad((gi * gi).sum(), g)
        res.append((gi.detach(), gg))
    assert_identical(res[0][0], res[1][0])
    assert_identical(res[0][1], res[1][1])


# ----------------------------------------------------------------------------------------------
# Derivative-compressing activations
# ----------------------------------------------------------------------------------------------
DERIV_LAYERS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "sigmoid": lambda: nn.Sigmoid(),
    "tanh": lambda: nn.Tanh(),
    "elu": lambda: nn.ELU(alpha=0.7),
    "softplus": lambda: nn.Softplus(beta=2.0, threshold=3.0),
}
INPLACE_DERIV = {"silu": lambda: nn.SiLU(inplace=True), "elu": lambda: nn.ELU(0.7, inplace=True)}


def _exact_grad(mod: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The exact fp32 gradient of the plain torch layer."""
    _, g, _ = run(mod, x, grad)
    return g


@pytest.mark.parametrize("name", list(DERIV_LAYERS))
@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.float32, True),
                                                 (torch.bfloat16, False)])
def test_deriv_layers_identical_forward(name, dtype, channels_last):
    x = _input(dtype=dtype, channels_last=channels_last)
    y_ref, _, _ = run(DERIV_LAYERS[name](), x)
    y_q, g_q, _ = run(_q(DERIV_LAYERS[name]()), x)
    # the compiled node where the backward does not read the output and the input is
    # contiguous, else the Python Function
    node = not channels_last and name not in ("sigmoid", "tanh")
    want = "QDerivativeFunction" if node else "DerivativeActivationFunctionBackward"
    assert node_name(y_q.grad_fn) == want
    assert_identical(y_q, y_ref)
    assert g_q.dtype == dtype and torch.isfinite(g_q).all()


@pytest.mark.parametrize("name", list(INPLACE_DERIV))
def test_inplace_deriv_layers(name):
    x = _input()
    y_ref, g_ref, grad = run(INPLACE_DERIV[name](), x)
    y_q, g_q, _ = run(_q(INPLACE_DERIV[name](), q8()), x, grad)
    assert_identical(y_q, y_ref)
    assert cosine(g_q, g_ref) >= 0.9999


def test_inplace_elu_negative_alpha_supported():
    # torch's in-place ELU backward (result-based) rejects alpha < 0; ours saves f'(x) first.
    x = _input()
    y_ref, g_ref, grad = run(nn.ELU(-0.5), x)
    y_q, g_q, _ = run(qnn.QELU(-0.5, inplace=True, qconfig=q8()), x, grad)
    assert_identical(y_q, y_ref)
    assert cosine(g_q, g_ref) >= 0.9999


DERIV_SPECS = {  # op, params, torch function
    "gelu": ("gelu", ("none",), lambda t: F.gelu(t)),
    "gelu_tanh": ("gelu", ("tanh",), lambda t: F.gelu(t, approximate="tanh")),
    "silu": ("silu", (), F.silu),
    "sigmoid": ("sigmoid", (), torch.sigmoid),
    "tanh": ("tanh", (), torch.tanh),
    "elu": ("elu", (0.7,), lambda t: F.elu(t, 0.7)),
    "softplus": ("softplus", (2.0, 3.0), lambda t: F.softplus(t, 2.0, 3.0)),
}


@pytest.mark.parametrize("name", list(DERIV_SPECS))
def test_analytic_derivative_matches_autograd(name):
    """The saved quantity itself (before compression) is torch's derivative."""
    op, params, fn = DERIV_SPECS[name]
    x = torch.cat([torch.linspace(-12, 12, 2001), torch.tensor([0.0, 1.5, -1e-3, 40.0, -40.0])])
    leaf = x.clone().requires_grad_(True)
    y = fn(leaf)
    (exact,) = torch.autograd.grad(y.sum(), leaf)
    d = activation_derivative(op, x, y.detach(), params)
    assert_identical(d, exact)  # torch's own backward kernel, unit gradient


_ALL_DERIV = {**{k: v[:2] for k, v in DERIV_SPECS.items()}, "hardswish": ("hardswish", ()),
              "hardsigmoid": ("hardsigmoid", ()), "mish": ("mish", ()),
              "elu_int_alpha": ("elu", (1,))}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(_ALL_DERIV)),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       layout=st.sampled_from(["contiguous", "channels_last", "sliced", "transposed"]),
       shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6),
                       st.integers(1, 7)),
       seed=st.integers(0, 2 ** 16))
def test_compiled_derivative_equals_the_torch_ops(name, dtype, layout, shape, seed):
    """``_C.activation_derivative`` (the CPU path of activation_derivative) gives f'(x) bit
    for bit as the torch ops do, in their dtype and memory layout, for every smooth
    activation, input dtype and layout; it builds no graph."""
    if _C_DERIVATIVE is None:
        pytest.skip("the extension has no activation_derivative")
    op, params = _ALL_DERIV[name]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 5).to(dtype)
    x.view(-1)[0] = 0.0  # the kink of the piecewise ones
    x = {"contiguous": x, "channels_last": x.contiguous(memory_format=torch.channels_last),
         "sliced": x[:, :, 1:] if shape[2] > 1 else x, "transposed": x.transpose(1, 3)}[layout]
    x = x.detach().requires_grad_()  # a forward's input (same strides): no graph from it
    src = torch.sigmoid(x) if op == "sigmoid" else torch.tanh(x) if op == "tanh" else x
    want = _derivative_torch(op, src.detach(), params)
    got = activation_derivative(op, x, src, params)
    assert got.grad_fn is None and not got.requires_grad
    assert got.dtype == want.dtype == (torch.float64 if dtype == torch.float64
                                       else torch.float32)
    assert got.stride() == want.stride()
    assert_identical(got, want)


def test_compiled_derivative_rejects_an_unknown_activation():
    if _C_DERIVATIVE is None:
        pytest.skip("the extension has no activation_derivative")
    with pytest.raises(ValueError, match="unknown activation swish"):
        _C_DERIVATIVE(torch.randn(3), "swish", 0.0, 0.0, "none")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        activation_derivative("swish", torch.randn(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced", "transposed"])
def test_exact_gelu_derivative_any_layout_and_grad_mode(dtype, layout):
    """The exact GELU's f'(x) on the CPU runs over a dense unit gradient (out=, in place): the
    values the stride-0 unit gradient gives (torch's kernel picks its loop by layout, and its
    loops may differ in the last bit, so both are compared on the same input), in the input's
    memory order, also for a grad-requiring input under grad mode (out= would refuse one)."""
    x = torch.randn(2, 3, 5, 4, dtype=dtype) * 4
    x = {"contiguous": x, "channels_last": x.contiguous(memory_format=torch.channels_last),
         "sliced": x[:, 1:], "transposed": x.transpose(1, 3)}[layout]
    leaf = x.detach().requires_grad_(True)
    unit = torch.ones((), dtype=dtype).expand(x.shape)
    want = torch.ops.aten.gelu_backward(unit, x, approximate="none")
    d = activation_derivative("gelu", leaf, None, ("none",))
    assert d.requires_grad is False and d.stride() == want.stride()
    assert_identical(d, want)
    if layout == "contiguous":  # and autograd's, for a dense upstream gradient
        (exact,) = torch.autograd.grad(F.gelu(leaf), leaf, torch.ones_like(leaf))
        assert_identical(d, exact)


@pytest.mark.parametrize("name", list(DERIV_LAYERS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_deriv_layers_8bit_cosine(name, channels_last):
    x = _input((4, 3, 10, 10), channels_last=channels_last)
    mod = DERIV_LAYERS[name]()
    _, exact, grad = run(mod, x)
    _, g_q, _ = run(_q(DERIV_LAYERS[name](), q8()), x, grad)
    assert cosine(g_q, exact) >= 0.9999


@pytest.mark.parametrize("name", list(DERIV_LAYERS))
def test_deriv_layers_2bit_unbiased(name):
    """Mean of K=200 stochastic 2-bit backward passes converges to the exact gradient.

    Each pass quantizes f'(x) with fresh random rounding, so passes are independent and
    E||mean - exact||^2 = RMS^2 / K exactly for an unbiased scheme (RMS: single-pass error).
    ||mean - exact||^2 is a sum over 960 elements (effective degrees of freedom ~300 since
    grad_out ~ N(0, 1) weights them), so it concentrates to within ~10% of its mean: we allow
    1.5x RMS / sqrt(K) (far outside chance), plus 1e-5 of the gradient norm for fp32 rounding
    and the 2^-24 resolution of the random numbers. A bias b adds ||b||^2, so any bias above
    ~1.1 RMS / sqrt(K) per element fails (see also the nearest-rounding test).
    """
    k = 200
    x = _input((3, 320))  # rows of 256 + 64 values: a full and a short group
    _, exact, grad = run(DERIV_LAYERS[name](), x)
    q = _q(DERIV_LAYERS[name](), q2())
    mean_err, rms = unbiasedness(lambda: run(q, x, grad)[1], exact, k)
    assert rms > 1e-3 * float(exact.norm())  # compression really happened
    assert mean_err <= 1.5 * rms / math.sqrt(k) + 1e-5 * float(exact.norm()), (mean_err, rms)


def test_unbiasedness_check_detects_bias():
    # Round-to-nearest is deterministic and biased: the same criterion must reject it.
    k = 50
    x = _input((3, 320))
    _, exact, grad = run(nn.GELU(), x)
    q = qnn.QGELU(qconfig=q2(rounding="nearest"))
    mean_err, rms = unbiasedness(lambda: run(q, x, grad)[1], exact, k)
    assert mean_err > 1.5 * rms / math.sqrt(k)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gelu_saved_bytes(bits):
    x = _input((4, 300)).requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: qnn.QGELU(qconfig=LayerQConfig(bits=bits))(x * 1))
    assert nbytes == quantized_bytes(4, 300, bits)
    ref, _ = saved_bytes(lambda: nn.GELU()(x * 1))
    assert ref == 4 * x.numel()


def test_gelu_channels_last_compressed_in_memory_order():
    # rows are still samples, so the size is the same as for a contiguous (4, 300) tensor
    x = _input((4, 12, 5, 5), channels_last=True).requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: qnn.QGELU()(x * 1))
    assert nbytes == quantized_bytes(4, 300, 2)


def test_gelu_per_sample_bits_from_precision_strategy():
    x = _input((4, 300))
    q = qnn.QGELU()
    q.sample_bits = torch.tensor([8, 2, 2, 4], dtype=torch.uint8)
    xs = x.clone().requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: q(xs * 1))
    assert nbytes > quantized_bytes(4, 300, 2) and nbytes < quantized_bytes(4, 300, 8)
    _, exact, grad = run(nn.GELU(), x)
    _, g, _ = run(q, x, grad)
    assert cosine(g[0], exact[0]) >= 0.9999  # the 8-bit sample


@pytest.mark.parametrize("mod", [qnn.QGELU(), qnn.QSigmoid(), qnn.QSoftmax(-1)],
                         ids=lambda m: type(m).__name__)
def test_double_backward_raises_instead_of_wrong(mod):
    # f''(x) is not saved: a create_graph backward must raise, naming the feature, rather
    # than return a gradient that silently lacks the second-derivative term.
    leaf = _input((2, 8)).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(mod(leaf * 1).sum(), leaf, create_graph=True)
    (g,) = torch.autograd.grad(mod(leaf * 1).sum(), leaf)  # plain backward still fine
    assert torch.isfinite(g).all()


def test_float64_input():
    x = _input((2, 40), dtype=torch.float64)
    y_ref, exact, grad = run(nn.GELU(), x)
    y_q, g_q, _ = run(qnn.QGELU(qconfig=q8()), x, grad)
    assert_identical(y_q, y_ref)
    assert g_q.dtype == torch.float64 and cosine(g_q, exact) >= 0.9999


# ----------------------------------------------------------------------------------------------
# Autocast (bfloat16 on CPU) and module plumbing
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["relu", "gelu", "silu", "softmax"])
def test_autocast_bf16(name):
    make = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU,
            "softmax": lambda: nn.Softmax(-1)}[name]
    torch.manual_seed(0)
    lin = nn.Linear(16, 32)
    x = torch.randn(8, 16)
    results = []
    for act in (make(), _q(make(), q8())):
        xs = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = act(lin(xs))
        y.float().pow(2).sum().backward()
        results.append((y, xs.grad))
    (y_ref, g_ref), (y_q, g_q) = results
    assert y_ref.dtype == torch.bfloat16
    assert_identical(y_q, y_ref)
    if name == "relu":
        assert_identical(g_q, g_ref)
    else:
        assert cosine(g_q, g_ref) >= 0.999  # bf16 rounding of the grad itself dominates


def test_plain_torch_path_in_eval_no_grad_and_disabled():
    x = _input((2, 3, 4, 4))
    for make in [nn.ReLU, nn.GELU, lambda: nn.Softmax(1), lambda: nn.Dropout(0.5)]:
        ref = make()
        q = _q(make())
        leaf = x.clone().requires_grad_(True)
        q.eval()
        ref.eval()
        y = q(leaf)
        assert "Function" not in type(y.grad_fn).__name__
        assert_identical(y, ref(leaf))
        q.train()
        with torch.no_grad():
            y = q(x)
        assert y.grad_fn is None
        if not isinstance(ref, nn.Dropout):
            assert_identical(y, ref.train()(x))
        q.qconfig = q.qconfig.replace(enabled=False)
        y = q(leaf)
        assert "Function" not in type(y.grad_fn).__name__
        # input not requiring grad: nothing would be saved, plain path
        q.qconfig = q.qconfig.replace(enabled=True)
        assert q(x).grad_fn is None


ALL_ACT = [nn.ReLU(inplace=True), nn.ReLU6(), nn.LeakyReLU(0.2, True), nn.Hardtanh(-2, 3),
           nn.GELU("tanh"), nn.SiLU(True), nn.Sigmoid(), nn.Tanh(), nn.ELU(0.3, True),
           nn.Softplus(3.0, 5.0), nn.Dropout(0.2, True), nn.Dropout1d(0.3), nn.Dropout2d(0.4),
           nn.Dropout3d(0.5), nn.Softmax(dim=-2)]


@pytest.mark.parametrize("mod", ALL_ACT, ids=lambda m: type(m).__name__)
def test_from_float_to_float_round_trip(mod):
    calls = []
    handle = mod.register_forward_hook(lambda m, i, o: calls.append(1))
    qc = LayerQConfig(bits=4)
    q = _q(mod, qc)
    assert isinstance(q, type(mod)) and isinstance(q, QModule)
    assert q.qconfig is qc and q.training == mod.training
    for key in mod.__constants__ if hasattr(mod, "__constants__") else []:
        assert getattr(q, key) == getattr(mod, key)
    q(torch.randn((2, 3, 4) if isinstance(mod, nn.Dropout1d) else (2, 3, 4, 5)))
    assert calls == [1]
    back = q.to_float()
    assert type(back) is type(mod)
    assert back.__dict__.keys() == mod.__dict__.keys()
    assert all(getattr(back, k) == getattr(mod, k) for k in getattr(mod, "__constants__", []))
    assert "bits=4" in repr(q)
    handle.remove()
    with pytest.raises(TypeError):
        type(q).from_float(nn.Identity())


def test_constructor_signatures_match_torch():
    with pytest.warns(FutureWarning):  # torch's own deprecation of these names
        assert qnn.QHardtanh(min_value=-2.0, max_value=2.0).min_val == -2.0
    assert qnn.QLeakyReLU(0.3, True).negative_slope == 0.3
    assert qnn.QSoftplus(2.0, 10.0, qconfig=q8()).qconfig.bits == 8
    assert qnn.QGELU("tanh").approximate == "tanh"
    assert qnn.QDropout2d(0.25, inplace=True).p == 0.25
    with pytest.raises(ValueError):
        qnn.QDropout(1.5)
    with pytest.raises(TypeError):
        qnn.QReLU(qconfig={"bits": 2})
    with pytest.raises(RuntimeError, match="approximate"):  # torch's error, as nn.GELU
        qnn.QGELU(approximate="fast")(torch.randn(3, requires_grad=True))


@pytest.mark.parametrize("mod", [qnn.QReLU(), qnn.QGELU(), qnn.QSoftmax(1),
                                 qnn.QDropout(0.5), qnn.QDropout2d(0.5)],
                         ids=lambda m: type(m).__name__)
def test_retain_graph_backward_twice_identical(mod):
    leaf = _input((3, 4, 5, 6)).requires_grad_(True)
    y = mod(leaf * 1)
    g = torch.randn_like(y)
    (g1,) = torch.autograd.grad(y, leaf, g, retain_graph=True)
    (g2,) = torch.autograd.grad(y, leaf, g)
    assert_identical(g1, g2)


def test_empty_and_scalar_inputs():
    for mod in (qnn.QReLU(), qnn.QGELU(), qnn.QSoftmax(0), qnn.QDropout()):
        for shape in [(0, 5), ()]:
            leaf = torch.randn(shape).requires_grad_(True)
            y = mod(leaf * 1)
            y.sum().backward()
            assert leaf.grad.shape == leaf.shape


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------
def test_dropout_statistics_and_scaling():
    p = 0.3
    x = torch.rand(64, 1024) + 0.5  # no zeros, so zeros in the output are dropped values
    leaf = x.clone().requires_grad_(True)
    y = qnn.QDropout(p)(leaf * 1)
    kept = y != 0
    n = x.numel()
    rate = float(kept.float().mean())
    assert abs(rate - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)
    scale = torch.ones(()).div_(1 - p)  # torch's noise.div_(1 - p) in float32
    assert torch.equal(y[kept], x[kept] * scale)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(leaf.grad, g * (kept.float().div_(1 - p)))


@pytest.mark.parametrize("make,shape", [
    (lambda ip: nn.Dropout(0.4, ip), (4, 6, 5, 5)),
    (lambda ip: nn.Dropout1d(0.4, ip), (4, 6, 9)),
    (lambda ip: nn.Dropout1d(0.4, ip), (6, 9)),  # unbatched
    (lambda ip: nn.Dropout2d(0.4, ip), (4, 6, 5, 5)),
    (lambda ip: nn.Dropout3d(0.4, ip), (2, 6, 3, 4, 5)),
    (lambda ip: nn.Dropout3d(0.4, ip), (6, 3, 4, 5)),  # unbatched
])
@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_same_stream_as_torch_cpu(make, shape, inplace):
    # Noise is drawn exactly as torch's CPU kernel draws it, so with one seed the outputs and
    # gradients are bit-identical (the saved mask is lossless).
    x = torch.randn(shape)
    torch.manual_seed(7)
    y_ref, g_ref, grad = run(make(inplace), x)
    torch.manual_seed(7)
    y_q, g_q, _ = run(_q(make(inplace)), x, grad)
    assert "DropoutFunction" in y_q.grad_fn.name()  # the Python Function or the compiled node
    assert_identical(y_q, y_ref)
    assert_identical(g_q, g_ref)


def test_dropout_channels_last_same_stream_as_torch():
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    torch.manual_seed(3)
    y_ref, g_ref, grad = run(nn.Dropout(0.5), x)
    torch.manual_seed(3)
    y_q, g_q, _ = run(qnn.QDropout(0.5), x, grad)
    assert_identical(y_q, y_ref)
    assert_identical(g_q, g_ref)


def test_feature_dropout_drops_whole_channels():
    p = 0.5
    x = torch.rand(32, 16, 5, 5) + 0.5
    y, _, _ = run(qnn.QDropout2d(p), x)
    per_channel = (y != 0).flatten(2)
    assert ((per_channel.all(-1)) | (~per_channel.any(-1))).all()
    rate = float(per_channel.all(-1).float().mean())
    assert abs(rate - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / (32 * 16))


@pytest.mark.parametrize("make,shape,expected", [
    (lambda: qnn.QDropout(0.5), (4, 6, 10, 10), math.ceil(2400 / 8)),
    (lambda: qnn.QDropout1d(0.5), (4, 6, 10), 3),
    (lambda: qnn.QDropout2d(0.5), (4, 6, 10, 10), 3),
    (lambda: qnn.QDropout3d(0.5), (4, 6, 2, 3, 3), 3),
])
def test_dropout_saves_one_bit_per_mask_value(make, shape, expected):
    x = torch.randn(shape).requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: make()(x * 1))
    assert nbytes == expected


def test_dropout_p0_p1_like_torch():
    x = torch.randn(4, 5)
    y, g, grad = run(qnn.QDropout(0.0), x)
    assert torch.equal(y, x) and torch.equal(g, grad)
    y, g, grad = run(qnn.QDropout(1.0), x)
    assert torch.equal(y, torch.zeros_like(x)) and torch.equal(g, torch.zeros_like(x))
    y, g, _ = run(qnn.QDropout2d(1.0), torch.randn(2, 3, 4, 4))
    assert not y.any() and not g.any()


def test_dropout_dims_errors_and_warnings_like_torch():
    with pytest.raises(RuntimeError, match="dropout1d"):
        qnn.QDropout1d()(torch.randn(2, 3, 4, 5, requires_grad=True))
    with pytest.warns(UserWarning, match="3D input to dropout2d"):
        qnn.QDropout2d()(torch.randn(2, 3, 4, requires_grad=True))
    with pytest.warns(UserWarning, match="dropout3d"):
        qnn.QDropout3d()(torch.randn(2, 3, 4, requires_grad=True))


# ----------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,shape", [(-1, (4, 5, 40)), (1, (4, 5, 40)), (0, (6, 30)),
                                       (None, (3, 4, 5, 6))])
def test_softmax_forward_identical_and_8bit_grad(dim, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # implicit-dim deprecation, as torch warns
        y_ref, exact, grad = run(nn.Softmax(dim), x)
        y_q, g_q, _ = run(qnn.QSoftmax(dim, qconfig=q8()), x, grad)
    assert type(y_q.grad_fn).__name__ == "SoftmaxFunctionBackward"
    assert_identical(y_q, y_ref)
    # Not unbiased (quadratic in y_hat) but 8 bits keep it close: the error is set by the
    # group range (max y in 256 values / 255) against small softmax entries.
    assert cosine(g_q, exact) >= 0.999
    assert float((g_q - exact).norm()) <= 0.05 * float(exact.norm())


def test_softmax_2bit_error_shrinks_with_averaging():
    # At 2 bits one pass is noisy; averaging K passes must cut the error roughly like
    # 1/sqrt(K) (0.07 for K=200) down to the small bias -Var(y_hat) * g; require < 0.25.
    k = 200
    x = torch.randn(8, 5, 64, generator=torch.Generator().manual_seed(1)) * 2
    _, exact, grad = run(nn.Softmax(-1), x)
    q = qnn.QSoftmax(-1, qconfig=q2())
    mean_err, rms = unbiasedness(lambda: run(q, x, grad)[1], exact, k)
    assert mean_err <= 0.25 * rms
    assert mean_err <= 0.15 * float(exact.norm())


def test_softmax_saved_bytes_is_compressed_output():
    x = torch.randn(4, 3, 100).requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: qnn.QSoftmax(-1)(x * 1))
    # plus the sampled rounding variances of its unbiased backward (_rounding_variance)
    assert nbytes == quantized_bytes(4, 300, 2) + variance_nbytes(1200, VARIANCE_STRIDE)
    ref, _ = saved_bytes(lambda: nn.Softmax(-1)(x * 1))
    assert ref == 4 * x.numel()
