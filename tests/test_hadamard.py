"""The randomized Walsh-Hadamard transform per group (actnn_zoo.quant.hadamard, _C.hadamard_):
its definition, exact inversion, the C++ kernel against the torch specification, unbiased
quantization through it, and the ``transform`` configuration key."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.config import LayerQConfig, QuantConfig
from actnn_zoo.quant import SampleBits, dequantize, quantize
from actnn_zoo.quant.hadamard import hadamard_, hadamard_reference, signs

from _ext import compiled_extension


def dense_hadamard(g: int) -> torch.Tensor:
    """Sylvester's H_g in float64, built by Kronecker products (independent of the butterfly)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < g:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("g", [32, 256, 1024])
def test_forward_is_the_normalized_hadamard_matrix_with_random_signs(g):
    torch.manual_seed(0)
    x = torch.randn(3, 3 * g + 17)  # 3 full groups and a 17-column tail
    y = hadamard_(x.clone(), g, seed=5)
    s = signs(3 * g, 5).double().view(3, g)
    want = (x[:, :3 * g].double().view(3, 3, g) * s) @ dense_hadamard(g).T / math.sqrt(g)
    torch.testing.assert_close(y[:, :3 * g].double().view(3, 3, g), want, rtol=0, atol=1e-5)
    assert torch.equal(y[:, 3 * g:], x[:, 3 * g:])  # the tail is left as it is
    # signs are +-1, about half negative, and differ between seeds
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert not torch.equal(signs(3 * g, 5), signs(3 * g, 6))


@pytest.mark.parametrize("g", [32, 64, 512, 8192])
def test_round_trip_exact_to_float_rounding(g):
    """inverse(forward(x)) == x up to log2(g) float32 additions per value: the error bound is
    2 * log2(g) * eps * the group's largest magnitude (measured errors are ~10x smaller)."""
    torch.manual_seed(1)
    x = torch.randn(4, 2 * g) * torch.logspace(-3, 3, 2 * g)[torch.randperm(2 * g)]
    y = hadamard_(x.clone(), g, seed=11)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=0)  # orthogonal
    z = hadamard_(y, g, seed=11, inverse=True)
    bound = 2 * math.log2(g) * torch.finfo(torch.float32).eps * \
        x.view(4, 2, g).abs().amax(-1, keepdim=True).expand(4, 2, g).reshape(4, 2 * g)
    assert ((z - x).abs() <= bound).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 5), d=st.integers(0, 2100), log_g=st.integers(5, 11),
       seed=st.integers(0, 2 ** 32 - 1), inverse=st.booleans())
def test_cpp_kernel_matches_torch_reference_bit_for_bit(n, d, log_g, seed, inverse):
    C = compiled_extension()
    g = 2 ** log_g
    x = torch.randn(n, d) * 10
    want = hadamard_reference(x, g, seed, inverse)
    got = C.hadamard_(x.clone(), g, seed, inverse)
    assert torch.equal(got, want)


def test_kernel_rejects_bad_arguments():
    C = compiled_extension()
    with pytest.raises(RuntimeError, match="group_size must be a power of two"):
        C.hadamard_(torch.zeros(2, 96), 48, 0, False)
    with pytest.raises(RuntimeError, match="float32"):
        C.hadamard_(torch.zeros(2, 64, dtype=torch.float64), 32, 0, False)
    with pytest.raises(ValueError, match="power of two in \\[32, 8192\\]"):
        hadamard_(torch.zeros(2, 64), 16384, 0)


def _outliers(n=4, d=1024, seed=0):
    """Transformer-like rows: every 64th feature 100x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, ::64] *= 100
    return x


def test_quantization_through_the_transform_is_unbiased():
    """K = 400 two-bit draws: every element's mean is within 5 standard errors (+1e-4 for the
    bf16 metadata's 2^-24 rounding resolution) of x, and the error of the mean shrinks as
    1/sqrt(K) (RMS at K/16 over RMS at K > 3, theory 4)."""
    x = _outliers()
    k = 400
    draws = torch.stack([dequantize(quantize(x, 2, 256, seed=s, transform="hadamard"))
                         for s in range(k)])
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(k)
    assert ((mean - x).abs() <= 5 * se + 1e-4).all()
    rms = lambda m: float((draws[:m].mean(0) - x).pow(2).mean().sqrt())  # noqa: E731
    assert rms(k // 16) / rms(k) > 3


def test_transform_cuts_the_error_of_groups_with_outliers():
    """The reason it exists: with a few 100x features per group the 2-bit mean squared error
    falls (measured 950 -> 255, ratio 0.27; the test asks < 0.5) and on plain Gaussian rows it
    does not grow by more than 25%."""
    x = _outliers()
    mse = {t: float(torch.stack([(dequantize(quantize(x, 2, 256, seed=s, transform=t)) - x)
                                 .pow(2).mean() for s in range(20)]).mean())
           for t in ("none", "hadamard")}
    assert mse["hadamard"] < 0.5 * mse["none"], mse
    g = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))
    plain = {t: float(torch.stack([(dequantize(quantize(g, 2, 256, seed=s, transform=t)) - g)
                                   .pow(2).mean() for s in range(20)]).mean())
             for t in ("none", "hadamard")}
    assert plain["hadamard"] < 1.25 * plain["none"], plain


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
       extra=st.integers(0, 700), log_g=st.integers(5, 9), bits=st.sampled_from([1, 2, 4, 8]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_round_trip_any_shape_and_dtype(shape, extra, log_g, bits, dtype):
    """Any shape (the tail of a row is quantized untransformed): dequantize gives the shape and
    dtype back, and at 8 bits the values within a few steps of the rotated group's range."""
    shape = shape[:-1] + (shape[-1] + extra,)
    g = 2 ** log_g
    x = torch.randn(shape).to(dtype)
    q = quantize(x, bits, g, seed=3, transform="hadamard")
    assert q.transform == "hadamard"
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    if bits == 8 and x.numel():
        # a rotated group's range is at most 2 * sqrt(g) * max|x|; 8-bit steps of it, rotated
        # back (orthogonal), bound the error with the 16-bit dtypes' rounding on top
        err = (y.float() - x.float()).abs().max()
        assert err <= 2 * math.sqrt(g) * x.float().abs().max() / 255 * 2 + 0.02


