"""compressor: division (DIVISION, ICLR 2023): dual-precision feature maps.

Round trips are unbiased (mean of K draws -> x within 5 standard errors of the worst case
step / 2 per draw), exact on constant maps, for any map size and 1-D / 2-D / 3-D maps; the
compiled kernel equals the torch reference bit for bit (codes, low part, ranges,
reconstruction) given a seed; per-sample widths; a converted CNN's weight gradients are close
to fp32 at 8 bits and unbiased at 2 bits; bad config values raise naming the key.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.config import LayerQConfig, QuantConfig
from actnn_zoo.functional._saving import compress, restore
from actnn_zoo.quant import QuantizedTensor, SampleBits
from actnn_zoo.quant import division_reference as ref
from actnn_zoo.quant.reference import row_offsets
from actnn_zoo.quant.division import (MIN_MAP_VALUES, DivisionTensor, as_5d,
                                      division_dequantize, division_quantize, has_low_part)

SHAPES = [(2, 3, 1, 1), (2, 3, 7, 7), (3, 2, 8, 8), (2, 2, 9, 13), (1, 4, 17, 5),
          (2, 3, 1), (2, 2, 20), (2, 2, 3, 9, 10), (1, 2, 1, 1, 1), (2, 1, 33, 16)]


def _step_per_value(q: DivisionTensor) -> torch.Tensor:
    """Each value's residual step (the per-map step broadcast over the map)."""
    view = (*q.shape[:2],) + (1,) * (len(q.shape) - 2)
    return q.step.float().view(view).expand(q.shape)


def _map_data(shape, seed=0):
    """Feature-map-like data: a smooth trend per map plus noise, a scale per channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    trend = torch.linspace(-2, 3, shape[-1]).expand(shape)
    return x * 0.3 + trend + torch.randn(shape[:2] + (1,) * (len(shape) - 2), generator=g) * 4


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_below_one_step_for_any_map_size(shape):
    x = _map_data(shape)
    q = division_quantize(x, 2, seed=1)
    assert q.has_low == has_low_part(x.shape, 8)
    err = (division_dequantize(q) - x).abs()
    assert bool((err <= _step_per_value(q) * (1 + 2 ** -8) + 1e-6).all())


@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (2, 2, 19, 11), (2, 3, 21), (1, 2, 3, 9, 10)])
def test_round_trip_is_unbiased(shape):
    """K = 256 draws; per value Var <= step^2 / 4, so |mean - x| <= 5 step / (2 sqrt K)."""
    x = _map_data(shape, 3)
    k = 256
    acc = torch.zeros(shape, dtype=torch.float64)
    for seed in range(k):
        q = division_quantize(x, 2, seed=seed)
        acc += division_dequantize(q).double()
    bound = 5 * _step_per_value(q).double() / (2 * math.sqrt(k)) + 1e-6
    assert bool(((acc / k - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_on_constant_maps(shape, dtype):
    """Arbitrary per-map constants (not bf16 values): reconstructed exactly, any width."""
    g = torch.Generator().manual_seed(7)
    c = torch.randn(shape[:2] + (1,) * (len(shape) - 2), generator=g) * 3.3
    x = c.expand(shape).to(dtype).contiguous()
    for bits in (1, 2, 8):
        q = division_quantize(x, bits)
        assert torch.equal(division_dequantize(q), x)


def test_constant_maps_exact_next_to_varying_ones():
    x = _map_data((2, 4, 12, 12))
    x[0, 1] = 0.1234567
    x[1, 3] = -7.000001
    y = division_dequantize(division_quantize(x, 2))
    assert torch.equal(y[0, 1], x[0, 1]) and torch.equal(y[1, 3], x[1, 3])


def test_rejects_what_is_not_a_feature_map():
    with pytest.raises(ValueError, match="feature maps"):
        division_quantize(torch.randn(4, 5), 2)
    with pytest.raises(ValueError, match="block"):
        division_quantize(torch.randn(2, 2, 4, 4), 2, block=0)
    with pytest.raises(ValueError, match="bits"):
        division_quantize(torch.randn(2, 2, 4, 4), 3)


def test_nan_map_reconstructs_as_nan_only_there():
    x = _map_data((2, 3, 10, 10))
    x[1, 2, 3, 4] = float("nan")
    y = division_dequantize(division_quantize(x, 2))
    assert bool(y[1, 2].isnan().all())
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    assert bool(y[mask].isfinite().all())


def test_per_sample_widths():
    """Row n at its own width: the same ranges as a uniform call at that width, error within
    one step, and the bytes of the mixed payload equal the sum of the rows' code bytes."""
    x = _map_data((4, 3, 11, 9))
    widths = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)
    for bits in (widths, SampleBits(widths, 15)):
        q = division_quantize(x, bits, seed=5)
        assert q.mixed and torch.equal(q.row_bits, widths)
        for n, b in enumerate(widths.tolist()):
            u = division_quantize(x, b, seed=5)
            assert torch.equal(q.step[n], u.step[n]) and torch.equal(q.lo[n], u.lo[n])
        err = (division_dequantize(q) - x).abs()
        assert bool((err <= _step_per_value(q) * (1 + 2 ** -8) + 1e-6).all())
    d = 3 * 11 * 9
    assert division_quantize(x, widths).data.numel() == sum((d * b + 7) // 8 for b in
                                                             (1, 2, 4, 8))
    # narrower rows are noisier: the mean error falls with the width
    errs = [(division_dequantize(division_quantize(x, widths, seed=s)) - x).square()
            .mean(dim=(1, 2, 3)) for s in range(8)]
    e = torch.stack(errs).mean(0)
    assert bool((e[1:] < e[:-1]).all())


