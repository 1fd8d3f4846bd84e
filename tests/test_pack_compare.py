"""quant.pack_compare: a comparison of x packed at 1 bit per value in one pass.

The kernel must give the bits of ``pack_mask(<torch's comparison>)`` exactly (the masks of the
ReLU family and Dropout are made with it, and their gradients are compared bit for bit with
torch's elsewhere), for every dtype, every length (the tail byte), special values (NaN, +-0,
+-inf, values next to the bounds) and non-contiguous input.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actnn_zoo.functional import activation as A
from actnn_zoo.quant import pack_compare, pack_mask
from actnn_zoo.quant import reference
from _ext import compiled_extension  # tests/_ext.py: skip here, fail in CI when not built

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
KINDS = ("not_le", "gt", "between")


def torch_mask(x: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    """The comparison written with torch ops in x's dtype, as the layers wrote it before."""
    if kind == "not_le":
        return ~(x <= lo)
    if kind == "gt":
        return x > lo
    return (x > lo) & (x < hi)


def sample(n: int, dtype: torch.dtype, seed: int, lo: float, hi: float) -> torch.Tensor:
    """Random values with the hard cases mixed in: NaN, +-0, +-inf, the bounds and their
    neighbours in dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    special = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), lo, hi]
    t_lo, t_hi = torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype)
    for b in (t_lo, t_hi):
        special += [float(torch.nextafter(b, torch.tensor(float("inf"), dtype=dtype))),
                    float(torch.nextafter(b, torch.tensor(float("-inf"), dtype=dtype)))]
    if n:
        idx = torch.randint(0, n, (min(n, 3 * len(special)),), generator=gen)
        vals = torch.tensor(special, dtype=torch.float64).to(dtype)
        x[idx] = vals[torch.arange(len(idx)) % len(vals)]
    return x


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 3000), dtype=st.sampled_from(DTYPES), kind=st.sampled_from(KINDS),
       bounds=st.sampled_from(((0.0, 0.0), (-1.0, 1.0), (0.0, 6.0), (-0.3, 2.7))),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_equals_packed_torch_comparison(n, dtype, kind, bounds, seed):
    ext = compiled_extension()
    # bounds made exactly representable in dtype, as the layers make them (activation._bound)
    lo = A._bound(bounds[0], dtype, up=False)
    hi = A._bound(bounds[1], dtype, up=True)
    x = sample(n, dtype, seed, lo, hi)
    want = pack_mask(torch_mask(x, kind, lo, hi))
    code = KINDS.index(kind)
    assert torch.equal(ext.pack_compare(x, code, lo, hi), want)
    assert torch.equal(reference.pack_compare(x, code, lo, hi), want)
    assert torch.equal(pack_compare(x, kind, lo, hi), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_channels_last_input(dtype):
    compiled_extension()
    x = sample(2 * 5 * 7 * 9, dtype, 3, 0.0, 0.0).view(2, 5, 7, 9)
    t = x.transpose(1, 3)  # non-contiguous: packed in logical order
    assert torch.equal(pack_compare(t, "not_le"), pack_mask(~(t <= 0)))
    cl = x.contiguous(memory_format=torch.channels_last)
    perm = A.memory_perm(cl)
    xm = A.to_memory_order(cl, perm)  # how the layers pack it: memory order, no copy
    assert xm.is_contiguous()
    assert torch.equal(pack_compare(xm, "gt"), pack_mask(xm > 0))


def test_other_dtypes_fall_back_to_torch():
    x = torch.tensor([-2, 0, 3, 5, -1, 7, 0, 1, 2], dtype=torch.int32)
    assert torch.equal(pack_compare(x, "between", 0, 5), pack_mask((x > 0) & (x < 5)))


def test_bad_kind_names_the_kinds():
    with pytest.raises(ValueError, match="not_le"):
        pack_compare(torch.zeros(4), "le")
    ext = compiled_extension()
    with pytest.raises(ValueError, match="kind must be"):
        ext.pack_compare(torch.zeros(4), 3, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.pack_compare(torch.zeros(4, 4).t(), 0, 0.0, 0.0)


@pytest.mark.parametrize("op", ["relu", "leaky_relu", "hardtanh", "relu6"])
@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_layers_give_torch_gradients_with_the_packed_comparison(op, fmt):
    """End to end: the mask the layer packs with pack_compare gives torch's input gradient bit
    for bit (special values included), contiguous and channels_last."""
    x = sample(3 * 4 * 5 * 6, torch.float32, 11, 0.0, 6.0).view(3, 4, 5, 6)
    x.view(-1)[:4] = torch.tensor([-1.0, 1.0, 6.0, 0.0])
    if fmt == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    fn = {"relu": (A.relu, F.relu), "leaky_relu": (A.leaky_relu, F.leaky_relu),
          "hardtanh": (A.hardtanh, F.hardtanh), "relu6": (A.relu6, F.relu6)}[op]
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    grads = []
    for f in fn:
        xi = x.clone().requires_grad_(True)
        f(xi).backward(g)
        grads.append(xi.grad)
    ours, theirs = grads
    # torch itself answers NaN inconsistently for Hardtanh (activation.py); we give 0 there
    finite = ~torch.isnan(x) if op in ("hardtanh", "relu6") else torch.ones_like(x).bool()
    assert torch.equal(ours[finite], theirs[finite])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_kernel_equals_cpu(dtype, kind):
    ext = compiled_extension()
    lo, hi = A._bound(-0.5, dtype, up=False), A._bound(2.0, dtype, up=True)
    x = sample(100_003, dtype, 7, lo, hi)
    code = KINDS.index(kind)
    assert torch.equal(ext.pack_compare(x.cuda(), code, lo, hi).cpu(),
                       ext.pack_compare(x, code, lo, hi))