def test_per_sample_widths_and_payload_round_trip():
    x = _outliers()
    q = quantize(x, SampleBits(torch.tensor([1, 2, 4, 8], dtype=torch.uint8), 15), 256, seed=9,
                 transform="hadamard")
    y = dequantize(q)
    assert q.mixed and y.shape == x.shape
    # spec()/rebuild() (how layers save it through ctx) keep the transform and its seed
    again = type(q).rebuild(q.spec(), q.tensors())
    assert again.transform == "hadamard" and again.transform_seed == q.transform_seed
    assert torch.equal(dequantize(again), y)
    assert "transform=hadamard" in repr(q)


# ------------------------------------------------------------------------------ configuration
def test_bad_transform_values_raise_naming_the_key():
    with pytest.raises(ValueError, match="transform must be one of \\('none', 'hadamard'\\)"):
        QuantConfig(transform="walsh")
    with pytest.raises(ValueError, match="transform"):
        QuantConfig.from_dict({"transform": 1})
    with pytest.raises(ValueError, match="rules\\[0\\]\\.transform|rules.*transform"):
        QuantConfig.from_dict({"rules": [{"type": "Linear", "transform": "fft"}]})
    with pytest.raises(ValueError, match="group_size.*power of two"):
        QuantConfig.from_dict({"transform": "hadamard", "group_size": 96})
    with pytest.raises(ValueError, match="transform"):
        LayerQConfig(transform="rotate")
    with pytest.raises(ValueError, match="group_size.*power of two"):
        LayerQConfig(transform="hadamard", group_size=96)
    with pytest.raises(ValueError, match="transform must be one of"):
        quantize(torch.randn(2, 64), 2, transform="hadamard ")
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        quantize(torch.randn(2, 64), 2, group_size=160, transform="hadamard")
    # a rule that gives a non-power-of-two group to a layer under a global 'hadamard'
    cfg = QuantConfig.from_dict({"transform": "hadamard",
                                 "rules": [{"name": "0", "group_size": 96}]})
    with pytest.raises(ValueError, match="module '0'.*group_size"):
        cfg.resolve("0", nn.Linear(4, 4))


def test_yaml_key_and_rules_choose_the_transform_per_layer():
    text = "bits: 2\ntransform: none\nrules:\n  - type: Linear\n    transform: hadamard\n"
    cfg = QuantConfig.from_yaml(io.StringIO(text))
    assert cfg.resolve("fc", nn.Linear(4, 4)).transform == "hadamard"
    assert cfg.resolve("conv", nn.Conv2d(3, 3, 3)).transform == "none"
    again = QuantConfig.from_yaml(io.StringIO(cfg.to_yaml()))
    assert again == cfg
    assert "transform" not in QuantConfig().to_dict()  # default stays out of written configs
    assert QuantConfig.from_dict({"transform": "hadamard"}).to_dict()["transform"] == "hadamard"


def test_converted_model_uses_the_transform_and_keeps_gradients():
    """A converted MLP with ``transform: hadamard``: the saved payloads carry the transform,
    8-bit gradients match fp32 (cosine > 0.999) and 2-bit gradients stay close (mean of 8
    draws, cosine > 0.95)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    x = _outliers(16, 256)
    model(x).square().mean().backward()
    exact = torch.cat([p.grad.flatten() for p in model.parameters()])

    def grads(bits, seed):
        qm = az.convert_model(copy.deepcopy(model), {"bits": bits, "strategy": "uniform",
                                                     "capture": False, "transform": "hadamard"})
        assert qm[0].qconfig.transform == "hadamard" and "transform=hadamard" in repr(qm[0])
        for p in qm.parameters():
            p.grad = None
        torch.manual_seed(seed)
        qm(x).square().mean().backward()
        return torch.cat([p.grad.flatten() for p in qm.parameters()])

    cos = lambda a, b: float(torch.nn.functional.cosine_similarity(a, b, dim=0))  # noqa: E731
    assert cos(grads(8, 0), exact) > 0.999
    assert cos(torch.stack([grads(2, s) for s in range(8)]).mean(0), exact) > 0.95