def test_payload_is_smaller_than_uniform_at_the_same_width_on_large_maps():
    """32x32 maps at 2 bits: codes 2 + low 16/64 + ranges 48/1024 bits per value."""
    x = _map_data((2, 8, 32, 32))
    q = division_quantize(x, 2)
    assert abs(q.bits_per_value - (2 + 16 / 64 + 48 / 1024)) < 1e-9
    # and its error is far below plain 2-bit quantization's on smooth maps
    y = az.dequantize(az.quantize(x, 2))
    assert (division_dequantize(q) - x).square().mean() < 0.5 * (y - x).square().mean()


# ---------------------------------------------------------------------------- kernel parity
def _compiled():
    from _ext import compiled_extension

    return compiled_extension("division_quantize", "division_dequantize")


def _both(x, bits, block, seed, stochastic=True):
    """(compiled, reference) results of division_quantize on x."""
    ext = _compiled()
    n = x.shape[0]
    d = x.shape[1:].numel()
    widths = bits if isinstance(bits, torch.Tensor) else torch.full((n,), bits, dtype=torch.uint8)
    offsets = row_offsets(d, widths)
    total = int(offsets[-1])
    x5 = x.contiguous().view(as_5d(x.shape))
    has_low = has_low_part(x.shape, block)
    a = ext.division_quantize(x5, widths, offsets, total, block, has_low, seed, stochastic)
    b = ref.division_quantize(x5, widths, offsets, total, block, has_low, seed, stochastic)
    return a, b, (widths, offsets, block, has_low, x5)


def _assert_same(a, b):
    data, low, lo, step = a
    rdata, rlow, rlo, rstep = b
    assert torch.equal(data, rdata)
    assert low.shape == rlow.shape  # bit for bit, NaN payload bits aside
    assert torch.equal(low.float().isnan(), rlow.float().isnan())
    assert torch.equal(low.float().nan_to_num(), rlow.float().nan_to_num())
    assert torch.equal(lo.isnan(), rlo.isnan()) and torch.equal(lo.nan_to_num(), rlo.nan_to_num())
    assert torch.equal(step.float().isnan(), rstep.float().isnan())
    assert torch.equal(step.float().nan_to_num(), rstep.float().nan_to_num())


