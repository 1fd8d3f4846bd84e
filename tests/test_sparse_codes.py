"""Sparse codes (``quantize_sparse``): a mask of the nonzeros plus codes of the nonzeros only.

The compiled CPU kernels against the torch reference bit for bit (hypothesis over shapes,
widths, dtypes, zero fractions, NaN/Inf), the zeros exact and the mask equal to ``x != 0``,
unbiasedness with a stated tolerance, a group step never wider than plain codes' on a ReLU
output, the size, ReLU's backward from the mask against ``threshold_backward``, and bad input.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actnn_zoo.quant import (SampleBits, SparseQuantizedTensor, dequantize_sparse, quantize,
                             quantize_sparse, unpack_mask)
from actnn_zoo.quant import reference as R
from actnn_zoo.quant.api import masked_grad
from _ext import compiled_extension  # tests/_ext.py: skip here, fail in CI when not built


def extension():
    """The compiled sparse kernels (skips without them; fails in CI)."""
    return compiled_extension("quantize_sparse", "dequantize_sparse")


def relu_like(n: int, d: int, seed: int, zero_frac: float = 0.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).abs() * torch.rand(n, 1, generator=g) * 10
    x[torch.rand(n, d, generator=g) < zero_frac] = 0.0
    return x.to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return a.shape == b.shape and torch.equal(a, b)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(1, 700), group=st.sampled_from([8, 32, 64, 256]),
       widths=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=5, max_size=5),
       seed=st.integers(0, 2 ** 31 - 1), zero_frac=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]),
       stochastic=st.booleans(), signed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       special=st.sampled_from([None, "nan", "inf", "-0"]))
def test_compiled_matches_reference(n, d, group, widths, seed, zero_frac, stochastic, signed,
                                    dtype, special):
    x = relu_like(n, d, seed, zero_frac).float()
    if signed:  # any tensor with zeros, not only ReLU outputs
        x = x * torch.where(torch.rand(n, d, generator=torch.Generator().manual_seed(seed)) < .5,
                            -1.0, 1.0)
    if special is not None:
        x[0, d // 2] = {"nan": float("nan"), "inf": float("inf"), "-0": -0.0}[special]
    x = x.to(dtype)
    bits = torch.tensor(widths[:n], dtype=torch.uint8)
    got = extension().quantize_sparse(x, bits, group, seed, stochastic)
    want = R.quantize_sparse(x, bits, group, seed, stochastic)
    for a, b, name in zip(got, want, ("data", "lo", "step", "mask", "offsets")):
        assert _bits_equal(a, b), name
    out_c = torch.empty(n, d, dtype=dtype)
    out_r = torch.empty(n, d, dtype=dtype)
    extension().dequantize_sparse(*got[:4], bits, got[4], group, out_c)
    R.dequantize_sparse(*want[:4], bits, want[4], group, out_r)
    assert torch.equal(out_c.isnan(), out_r.isnan())
    assert torch.equal(out_c.nan_to_num(0.0), out_r.nan_to_num(0.0))


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(3, 5, 7), (2, 300), (1, 1), (4, 8, 3, 3), (6,)]),
       bits=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 10 ** 6),
       zero_frac=st.sampled_from([0.0, 0.5, 1.0]))
def test_zeros_exact_and_mask_is_nonzero(shape, bits, seed, zero_frac):
    x = relu_like(1, torch.Size(shape).numel(), seed, zero_frac).view(shape)
    q = quantize_sparse(x, bits, 64, seed=seed)
    assert torch.equal(unpack_mask(q.mask, x.shape), x != 0)
    y = dequantize_sparse(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))
    assert bool((y[x != 0] > 0).all())  # positive values keep positive levels


def test_round_trip_exact_on_constant_groups_and_nan_groups():
    x = torch.zeros(2, 64)
    x[0, ::2] = 3.0  # one nonzero value per group: its range is a point
    x[1, 5] = float("nan")
    x[1, 6] = 2.0
    y = dequantize_sparse(quantize_sparse(x, 2, 32, seed=0))
    assert torch.equal(y[0], x[0])
    assert torch.isnan(y[1, 5]) and torch.isnan(y[1, 6])  # the NaN's group decodes to NaN
    assert torch.equal(y[1, :5], torch.zeros(5)) and torch.equal(y[1, 32:], torch.zeros(32))


def test_unbiased():
    """K = 3000 draws at 2 bits: every element's mean within 5 standard errors of x, the
    standard error bounded by step / (2 sqrt(K)) (a value between two levels a step apart has
    variance at most step^2 / 4). Zeros are exact in every draw."""
    x = relu_like(4, 200, seed=1)
    k = 3000
    acc = torch.zeros_like(x, dtype=torch.float64)
    for i in range(k):
        acc += dequantize_sparse(quantize_sparse(x, 2, 64, seed=1000 + i)).double()
    mean = acc / k
    q = quantize_sparse(x, 2, 64, seed=0)  # the metadata does not depend on the seed
    step = q.step.double().repeat_interleave(64, dim=1)[:, :200]
    se = step / (2 * k ** 0.5)
    err = (mean - x.double()).abs()
    assert bool((err <= 5 * se + 1e-9).all()), float((err / (se + 1e-12)).max())
    assert torch.equal(mean[x == 0], torch.zeros_like(mean[x == 0]))
    # and the draws do vary: the estimate is not a deterministic rounding
    assert float((mean - dequantize_sparse(q).double()).abs().max()) > 0


def test_step_never_wider_than_plain_codes_on_relu_output():
    """On a non-negative tensor a group's sparse range [min nonzero, max] lies inside plain
    codes' [0, max] with the same number of levels, so its step is never wider (finer at most
    values), and at half zeros and 2 bits it takes about the bytes of plain codes."""
    x = relu_like(16, 1024, seed=3)
    sparse = quantize_sparse(x, 2, 256, seed=0)
    plain = quantize(x, 2, 256, seed=0)
    assert bool((sparse.step.float() <= plain.step.float()).all())
    assert abs(sparse.nbytes / plain.nbytes - 1.0) < 0.05, (sparse.nbytes, plain.nbytes)
    err_s = err_p = 0.0
    for i in range(20):
        err_s += float((dequantize_sparse(quantize_sparse(x, 2, 256, seed=i)) - x).square().sum())
        from actnn_zoo.quant import dequantize
        err_p += float((dequantize(quantize(x, 2, 256, seed=i)) - x).square().sum())
    assert err_s < err_p


def test_per_sample_widths_and_determinism():
    x = relu_like(4, 300, seed=5)
    sb = SampleBits(torch.tensor([1, 2, 4, 8], dtype=torch.uint8), 15)
    a, b = quantize_sparse(x, sb, 64, seed=9), quantize_sparse(x, sb, 64, seed=9)
    assert torch.equal(a.data, b.data) and torch.equal(a.offsets, b.offsets)
    assert a.row_bits.tolist() == [1, 2, 4, 8]
    counts = (x != 0).sum(1)
    sizes = (counts * torch.tensor([1, 2, 4, 8]) + 7) // 8
    assert a.offsets.tolist() == [0] + torch.cumsum(sizes, 0).tolist()
    # 8 bits: every decoded value within one step of x
    y = dequantize_sparse(a)
    step = a.step.float().repeat_interleave(64, dim=1)[:, :300]
    assert bool(((y - x).abs() <= step + 1e-6)[3].all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_relu_backward_from_the_mask_equals_threshold_backward(dtype):
    torch.manual_seed(0)
    pre = torch.randn(8, 33, dtype=dtype)
    pre[0, 0] = float("nan")
    out = torch.relu(pre)
    grad = torch.randn(8, 33, dtype=dtype)
    want = torch.ops.aten.threshold_backward(grad, out, 0)
    q = quantize_sparse(out.float() if dtype == torch.float64 else out, 2, 32, seed=1)
    got = masked_grad(grad, q.mask)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_empty_and_payload_plumbing():
    q = quantize_sparse(torch.zeros(0, 5), 2, 64)
    assert dequantize_sparse(q).shape == (0, 5)
    x = relu_like(3, 100, seed=2)
    q = quantize_sparse(x, 2, 64, seed=0)
    again = SparseQuantizedTensor.rebuild(q.spec(), q.tensors())
    assert torch.equal(dequantize_sparse(again), dequantize_sparse(q))
    assert q.nbytes == sum(t.numel() * t.element_size() for t in q.tensors())
    assert "SparseQuantizedTensor" in repr(q)


def test_bad_input():
    x = relu_like(2, 64, seed=0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quantize_sparse(x.double(), 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_sparse([1.0, 0.0], 2)
    with pytest.raises(ValueError, match="group_size"):
        quantize_sparse(x, 2, 12)
    with pytest.raises(ValueError, match="rounding"):
        quantize_sparse(x, 2, rounding="up")
    with pytest.raises(ValueError):
        quantize_sparse(x, 3)
    with pytest.raises(ValueError, match="3 entries"):
        quantize_sparse(x, torch.tensor([2, 2, 2]))
    with pytest.raises(TypeError, match="SparseQuantizedTensor"):
        dequantize_sparse(quantize(x, 2))


def test_corrupted_offsets_are_refused():
    x = relu_like(2, 64, seed=0)
    q = quantize_sparse(x, 2, 64, seed=0)
    bad = q.offsets.clone()
    bad[1] = q.data.numel()  # row 1 would start at the end of the buffer
    with pytest.raises(ValueError, match="row 1"):
        extension().dequantize_sparse(q.data, q.lo, q.step, q.mask, q.row_bits, bad, 64,
                                      torch.empty(2, 64))
