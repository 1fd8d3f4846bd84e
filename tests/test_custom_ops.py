"""The kernels as torch.library custom operators (actnn_zoo.quant.ops): schemas and fake
kernels checked by ``torch.library.opcheck``; results equal to the eager API's, bit for bit,
at one seed; bad arguments raise, naming them."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actnn_zoo.quant import dequantize, pack_mask, quantize, unpack_mask
from actnn_zoo.quant import ops

from _ext import compiled_extension  # tests/_ext.py: skip here, fail in CI when not built

SHAPES = [(4, 3, 5, 7), (2, 300), (1000,), (3, 1, 257)]


def _seed(s: int) -> torch.Tensor:
    return torch.tensor([s], dtype=torch.int64)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_opcheck_quantize_dequantize(shape, bits):
    x = torch.randn(shape)
    torch.library.opcheck(torch.ops.actnn_zoo.quantize_uniform.default,
                          (x, _seed(3), bits, 64, True))
    torch.library.opcheck(torch.ops.actnn_zoo.quantize_uniform.default,
                          (x, None, bits, 64, True))
    data, lo, step = ops.quantize_uniform(x, _seed(3), bits, 64, True)
    torch.library.opcheck(torch.ops.actnn_zoo.dequantize_uniform.default,
                          (data, lo, step, list(shape), bits, 64, torch.float32))


@pytest.mark.parametrize("shape", [(5, 13), (64,), (3, 4, 9)], ids=str)
def test_opcheck_masks(shape):
    m = torch.rand(shape) > 0.5
    torch.library.opcheck(torch.ops.actnn_zoo.pack_mask.default, (m,))
    torch.library.opcheck(torch.ops.actnn_zoo.unpack_mask.default,
                          (ops.pack_mask(m), list(shape)))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(1, 600), bits=st.sampled_from([1, 2, 4, 8]),
       group=st.sampled_from([8, 64, 256]), seed=st.integers(0, 2 ** 31 - 2),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_ops_equal_the_eager_api(n, d, bits, group, seed, dtype):
    x = (torch.randn(n, d) * 3).to(dtype)
    data, lo, step = ops.quantize_uniform(x, _seed(seed), bits, group, True)
    q = quantize(x, bits, group, seed=seed)
    assert torch.equal(data, q.data) and torch.equal(lo, q.lo) and torch.equal(step, q.step)
    out = ops.dequantize_uniform(data, lo, step, [n, d], bits, group, dtype)
    assert out.dtype == dtype and torch.equal(out, dequantize(q))


def test_fake_kernels_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(6, 5, 11)
    real = ops.quantize_uniform(x, _seed(1), 2, 16, True)
    with FakeTensorMode() as mode:
        fake = ops.quantize_uniform(mode.from_tensor(x), mode.from_tensor(_seed(1)), 2, 16, True)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype


def test_masks_round_trip():
    m = torch.rand(7, 9, 3) > 0.3
    packed = ops.pack_mask(m)
    assert torch.equal(packed, pack_mask(m))
    assert torch.equal(ops.unpack_mask(packed, [7, 9, 3]), m)
    assert torch.equal(unpack_mask(packed, (7, 9, 3)), m)


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_bad_bits_are_named(bits):
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8"):
        ops.quantize_uniform(torch.randn(4, 8), _seed(0), bits, 8, True)


def test_bad_group_and_layout_are_named():
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize_uniform(torch.randn(4, 8), _seed(0), 2, 12, True)
    with pytest.raises(ValueError, match="contiguous"):
        ops.quantize_uniform(torch.randn(8, 4).t(), _seed(0), 2, 8, True)
    with pytest.raises(TypeError, match="float"):
        ops.quantize_uniform(torch.ones(4, 8, dtype=torch.float64), _seed(0), 2, 8, True)
    with pytest.raises(ValueError, match="do not hold"):
        ops.unpack_mask(torch.zeros(3, dtype=torch.uint8), [100])


def test_cpu_calls_stay_in_cpp(monkeypatch):
    """With the compiled extension, the operators' CPU kernels are registered in C++: a call
    never enters the Python implementation (which exists for devices without a compiled
    kernel, and costs ~15 us of dispatch per call against ~5)."""
    compiled_extension("has_torch_ops")
    assert ops._DEFINED_IN_CPP

    def python_path(_device):
        raise AssertionError("the Python implementation ran")

    monkeypatch.setattr(ops, "kernels", python_path)
    x = torch.randn(3, 40)
    data, lo, step = ops.quantize_uniform(x, _seed(5), 4, 8, True)
    q = quantize(x, 4, 8, seed=5)
    assert torch.equal(data, q.data) and torch.equal(lo, q.lo) and torch.equal(step, q.step)
    assert torch.equal(ops.dequantize_uniform(data, lo, step, [3, 40], 4, 8, torch.float32),
                       dequantize(q))
    m = x > 0
    assert torch.equal(ops.unpack_mask(ops.pack_mask(m), [3, 40]), m)


def test_no_seed_draws_from_torch_generator():
    """seed=None (what a compiled graph passes): one draw from torch's default CPU generator
    per call, so torch.manual_seed reproduces it and consecutive calls round differently; the
    codes are those of an explicit seed (the draw is the only difference)."""
    x = torch.randn(3, 500)
    torch.manual_seed(7)
    a = ops.quantize_uniform(x, None, 2, 64, True)
    b = ops.quantize_uniform(x, None, 2, 64, True)
    torch.manual_seed(7)
    again = ops.quantize_uniform(x, None, 2, 64, True)
    assert all(torch.equal(p, q) for p, q in zip(a, again))
    assert not torch.equal(a[0], b[0])
    assert torch.Tag.nondeterministic_seeded in torch.ops.actnn_zoo.quantize_uniform.default.tags
    # the same values as some explicit seed's codes would give: unbiased rounding of x
    mean = sum(ops.dequantize_uniform(*ops.quantize_uniform(x, None, 2, 64, True), [3, 500], 2,
                                      64, torch.float32) for _ in range(400)) / 400
    step = a[2].float().repeat_interleave(64, dim=1)[:, :500]
    # 400 draws: the mean's error per value is at most step / 2 / sqrt(400) in sd; 6 sd bound
    assert ((mean - x).abs() <= 6 * step / 2 / 20 + 1e-6).all()
