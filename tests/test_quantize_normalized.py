"""``quant.quantize_normalized``: a norm's normalized input quantized without making it.

The fused CPU kernel (``_C.quantize_affine``) against quantizing the normalized copy torch's way
((x - mean) * invstd in float32) with the same seed, bit for bit (hypothesis over shapes,
dtypes, widths, group sizes, rounding, and batch-, layer- and group-norm statistics); the
fallback where the kernel is missing; bad input; and the norm layers taking the fused path with
the same seeds, so their gradients are bit-identical to the unfused path's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo.quant.api as api
from actnn_zoo import convert_model
from actnn_zoo.quant import SampleBits, dequantize, quantize, quantize_normalized

from _ext import compiled_extension


def _normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    return (x.float() - mean).mul_(invstd)


def _stats(x: torch.Tensor, kind: str = "batch"):
    """(mean, invstd) shaped to broadcast: per channel (batch norm), per row of the last dim
    (layer norm) or per (sample, channel) (group norm with one channel per group)."""
    dims = {"batch": [0] + list(range(2, x.dim())), "layer": [x.dim() - 1],
            "group": list(range(2, x.dim()))}[kind]
    if kind == "group" and x.dim() == 2:
        dims = [1]
    var, mean = torch.var_mean(x.float(), dims, correction=0, keepdim=True)
    return mean, torch.rsqrt(var + 1e-5)


def _same(a, b) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.bits == b.bits and a.group_size == b.group_size
    for name in ("data", "lo", "step", "row_bits", "offsets"):
        u, v = getattr(a, name), getattr(b, name)
        if u is None or v is None:
            assert u is None and v is None, name
            continue
        if u.dtype == torch.bfloat16:
            u, v = u.view(torch.int16), v.view(torch.int16)
        assert torch.equal(u, v), name


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), c=st.integers(1, 9), spatial=st.sampled_from([(), (5,), (3, 7), (4, 4)]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       widths=st.sampled_from(["1", "2", "4", "8", "tensor", "sample"]),
       group=st.sampled_from([8, 64, 256]), seed=st.integers(0, 2 ** 31 - 1),
       stochastic=st.booleans(), kind=st.sampled_from(["batch", "layer", "group"]))
def test_fused_kernel_equals_quantizing_the_normalized_copy(n, c, spatial, dtype, widths, group,
                                                            seed, stochastic, kind):
    compiled_extension()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, c) + spatial, generator=g) * 3 + 1).to(dtype)
    mean, invstd = _stats(x, kind)
    if widths == "tensor":
        bits = torch.tensor([1, 2, 4, 8, 2, 4][:n], dtype=torch.uint8)
    elif widths == "sample":
        b = torch.tensor([2, 4, 1, 8, 2, 2][:n], dtype=torch.uint8)
        bits = SampleBits(b, int(b.sum()) + 3)
    else:
        bits = int(widths)
    rounding = "stochastic" if stochastic else "nearest"
    assert api.has_normalized_kernel(x.device)
    got = quantize_normalized(x, mean, invstd, bits, group, seed=seed, rounding=rounding)
    want = quantize(_normalized(x, mean, invstd), bits, group, seed=seed, rounding=rounding)
    _same(got, want)
    assert torch.equal(dequantize(got), dequantize(want))


def test_fallback_without_the_kernel_gives_the_same_codes(monkeypatch):
    x = torch.randn(4, 6, 5, 5) * 2
    mean, invstd = _stats(x)
    fused = quantize_normalized(x, mean, invstd, 2, 64, seed=7)
    monkeypatch.setattr(api, "has_normalized_kernel", lambda device: False)
    plain = quantize_normalized(x, mean, invstd, 2, 64, seed=7)
    _same(fused, plain)


def test_bad_input_is_named():
    x = torch.randn(4, 6, 5, 5)
    mean, invstd = _stats(x)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_normalized(x.transpose(2, 3), mean, invstd, 2)
    with pytest.raises(ValueError, match="per channel"):
        quantize_normalized(x, mean[:, :5], invstd[:, :5], 2)
    with pytest.raises(ValueError, match="per channel"):  # a statistic per width position
        quantize_normalized(x, torch.zeros(1, 1, 1, 5), torch.ones(1, 1, 1, 5), 2)
    with pytest.raises(ValueError, match="one shape"):
        quantize_normalized(x, mean, invstd.view(6), 2)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quantize_normalized(x.double(), mean, invstd, 2)
    with pytest.raises(ValueError, match="bits"):
        quantize_normalized(x, mean, invstd, 3)
    with pytest.raises(ValueError, match="shift and scale"):  # 6 channels of 25: 6 pairs
        compiled_extension().quantize_affine(
            x.reshape(4, -1), torch.zeros(5), torch.ones(6), 0, 25,
            torch.full((4,), 2, dtype=torch.uint8), torch.arange(5) * 38, 4 * 38, 64, 0, True)
    with pytest.raises(ValueError, match="block"):
        compiled_extension().quantize_affine(
            x.reshape(4, -1), torch.zeros(6), torch.ones(6), 0, 0,
            torch.full((4,), 2, dtype=torch.uint8), torch.arange(5) * 38, 4 * 38, 64, 0, True)


@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("strategy", ["uniform", "default"])
def test_norms_use_it_with_the_same_seeds_and_gradients(monkeypatch, capture, strategy):
    """The fused path draws the same seed at the same point as quantizing the made copy, so a
    converted CNN's gradients are bit-identical either way (small maps: one quantize call).
    The norms' fused calls, which normalize the same way (tests/test_norm_fused.py), are off."""
    compiled_extension()
    import actnn_zoo.functional.norm as fnorm
    monkeypatch.setattr(fnorm, "_BN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_LN_FORWARD", None)
    monkeypatch.setattr(fnorm, "_GN_FORWARD", None)
    calls = []
    real = api.quantize_normalized
    import actnn_zoo.functional._saving as saving

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "quantize_normalized", counting)

    def grads(fused: bool):
        monkeypatch.setattr(saving, "normalizes_in_kernel",
                            api.normalizes_in_kernel if fused else (lambda *args: False))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 6 * 6, 4), nn.LayerNorm(4))
        kw = {"bits": 2, "strategy": "uniform"} if strategy == "uniform" else {}
        model = convert_model(model, capture=capture, **kw)
        x = torch.randn(8, 3, 6, 6)
        torch.manual_seed(1)
        for _ in range(2):  # the strategy sees a first step
            model.zero_grad()
            model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    fused = grads(True)
    assert len(calls) == 6  # batch, group and layer norm, two steps
    plain = grads(False)
    assert len(calls) == 6
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
