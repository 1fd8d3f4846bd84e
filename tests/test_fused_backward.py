"""Fused backward of the 1-bit-mask layers (quant.masked_grad) against the unfused formula.

The fused kernel reads grad_out and the packed bits in one pass; the unfused path unpacks a
bool mask and runs torch.where / a product. Gradients must be equal bit for bit (compared on
their bit patterns; NaN positions compared as NaN, since torch's own vectorised and scalar
paths write different NaN payloads for 16-bit types). Also here: the host-side debug checks of
quantize/dequantize (validate= / ACTNN_ZOO_DEBUG), which are plain Python and run on CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actnn_zoo as az
from actnn_zoo.functional import activation as A
from actnn_zoo.functional import dropout as D
from actnn_zoo.quant import SampleBits
from actnn_zoo.quant.api import _masked_grad_torch, masked_grad, pack_mask
from _ext import compiled_extension  # tests/_ext.py: skip here, fail in CI when not built

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
# (on, off) of each layer family: ReLU/Hardtanh, LeakyReLU, Dropout, and arbitrary scales.
SCALES = ((None, None), (None, 0.01), (None, -0.37), (2.0, 0.0), (1.25, -0.3), (0.5, None))


def assert_bits_equal(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan_ref, nan_got = torch.isnan(ref), torch.isnan(got)
    assert torch.equal(nan_ref, nan_got)
    iv = INT_VIEW[ref.dtype]
    r = ref.contiguous().view(iv)[~nan_ref]
    g = got.contiguous().view(iv)[~nan_got]
    assert torch.equal(r, g), f"{(r != g).sum().item()} of {r.numel()} values differ"


def _grad(shape, dtype, seed, special: bool, noncontig: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    big = list(shape)
    if noncontig:
        big[-1] = 2 * big[-1] + 1
    g = torch.randn(big, generator=gen, dtype=torch.float64).to(dtype)
    if special and g.numel() >= 6:
        flat = g.view(-1)
        flat[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40],
                                dtype=torch.float64).to(dtype)
    if noncontig:
        g = g[..., 1::2]
        assert g.numel() <= 1 or not g.is_contiguous()
    return g


# ----------------------------------------------------------------------------------------------
# The kernel against the unfused formula
# ----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 37), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES), scales=st.sampled_from(SCALES),
       seed=st.integers(0, 2 ** 16), special=st.booleans(), noncontig=st.booleans())
def test_masked_grad_matches_unfused(shape, dtype, scales, seed, special, noncontig):
    on, off = scales
    g = _grad(shape, dtype, seed, special, noncontig)
    mask = torch.rand(g.shape, generator=torch.Generator().manual_seed(seed + 1)) > 0.4
    packed = pack_mask(mask)
    ref = _masked_grad_torch(g, packed, on, off)
    got = masked_grad(g, packed, on, off)
    assert got.is_contiguous()
    assert_bits_equal(ref, got)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 64 * 1024 + 5, 300_001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_grad_sizes(n, dtype):
    # Sizes around the 32-value unit and the parallel task size of the CPU kernel.
    g = _grad((n,), dtype, n, special=True, noncontig=False)
    mask = torch.rand(n, generator=torch.Generator().manual_seed(5)) > 0.5
    packed = pack_mask(mask)
    for on, off in SCALES:
        assert_bits_equal(_masked_grad_torch(g, packed, on, off), masked_grad(g, packed, on, off))


def test_masked_grad_keeps_pass_through_payloads():
    # ReLU's pass-through moves bits as torch.where does: -0.0 and NaN payloads survive.
    g = torch.tensor([-0.0, float("nan"), -3.5, 0.0] * 9)
    g.view(torch.int32)[1] = 0x7FC01234  # a NaN with a payload
    mask = torch.ones(g.numel(), dtype=torch.bool)
    got = masked_grad(g, pack_mask(mask))
    assert torch.equal(got.view(torch.int32), g.view(torch.int32))
    off = masked_grad(g, pack_mask(~mask))
    assert torch.equal(off.view(torch.int32), torch.zeros_like(g).view(torch.int32))


def test_masked_grad_rejects_wrong_size():
    with pytest.raises(ValueError, match="does not hold"):
        masked_grad(torch.zeros(17), torch.zeros(2, dtype=torch.uint8))


def test_masked_grad_differentiable_under_create_graph():
    # With create_graph the torch formula runs, so the result has a graph (linear in grad).
    g = torch.randn(40, requires_grad=True)
    packed = pack_mask(torch.arange(40) % 3 == 0)
    with torch.enable_grad():
        out = masked_grad(g, packed, None, 0.1)
    assert out.grad_fn is not None
    (gg,) = torch.autograd.grad(out.sum(), g)
    expected = torch.where(torch.arange(40) % 3 == 0, 1.0, 0.1)
    assert torch.equal(gg, expected.float())


def test_masked_grad_uses_the_kernel():
    # The fused path is what runs with the extension: it shows up as its profiler scope.
    assert hasattr(compiled_extension(), "masked_grad")  # skips (fails in CI) when not built
    g = torch.randn(1000)
    packed = pack_mask(g > 0)
    with torch.profiler.profile() as prof:
        masked_grad(g, packed)
    names = {e.key for e in prof.key_averages()}
    assert "actnn_zoo::masked_grad" in names
    assert "aten::where" not in names


# ----------------------------------------------------------------------------------------------
# The layers: fused backward equals the unfused formula and torch's own gradient
# ----------------------------------------------------------------------------------------------
def _unfused_mask_backward(x: torch.Tensor, op: str, a: float, b: float,
                           grad: torch.Tensor) -> torch.Tensor:
    """What MaskActivationFunction.backward computed before the fused kernel."""
    if op == "relu":
        mask, other = ~(x <= 0), 0.0
    elif op == "leaky_relu":
        mask, other = x > 0, a
    else:
        mask, other = (x > A._bound(a, x.dtype, False)) & (x < A._bound(b, x.dtype, True)), 0.0
    perm = A.memory_perm(x)
    m = A.to_memory_order(mask, perm)
    packed, mshape = pack_mask(m), m.shape
    mask = A.load_mask(packed, mshape, perm)
    return torch.where(mask, grad, 0.0) if other == 0.0 else torch.where(mask, grad, grad * other)


MASK_OPS = [("relu", 0.0, 0.0, lambda x: F.relu(x)),
            ("leaky_relu", 0.2, 0.0, lambda x: F.leaky_relu(x, 0.2)),
            ("leaky_relu", -1.5, 0.0, lambda x: F.leaky_relu(x, -1.5)),
            ("hardtanh", -0.5, 0.7, lambda x: F.hardtanh(x, -0.5, 0.7)),
            ("hardtanh", 0.0, 6.0, lambda x: F.relu6(x))]


@pytest.mark.parametrize("op,a,b,torch_fn", MASK_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontig_grad"])
def test_mask_activation_backward_fused(op, a, b, torch_fn, dtype, layout):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 5, 7, 9, generator=gen) * 3).to(dtype)  # 945 values: not a multiple of 8
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(3, 5, 7, 9, generator=gen).to(dtype)
    if layout == "noncontig_grad":
        g = torch.randn(3, 5, 9, 7, generator=gen).to(dtype).transpose(2, 3)
    elif layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    leaf = x.clone().requires_grad_(True)
    out = A.MaskActivationFunction.apply(leaf, op, a, b, False)
    (got,) = torch.autograd.grad(out, leaf, g)
    assert_bits_equal(_unfused_mask_backward(x, op, a, b, g), got)
    ref_leaf = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(torch_fn(ref_leaf), ref_leaf, g)
    assert_bits_equal(ref, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.37])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "noncontig_grad"])
def test_dropout_backward_fused(dtype, p, layout):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 5, 7, generator=gen).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(2, 3, 5, 7, generator=gen).to(dtype)
    g.view(-1)[:3] = torch.tensor([float("inf"), -1.0, float("nan")]).to(dtype)
    if layout == "noncontig_grad":
        g = torch.randn(2, 3, 7, 5, generator=gen).to(dtype).transpose(2, 3)
    grads = []
    for fn in (D.dropout, F.dropout):
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(3)
        out = fn(leaf, p) if fn is D.dropout else fn(leaf, p, True)
        (gi,) = torch.autograd.grad(out, leaf, g)
        grads.append(gi)
    assert_bits_equal(grads[1], grads[0])


def test_feature_dropout_backward_unchanged():
    x = torch.randn(4, 6, 5, 5)
    g = torch.randn(4, 6, 5, 5)
    grads = []
    for fn in (D.dropout2d, F.dropout2d):
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        out = fn(leaf, 0.3) if fn is D.dropout2d else fn(leaf, 0.3, True)
        grads.append(torch.autograd.grad(out, leaf, g)[0])
    assert_bits_equal(grads[1], grads[0])


# ----------------------------------------------------------------------------------------------
# Debug checks of widths (validate= / ACTNN_ZOO_DEBUG): the Python side, on CPU
# ----------------------------------------------------------------------------------------------
def _mixed_q():
    x = torch.randn(4, 100)
    bits = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)
    return x, az.quantize(x, bits, 32, seed=1)


def test_debug_flag_reads_environment(monkeypatch):
    from actnn_zoo.quant.api import debug_checks

    monkeypatch.delenv("ACTNN_ZOO_DEBUG", raising=False)
    assert not debug_checks()
    monkeypatch.setenv("ACTNN_ZOO_DEBUG", "1")
    assert debug_checks()
    assert not debug_checks(False)
    monkeypatch.setenv("ACTNN_ZOO_DEBUG", "0")
    assert not debug_checks()
    assert debug_checks(True)


_FLAG_VALUES = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=8),
    st.builds(lambda pad1, word, pad2: pad1 + word + pad2,
              st.text(" \t\n\r\x0b\x0c\xa0\u2003", max_size=3),
              st.sampled_from(["1", "true", "TRUE", "Yes", "oN", "on", "0", "no", "off", "2",
                               "tru", "yes!", "\u212aon"]),
              st.text(" \t\n\r\x0b\x0c\xa0", max_size=3)))


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.none(), _FLAG_VALUES))
def test_env_flag_compiled_reads_as_its_python_twin(value):
    """quant.api.env_flag (the extension's getenv, what debug_checks asks at every quantize)
    answers as env_flag_python for any value, unset included: 1/true/yes/on with ASCII case
    and surrounding ASCII whitespace ignored, nothing else (a no-break space around "on" is
    not whitespace to either)."""
    import os

    from actnn_zoo.quant import api

    C = compiled_extension("env_flag")
    assert api.env_flag is C.env_flag
    name = "ACTNN_ZOO_TEST_FLAG"
    with pytest.MonkeyPatch.context() as mp:
        if value is None:
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, value)
        want = value is not None and value.strip(" \t\n\r\x0b\x0c").lower() in (
            "1", "true", "yes", "on") and value.isascii()
        assert api.env_flag_python(name) == want
        assert C.env_flag(name) == want, (value, os.environ.get(name))


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_dequantize_validates_widths(how, monkeypatch):
    x, q = _mixed_q()
    bad_bits = q.row_bits.clone()
    bad_bits[2] = 3
    bad = type(q)(q.data, q.lo, q.step, q.shape, q.dtype, None, q.group_size, bad_bits,
                  q.offsets)
    kwargs = {}
    if how == "argument":
        kwargs["validate"] = True
    else:
        monkeypatch.setenv("ACTNN_ZOO_DEBUG", "1")
    with pytest.raises(ValueError, match=r"debug check"):
        az.dequantize(bad, **kwargs)
    az.dequantize(q, **kwargs)  # a valid one passes


def test_dequantize_validates_offsets():
    _, q = _mixed_q()
    off = q.offsets.clone()
    off[-1] = q.data.numel() + 8
    bad = type(q)(q.data, q.lo, q.step, q.shape, q.dtype, None, q.group_size, q.row_bits, off)
    with pytest.raises(ValueError, match=r"debug check"):
        az.dequantize(bad, validate=True)


def test_quantize_validates_sample_bits(monkeypatch):
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"debug check"):
        az.quantize(x, SampleBits(torch.tensor([2, 5, 2], dtype=torch.uint8), 16), validate=True)
    monkeypatch.setenv("ACTNN_ZOO_DEBUG", "true")
    with pytest.raises(ValueError, match=r"max_sum.*debug check"):
        az.quantize(x, SampleBits(torch.tensor([8, 8, 2], dtype=torch.uint8), 6))
    az.quantize(x, SampleBits(torch.tensor([8, 8, 2], dtype=torch.uint8), 18))