def _assert_same_reconstruction(a, meta):
    widths, offsets, block, has_low, x5 = meta
    ext = _compiled()
    out_c, out_r = torch.empty_like(x5), torch.empty_like(x5)
    ext.division_dequantize(a[0], a[1], a[2], a[3], widths, offsets, block, has_low, out_c)
    ref.division_dequantize(a[0], a[1], a[2], a[3], widths, offsets, block, has_low, out_r)
    assert torch.equal(out_c.isnan(), out_r.isnan())
    assert torch.equal(out_c.nan_to_num(), out_r.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference(shape, dtype):
    x = _map_data(shape).to(dtype)
    for bits in (2, torch.tensor([8, 1, 4][:shape[0]] + [2] * (shape[0] - 3), dtype=torch.uint8)
                 [:shape[0]]):
        a, b, meta = _both(x, bits, 8, 1234)
        _assert_same(a, b)
        _assert_same_reconstruction(a, meta)
    a, b, _ = _both(x, 2, 8, 0, stochastic=False)
    _assert_same(a, b)


def test_kernel_equals_reference_with_nan_and_inf():
    x = _map_data((2, 3, 12, 10))
    x[0, 1, 2, 3], x[1, 2, 9, 9] = float("nan"), float("inf")
    a, b, meta = _both(x, 2, 8, 9)
    _assert_same(a, b)
    _assert_same_reconstruction(a, meta)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 10),
       spatial=st.lists(st.integers(1, 19), min_size=1, max_size=3),
       block=st.sampled_from([1, 2, 3, 8]), bits=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2 ** 31 - 2), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_kernel_equals_reference_hypothesis(n, c, spatial, block, bits, seed, scale):
    shape = (n, c, *spatial)
    x = _map_data(shape, seed % 1000) * scale
    a, b, meta = _both(x, bits, block, seed)
    _assert_same(a, b)
    _assert_same_reconstruction(a, meta)
    # and the public round trip stays within one step
    q = division_quantize(x, bits, block, seed=seed)
    err = (division_dequantize(q) - x).abs()
    assert bool((err <= _step_per_value(q) * (1 + 2 ** -8) + 1e-6 * scale).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_kernel_equals_cpu():
    for shape in SHAPES:
        x = _map_data(shape)
        for bits in (1, 2, 8):
            a = division_quantize(x, bits, seed=3)
            b = division_quantize(x.cuda(), bits, seed=3)
            assert torch.equal(a.data, b.data.cpu()) and torch.equal(a.lo, b.lo.cpu())
            assert torch.equal(a.step, b.step.cpu()) and torch.equal(a.low, b.low.cpu())
            assert torch.equal(division_dequantize(a), division_dequantize(b).cpu())


# ---------------------------------------------------------------------------- integration
def test_compress_picks_division_for_feature_maps_only():
    cfg = LayerQConfig(bits=2, compressor="division")
    assert isinstance(compress(torch.randn(2, 3, 9, 9), cfg), DivisionTensor)
    assert isinstance(compress(torch.randn(2, 3, 50), cfg, maps=True), DivisionTensor)
    assert isinstance(compress(torch.randn(2, 3, 4, 5, 6, dtype=torch.float64), cfg),
                      DivisionTensor)
    # maps of fewer than MIN_MAP_VALUES values: their own range would cost > 1 bit per value
    assert MIN_MAP_VALUES == 48
    assert isinstance(compress(torch.randn(2, 3, 47), cfg, maps=True), QuantizedTensor)
    assert isinstance(compress(torch.randn(2, 3, 4, 4), cfg), QuantizedTensor)
    assert isinstance(compress(torch.randn(2, 3, 8, 6), cfg), DivisionTensor)
    assert isinstance(compress(torch.randn(6, 300), cfg), QuantizedTensor)
    assert isinstance(compress(torch.randn(2, 3, 9, 9), LayerQConfig()), QuantizedTensor)
    x = torch.randn(2, 3, 9, 9)
    assert restore(compress(x, cfg)).shape == x.shape


def test_layout_decides_what_is_a_map():
    """A layer that knows its tensor is features last (Linear, LayerNorm, attention) never
    uses DIVISION; one that does not know (an activation, tier 3) uses it on 4-D and 5-D
    tensors only, since a 3-D one is as likely (B, T, C) tokens as an (N, C, L) map."""
    cfg = LayerQConfig(bits=2, compressor="division")
    tokens, image = torch.randn(2, 64, 96), torch.randn(2, 3, 9, 9)
    assert isinstance(compress(tokens, cfg), QuantizedTensor)
    assert isinstance(compress(tokens, cfg, maps=True), DivisionTensor)
    assert isinstance(compress(image, cfg, maps=False), QuantizedTensor)
    assert isinstance(compress(image, cfg, maps=None), DivisionTensor)
    assert isinstance(compress(torch.randn(2, 3, 4, 5, 6), cfg, maps=False), QuantizedTensor)


def _division_shapes(monkeypatch, model: nn.Module, x: torch.Tensor) -> list:
    """Shapes of the tensors ``model``'s training step sent to DIVISION."""
    import actnn_zoo.functional._saving as saving

    seen = []

    def spy(t, *args, **kwargs):
        seen.append(tuple(t.shape))
        return division_quantize(t, *args, **kwargs)

    monkeypatch.setattr(saving, "division_quantize", spy)
    out = model(x)
    out.float().sum().backward()
    return seen


def test_transformer_tokens_take_the_group_quantizer_and_conv1d_maps_division(monkeypatch):
    """End to end: a converted character transformer (Linear, LayerNorm, GELU, attention and
    softmax over (B, T, C) and (B, H, T, T)) sends nothing to DIVISION; a Conv1d classifier
    sends its convolutions' and batch norms' (N, C, L) inputs."""
    from actnn_zoo.models import CharTransformer, Conv1dNet

    torch.manual_seed(0)
    text = az.convert_model(CharTransformer(vocab_size=40, d_model=32, n_heads=2,
                                            context=64, dropout=0.0),
                            strategy="uniform", bits=2, compressor="division")
    assert _division_shapes(monkeypatch, text, torch.randint(0, 40, (2, 64))) == []
    conv = az.convert_model(Conv1dNet(width=8), strategy="uniform", bits=2,
                            compressor="division")
    shapes = _division_shapes(monkeypatch, conv, torch.randn(4, 1, 128))
    assert (4, 1, 128) in shapes and (4, 8, 128) in shapes  # stem conv input, BN's x_hat
    assert all(len(s) == 3 for s in shapes)


class _Net(nn.Module):
    """Conv-BN-ReLU-conv with a shortcut conv reading the same input (the store shares it), on
    20x12 maps (8 + 8 + 4 by 8 + 4: ragged low-part blocks), then pool and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.short = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = self.relu(self.bn(self.conv1(x)))
        h = F.gelu(self.conv2(h) + self.short(h))
        return self.fc(h.mean(dim=(2, 3)))


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters()
                      if n.endswith("weight") and p.dim() > 1])


def _setup():
    torch.manual_seed(0)
    base = _Net()
    x = torch.randn(16, 3, 20, 12) + torch.linspace(-1, 1, 12)
    y = torch.randint(0, 5, (16,))
    return base, x, y, _grads(copy.deepcopy(base), x, y)


def test_converted_cnn_close_to_fp32_at_8_bits():
    base, x, y, exact = _setup()
    model = az.convert_model(copy.deepcopy(base), strategy="uniform", bits=8,
                             compressor="division")
    g = _grads(model, x, y)
    assert F.cosine_similarity(g, exact, dim=0) > 0.9999
    assert (g - exact).norm() < 1e-2 * exact.norm()


def test_converted_cnn_unbiased_at_2_bits():
    """K = 48 passes: the mean error's squared norm is within 4x of its expectation under
    zero bias (the mean per-pass squared deviation / K); one pass is far from exact."""
    base, x, y, exact = _setup()
    model = az.convert_model(copy.deepcopy(base), strategy="uniform", bits=2,
                             compressor="division")
    k = 48
    errs = torch.stack([_grads(model, x, y) - exact for _ in range(k)]).double()
    mean = errs.mean(0)
    spread = (errs - mean).square().sum(1).mean()
    assert mean.square().sum() <= 4 * spread / k
    assert spread > 1e-4 * exact.double().square().sum()  # the test has noise to average


def _train(model, x, y, steps=15):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_converted_cnn_trains_like_fp32_and_shares_store_entries():
    base, x, y, _ = _setup()
    model = az.convert_model(copy.deepcopy(base), strategy="uniform", bits=2,
                             compressor="division")
    losses = _train(model, x, y)
    fp32 = _train(copy.deepcopy(base), x, y)
    assert losses[-1] < 0.85 * losses[0]
    assert abs(losses[-1] - fp32[-1]) < 0.05 * fp32[0], (losses[-1], fp32[-1])
    # conv2 and the shortcut read the same ReLU output: DIVISION ran once for both
    assert az.capture_report(model).shared >= 1


def test_division_under_a_mixed_precision_strategy():
    """'actnn' sets per-sample widths; DIVISION takes them (gradients stay finite, training
    proceeds)."""
    base, x, y, exact = _setup()
    model = az.convert_model(copy.deepcopy(base), strategy="actnn", bits=3,
                             compressor="division")
    for _ in range(3):
        g = _grads(model, x, y)
    assert bool(g.isfinite().all()) and F.cosine_similarity(g, exact, dim=0) > 0.9


# ---------------------------------------------------------------------------- config
def test_config_keys_and_errors_name_the_key(tmp_path):
    cfg = QuantConfig.from_yaml(Path(__file__).resolve().parents[1] / "configs"
                                / "division.yaml")
    assert cfg.compressor == "division" and cfg.division_block == 8
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert "compressor" not in QuantConfig().to_dict()  # optional keys stay out by default
    with pytest.raises(ValueError, match=r"compressor.*one of"):
        QuantConfig.from_dict({"compressor": "divison"})
    with pytest.raises(ValueError, match="division_block"):
        QuantConfig.from_dict({"division_block": 0})
    with pytest.raises(ValueError, match="division_block"):
        QuantConfig.from_dict({"division_block": 8.5})
    with pytest.raises(ValueError, match=r"rules\[0\]\.compressor"):
        QuantConfig.from_dict({"rules": [{"name": "x", "compressor": "dct"}]})
    with pytest.raises(ValueError, match="compressor"):
        LayerQConfig(compressor="fft")
    path = tmp_path / "bad.yaml"
    path.write_text("bits: 2\ncompressor: 3\n")
    with pytest.raises(ValueError, match=r"bad\.yaml', line 2: compressor"):
        QuantConfig.from_yaml(path)


def test_rule_sets_the_compressor_per_layer():
    cfg = QuantConfig.from_dict({"strategy": "uniform", "compressor": "division",
                                 "division_block": 4,
                                 "rules": [{"name": "conv2", "compressor": "quant"}]})
    model = az.convert_model(_Net(), cfg)
    assert model.conv1.qconfig.compressor == "division"
    assert model.conv1.qconfig.division_block == 4
    assert model.conv2.qconfig.compressor == "quant"


def _kernel_cases():
    """Bad arguments for the extension's DIVISION entries, one per check of
    cpp_ext/division_checks.h (shared with the CUDA entries; tests/test_cuda.py runs the same
    cases there), each as (entry, good arguments, index, bad value)."""
    from actnn_zoo.quant import reference as R

    x5 = torch.randn(2, 3, 4, 4, 1)
    b = torch.full((2,), 2, dtype=torch.uint8)
    off = R.row_offsets(48, b)
    q = [x5, b, off, int(off[-1]), 2, True, 0, True]
    cases = [("division_quantize", q, i, bad) for i, bad in [
        (0, x5.double()), (0, x5.reshape(2, 3, 16)), (0, x5.transpose(2, 3)), (1, b[:1]),
        (2, off.int()), (3, -1), (4, 0)]]
    data, low, lo, step = _ext().division_quantize(*q)
    d = [data, low, lo, step, b, off, 2, True, torch.empty_like(x5)]
    cases += [("division_dequantize", d, i, bad) for i, bad in [
        (1, low[:1]), (2, lo[:1]), (3, step.float()), (4, b[:1]),
        (8, torch.empty(2, 3, 16))]]
    return cases


def _ext():
    from actnn_zoo.quant import backend

    ext = backend.extension()
    if ext is None or not hasattr(ext, "division_quantize"):
        pytest.skip("the compiled extension is not built")
    return ext


def test_kernel_entries_reject_bad_arguments():
    """Every bad argument raises a clear error (never a crash or a silent result), and the good
    ones pass, on the CPU kernels; the CUDA entries run the same shared checks."""
    ext = _ext()
    cases = _kernel_cases()
    ext.division_dequantize(*cases[-1][1])  # the good arguments work
    for entry, good, i, bad in cases:
        args = list(good)
        args[i] = bad
        with pytest.raises((RuntimeError, ValueError)):
            getattr(ext, entry)(*args)
