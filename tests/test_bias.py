"""Bias of every autograd Function's gradients at 2 bits, against exact fp32 autograd.

For each Function and each gradient it returns (input and weight gradients alike), K backward
passes are drawn with ``torch.manual_seed(1000 + k)`` (the quantizer's seeds come from torch's
generator, so each pass rounds afresh) and the statistic

    z = ||mean_K(g_q) - g|| / sqrt(trace(C) / K)

is computed (K = 300), C the sample covariance of the K draws and g torch's exact gradient. For an
unbiased estimator E[z^2] = 1 (the mean's squared error is trace(C) / K); a bias b adds
K ||b||^2 / trace(C), so z grows with sqrt(K) when there is one. The spread of z^2 under no bias
is sqrt(2 / d_eff) with d_eff = trace(C)^2 / ||C||_F^2 (the effective number of independent
coordinates), so the stated tolerance is |z^2 - 1| <= 4 sqrt(2 / d_eff) + 0.1 (4 sigma, plus
0.1 for the estimated trace's own error), z <= 1.3-1.4 for input gradients of a few hundred
values (d_eff 40-140) and up to 2.0 for a norm's weight gradient of 4 values (d_eff ~4).
Before the correction of ``functional/_rounding_variance.py`` (K = 400): softmax over dim 1
z = 2.29, layer norm over 16 / 64 values 2.41 / 1.67, RMSNorm 2.36, batch norm 2.04 (1d) /
2.89 (2d), group norm 2.84; after it 0.75-1.12. ``test_old_bias_is_detected`` keeps checking
that the statistic sees the old bias. Its power is limited where d_eff is small or the bias is
weak at these sizes: softmax over rows of 64 gave z = 1.25 before (tolerance 1.40), 0.94 after.

Gradients that read nothing compressed (a linear's input gradient, masks, pooling indices) are
exact: they must equal torch's to float rounding in every draw. Attention is not unbiased
(softmax of rounded scores, ``functional/attention.py``): its case is an xfail(strict) that
measures the bias, so it fails loudly the day it becomes unbiased.

Shapes are tiny (a few hundred values) so that K = 400 passes of all cases take seconds.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo.nn as qnn
from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional import _rounding_variance as rv
from actnn_zoo.functional import activation as fa
from actnn_zoo.functional import attention as fatt
from actnn_zoo.functional import dropout as fd
from actnn_zoo.functional import loss as floss
from actnn_zoo.functional import norm as fnorm
from actnn_zoo.functional import pool as fp
from actnn_zoo.functional import rmsnorm as frms
from actnn_zoo.functional import softmax as fsm
from actnn_zoo.functional import upsample as fup

K = 300
Q2 = LayerQConfig(bits=2)
Grads = Dict[str, Tensor]


# tiny ops: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(fn: Callable[..., Tensor], inputs: Dict[str, Tensor], g: Tensor) -> Grads:
    """{name: d<fn(**inputs), g>/d input} for the inputs that require grad (fresh leaves)."""
    leaves = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inputs.items()}
    out = fn(**leaves)
    out.backward(g)
    return {k: v.grad for k, v in leaves.items() if v.requires_grad}


def _module_grads(mod: nn.Module, x: Tensor, g: Tensor) -> Grads:
    mod.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_()
    mod(xi).backward(g)
    out = {"x": xi.grad}
    out.update({n: p.grad for n, p in mod.named_parameters() if p.grad is not None})
    return out


def z_stat(draws: Tensor, exact: Tensor) -> Tuple[float, float]:
    """(z, d_eff) of K draws (K, d) against ``exact`` (d,), in float64 (module docstring)."""
    d = draws.double()
    k = d.shape[0]
    mean = d.mean(0)
    centred = d - mean
    gram = centred @ centred.t() / (k - 1)  # same nonzero spectrum as the d x d covariance
    trace = float(gram.trace())
    d_eff = trace ** 2 / float((gram * gram).sum())
    err = float((mean - exact.double()).norm())
    return err / math.sqrt(trace / k), d_eff


def tolerance(d_eff: float) -> float:
    """Allowed |z^2 - 1| (module docstring)."""
    return 4 * math.sqrt(2 / d_eff) + 0.1


# -- cases: name -> () -> (draw() -> Grads, exact Grads, names of the exact gradients) ---------
def _seeded(shape, scale=1.0, shift=0.0, seed=0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + shift


def _module_case(torch_layer: nn.Module, qcls, shape, exact_names=(), scale=1.0, shift=0.0):
    def make():
        torch.manual_seed(0)
        ref = torch_layer()
        q = qcls.from_float(copy.deepcopy(ref), Q2).train()
        ref.train()
        with torch.no_grad():  # non-trivial affine parameters
            for p in ref.parameters():
                p.copy_(_seeded(p.shape, 0.5, 1.0, seed=7))
            for p in q.parameters():
                p.copy_(_seeded(p.shape, 0.5, 1.0, seed=7))
        x = _seeded(shape, scale, shift, seed=1)
        g = _seeded(ref(x).shape, seed=2)
        exact = _module_grads(ref, x, g)
        return (lambda: _module_grads(q, x, g)), exact, set(exact_names)
    return make


def _fn_case(qfn, reffn, inputs: Dict[str, Tensor], exact_names=(), seed=2):
    def make():
        out = reffn(**inputs)
        g = _seeded(out.shape, seed=seed)
        exact = _grads(reffn, inputs, g)
        return (lambda: _grads(qfn, inputs, g)), exact, set(exact_names)
    return make


def _x(shape, scale=1.0, shift=0.0, seed=1) -> Tensor:
    return _seeded(shape, scale, shift, seed).requires_grad_()


def _dropout_case():
    """Dropout: its own mask is random too; the exact gradient is that of x * mask / (1 - p)
    for the mask each draw used (read back from its output)."""
    x = _seeded((8, 32), 1.0, 3.0, seed=1)  # no zero inputs: out == 0 exactly where dropped
    g = _seeded((8, 32), seed=2)

    def make():
        def draw():
            xi = x.clone().requires_grad_()
            out = fd.dropout(xi, 0.3)
            out.backward(g)
            kept = (out.detach() != 0).float()
            return {"x": xi.grad, "exact:x": g * kept / 0.7}
        return draw, None, {"x"}
    return make


def _qkv():
    return {"query": _x((1, 2, 8, 8), seed=1), "key": _x((1, 2, 8, 8), seed=3),
            "value": _x((1, 2, 8, 8), seed=4)}


def _ce_inputs():
    return {"input": _x((16, 24), 2.0, seed=1)}


_TARGET = torch.randint(0, 24, (16,), generator=torch.Generator().manual_seed(5))
_W40 = _seeded((24, 12), 0.3, seed=6)

CASES: Dict[str, Callable] = {
    "linear": _module_case(lambda: nn.Linear(24, 16), qnn.QLinear, (8, 24), {"x", "bias"}),
    "conv2d": _module_case(lambda: nn.Conv2d(3, 4, 3, padding=1), qnn.QConv2d, (2, 3, 6, 6),
                           {"x", "bias"}),
    "conv1d_transpose": _module_case(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2),
                                     qnn.QConvTranspose1d, (2, 3, 10), {"x", "bias"}),
    "batchnorm2d": _module_case(lambda: nn.BatchNorm2d(4), qnn.QBatchNorm2d, (2, 4, 3, 3),
                                {"bias"}, 2.0, 0.5),
    "batchnorm1d": _module_case(lambda: nn.BatchNorm1d(8), qnn.QBatchNorm1d, (24, 8), {"bias"},
                                2.0, 0.5),
    "layernorm16": _module_case(lambda: nn.LayerNorm(16), qnn.QLayerNorm, (32, 16), {"bias"},
                                3.0, 1.0),
    "layernorm64": _module_case(lambda: nn.LayerNorm(64), qnn.QLayerNorm, (8, 64), {"bias"},
                                3.0, 1.0),
    "groupnorm": _module_case(lambda: nn.GroupNorm(2, 4), qnn.QGroupNorm, (4, 4, 3, 3), {"bias"},
                              2.0, 0.5),
    "rmsnorm": _module_case(lambda: nn.RMSNorm(16), qnn.QRMSNorm, (32, 16), (), 3.0, 1.0),
    "rmsnorm_llama": _fn_case(
        lambda x, w: frms.rms_norm(x, (16,), w, 1e-6, "llama"),
        lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
        {"x": _x((32, 16), 3.0, 1.0), "w": _x((16,), 0.5, 1.0, seed=7)}),
    "softmax": _fn_case(lambda x: fsm.softmax(x, -1), lambda x: F.softmax(x, -1),
                        {"x": _x((16, 64), 2.0)}),
    "softmax_dim1": _fn_case(lambda x: fsm.softmax(x, 1), lambda x: F.softmax(x, 1),
                             {"x": _x((4, 16, 8), 2.0)}),
    "log_softmax": _fn_case(lambda x: fsm.log_softmax(x, -1), lambda x: F.log_softmax(x, -1),
                            {"x": _x((16, 64), 2.0)}),
    "cross_entropy": _fn_case(
        lambda input: floss.cross_entropy(input, _TARGET, label_smoothing=0.1),
        lambda input: F.cross_entropy(input, _TARGET, label_smoothing=0.1), _ce_inputs()),
    "linear_cross_entropy": _fn_case(
        lambda x, w, b: floss.linear_cross_entropy(x, w, b, _TARGET),
        lambda x, w, b: F.cross_entropy(F.linear(x, w, b), _TARGET),
        {"x": _x((16, 12), 2.0), "w": _W40.clone().requires_grad_(),
         "b": _x((24,), 0.1, seed=8)}, {"w", "b"}),
    "dropout": _dropout_case(),
    "relu": _fn_case(lambda x: fa.relu(x), lambda x: F.relu(x), {"x": _x((8, 32))}, {"x"}),
    "leaky_relu": _fn_case(lambda x: fa.leaky_relu(x, 0.1), lambda x: F.leaky_relu(x, 0.1),
                           {"x": _x((8, 32))}, {"x"}),
    "hardtanh": _fn_case(lambda x: fa.hardtanh(x), lambda x: F.hardtanh(x),
                         {"x": _x((8, 32), 2.0)}, {"x"}),
    "max_pool2d": _fn_case(lambda x: fp.max_pool2d(x, 2), lambda x: F.max_pool2d(x, 2),
                           {"x": _x((2, 3, 6, 6))}, {"x"}),
    "avg_pool2d": _fn_case(lambda x: fp.avg_pool2d(x, 3, 2, 1), lambda x: F.avg_pool2d(x, 3, 2, 1),
                           {"x": _x((2, 3, 6, 6))}, {"x"}),
    "adaptive_max_pool2d": _fn_case(lambda x: fp.adaptive_max_pool2d(x, 3),
                                    lambda x: F.adaptive_max_pool2d(x, 3),
                                    {"x": _x((2, 3, 7, 7))}, {"x"}),
    "upsample_bilinear": _fn_case(
        lambda x: fup.interpolate(x, scale_factor=2, mode="bilinear"),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), {"x": _x((2, 3, 4, 4))},
        {"x"}),
}
for _op in ("gelu", "silu", "sigmoid", "tanh", "elu", "softplus", "hardswish", "hardsigmoid",
            "mish"):
    _ref = getattr(F, _op) if hasattr(F, _op) else getattr(torch, _op)
    CASES[_op] = _fn_case(lambda x, _f=getattr(fa, _op): _f(x), lambda x, _f=_ref: _f(x),
                          {"x": _x((8, 64), 2.0)})

ATTENTION = _fn_case(lambda query, key, value: fatt.scaled_dot_product_attention(query, key, value),
                     lambda query, key, value: F.scaled_dot_product_attention(query, key, value),
                     _qkv())


def _measure(make) -> Dict[str, Tuple[float, float]]:
    """{gradient name: (z, d_eff)}; asserts exact gradients on the way."""
    draw, exact, exact_names = make()
    samples: Dict[str, list] = {}
    for k in range(K):
        torch.manual_seed(1000 + k)
        gs = draw()
        for name, gq in gs.items():
            if name.startswith("exact:"):
                continue
            ref = gs.get("exact:" + name) if exact is None else exact[name]
            if name in exact_names:
                torch.testing.assert_close(gq, ref, rtol=1e-5, atol=1e-6, msg=name)
            else:
                samples.setdefault(name, []).append(gq.reshape(-1))
    if exact is not None:
        assert set(exact) == set(gs) - {n for n in gs if n.startswith("exact:")}, \
            "every gradient the Function returns is checked"
    return {name: z_stat(torch.stack(v), exact[name].reshape(-1)) for name, v in samples.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unbiased_at_2_bits(case):
    for name, (z, d_eff) in _measure(CASES[case]).items():
        assert abs(z * z - 1) <= tolerance(d_eff), (case, name, z, d_eff)


@pytest.mark.xfail(strict=True, reason="attention's backward recomputes softmax(q_hat k_hat^T): "
                   "not linear in the rounded q, k, so biased (functional/attention.py, 'Bias')")
def test_attention_unbiased_at_2_bits():
    for name, (z, d_eff) in _measure(ATTENTION).items():
        assert abs(z * z - 1) <= tolerance(d_eff), (name, z, d_eff)


@pytest.mark.parametrize("case", ["softmax_dim1", "layernorm16", "rmsnorm", "batchnorm2d",
                                  "groupnorm"])
def test_old_bias_is_detected(case, monkeypatch):
    """Without the saved rounding variances (the behaviour before) the same statistic fails:
    the check can fail, and the correction is what passes it."""
    for module in (fsm, fnorm, frms):
        monkeypatch.setattr(module, "correct_", lambda grad_in, *a, **k: grad_in)
    # the norms' fused calls correct inside the kernel: the Python path shows the old bias
    monkeypatch.setattr(fnorm, "_BN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_LN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_GN_FORWARD", None)
    zs = _measure(CASES[case])
    z, d_eff = zs["x"]
    assert z * z - 1 > tolerance(d_eff), (case, z, d_eff)


def test_variance_sample_is_unbiased():
    """The saved estimate itself: over draws, mean of stride * v_hat at each index (0 where not
    kept) equals the exact step^2 f (1 - f) of the payload's grid."""
    from actnn_zoo.quant import quantize
    x = _seeded((4, 64), 1.0, seed=3)
    q = quantize(x, 2, 256, seed=11)
    v = (x - q.lo.float().repeat_interleave(256, 1)[:, :64]) / q.step.float().repeat_interleave(
        256, 1)[:, :64]
    f = v - v.floor()
    exact = (q.step.float().repeat_interleave(256, 1)[:, :64] ** 2 * f * (1 - f)).reshape(-1)
    acc = torch.zeros(256, dtype=torch.float64)
    n = 2000
    for k in range(n):
        torch.manual_seed(k)
        sample, codes = rv.sample_variance(q, x, "stochastic", 8)
        idx, est = rv.variance_estimate(sample, codes, x.numel())
        acc.index_add_(0, idx, est.double())
    mean = acc / n
    # per index: a 1/8 keep times a 1-bit rounding, variance <= 8 * max^2; 5 sigma
    sd = math.sqrt(8) * float(exact.max()) / math.sqrt(n)
    assert float((mean - exact.double()).abs().max()) < 5 * sd
    assert rv.sample_variance(q, x, "nearest") == (None, None)
