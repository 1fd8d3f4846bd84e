"""The compiled CPU kernels (actnn_zoo._C) against the executable spec (quant/reference.py).

Everything is compared bit for bit: packed codes, the bf16 lo/step patterns, and the
dequantized values (NaN compared as NaN: torch itself writes different NaN payloads for bf16
depending on its vectorised or scalar path). The one documented exception: a group whose
minimum (or, all-zero, maximum) is zero and that holds both +0.0 and -0.0 may get the other
sign of zero for lo/step than torch's amin/amax picks, since which zero a min-reduction returns
depends on its evaluation order. Codes and dequantized values are identical even then.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _ext import compiled_extension  # noqa: E402

_C = compiled_extension()

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.quant import reference as R  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _bits_tensor(bits, n):
    if isinstance(bits, int):
        return torch.full((n,), bits, dtype=torch.uint8)
    return torch.as_tensor(bits, dtype=torch.uint8)


def _layout(x2d, bits):
    b = _bits_tensor(bits, x2d.shape[0])
    offsets = R.row_offsets(x2d.shape[1], b)
    return b, offsets, int(offsets[-1])


def _mixed_zero_groups(x2d, group_size):
    """(N, G) bool: groups holding both +0.0 and -0.0 (the signed-zero exception)."""
    x = x2d.float()
    n, d = x.shape
    g = -(-d // group_size)
    pad = g * group_size - d
    pos = (x == 0) & ~torch.signbit(x)
    neg = (x == 0) & torch.signbit(x)
    pos = torch.nn.functional.pad(pos, (0, pad)).view(n, g, group_size).any(2)
    neg = torch.nn.functional.pad(neg, (0, pad)).view(n, g, group_size).any(2)
    return pos & neg


def _assert_meta_equal(ref, got, what, mixed_zero):
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape, what
    rb, gb = ref.view(torch.int16), got.view(torch.int16)
    same = rb == gb
    # The documented exception: +0 vs -0 only, only in groups holding both zeros.
    same |= mixed_zero & (ref.float() == 0) & (got.float() == 0)
    bad = (~same).nonzero()
    assert bad.numel() == 0, (
        f"{what} differs at {bad[:5].tolist()}: ref {rb[~same][:5].tolist()} "
        f"got {gb[~same][:5].tolist()}")


def _assert_float_bits_equal(ref, got, what):
    assert ref.dtype == got.dtype and ref.shape == got.shape, what
    rn, gn = torch.isnan(ref), torch.isnan(got)
    assert torch.equal(rn, gn), f"{what}: NaN positions differ"
    iv = INT_VIEW[ref.dtype]
    same = (ref.view(iv) == got.view(iv)) | rn
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what} differs at {idx}: ref {ref[~same][:5].tolist()} "
                             f"got {got[~same][:5].tolist()}")


def check_parity(x2d, bits, group_size, seed=0, stochastic=True, out_dtypes=None):
    """Quantize with both backends and dequantize with both; everything bit-identical."""
    x2d = x2d.contiguous()
    b, offsets, total = _layout(x2d, bits)
    ref = R.quantize(x2d, b, offsets, total, group_size, seed, stochastic)
    got = _C.quantize(x2d, b, offsets, total, group_size, seed, stochastic)
    assert got[0].dtype == torch.uint8 and got[0].shape == (total,)
    if not torch.equal(ref[0], got[0]):
        diff = (ref[0] != got[0]).nonzero().flatten()[:5]
        raise AssertionError(f"packed codes differ at bytes {diff.tolist()}: "
                             f"ref {ref[0][diff].tolist()} got {got[0][diff].tolist()}")
    mixed_zero = _mixed_zero_groups(x2d, group_size)
    _assert_meta_equal(ref[1], got[1], "lo", mixed_zero)
    _assert_meta_equal(ref[2], got[2], "step", mixed_zero)
    for dt in out_dtypes or (x2d.dtype,):
        want = torch.empty(x2d.shape, dtype=dt)
        R.dequantize(ref[0], ref[1], ref[2], b, offsets, group_size, want)
        out = torch.empty(x2d.shape, dtype=dt)
        res = _C.dequantize(got[0], got[1], got[2], b, offsets, group_size, out)
        assert res.data_ptr() == out.data_ptr()
        _assert_float_bits_equal(want, out, f"dequantized ({dt})")
    return got


# ----------------------------------------------------------------------------------------------
# parity on fixed cases
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("stochastic", [True, False])
def test_parity_widths_dtypes(dtype, bits, stochastic):
    g = torch.Generator().manual_seed(bits * 10 + stochastic)
    x = (torch.randn(5, 1001, generator=g) * 3 + 1).to(dtype)
    for gs in (8, 32, 256, 1024):
        check_parity(x, bits, gs, seed=1234 + gs, stochastic=stochastic,
                     out_dtypes=(torch.float32, dtype))


@pytest.mark.parametrize("d", [1, 3, 7, 8, 13, 63, 64, 65, 255, 257, 520])
@pytest.mark.parametrize("group_size", [8, 32, 256])
def test_parity_row_lengths(d, group_size):
    g = torch.Generator().manual_seed(d)
    x = torch.rand(3, d, generator=g) - 0.25
    for bits in (1, 2, 4, 8):
        check_parity(x, bits, group_size, seed=d * 7 + bits)


@pytest.mark.parametrize("group_size", [8, 256])
def test_parity_every_float16_value(group_size):
    """Every finite float16 bit pattern (subnormals and both zeros included) read by the
    kernels' own branch-free conversion (bf16_cpu.h ``half_value``) quantizes and decodes as
    the reference, which converts with torch; 8-value groups make each code depend on a few
    exact inputs."""
    bits16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits16.view(torch.float16)
    x = x[torch.isfinite(x)]
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(group_size))
    x = x[perm][: (x.numel() // 512) * 512].view(-1, 512)
    for bits in (2, 8):
        check_parity(x, bits, group_size, seed=77 + bits, out_dtypes=(torch.float32,))
    got = _C.quantize_sparse(x, torch.full((x.shape[0],), 4, dtype=torch.uint8), group_size,
                             5, True)
    want = R.quantize_sparse(x, torch.full((x.shape[0],), 4, dtype=torch.uint8), group_size,
                             5, True)
    for a, b, name in zip(got, want, ("data", "lo", "step", "mask", "offsets")):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), name


def test_parity_with_unused_capacity_after_the_rows():
    """total larger than the rows need (SampleBits' bound): rows as usual, zeros after."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 301, generator=g)
    b, offsets, total = _layout(x, [8, 1, 2, 4, 1])
    for spare in (1, 7, 1000):
        ref = R.quantize(x, b, offsets, total + spare, 32, 5, True)
        got = _C.quantize(x, b, offsets, total + spare, 32, 5, True)
        assert got[0].shape == (total + spare,) and torch.equal(ref[0], got[0])
        assert not bool(got[0][total:].any())
        want, out = torch.empty(5, 301), torch.empty(5, 301)
        R.dequantize(ref[0], ref[1], ref[2], b, offsets, 32, want)
        _C.dequantize(got[0], got[1], got[2], b, offsets, 32, out)
        assert torch.equal(want, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_mixed_row_widths(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 333, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)).to(dtype)
    bits = [1, 2, 4, 8, 8, 4, 2, 1]
    for gs in (8, 32, 256):
        for stochastic in (True, False):
            check_parity(x, bits, gs, seed=99, stochastic=stochastic,
                         out_dtypes=(torch.float32, torch.float16, torch.bfloat16))


def test_seed_wraps_like_reference():
    x = torch.randn(2, 300)
    for seed in (0, 1, 2 ** 31 - 1, 2 ** 32 - 1, -1, -(2 ** 40) + 5):
        check_parity(x, 2, 256, seed=seed)


# ----------------------------------------------------------------------------------------------
# special values
# ----------------------------------------------------------------------------------------------
def _special_rows():
    nan, inf = float("nan"), float("inf")
    fmax = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    rows = {
        "nan": [1.0, nan, 2.0],
        "inf": [1.0, inf, 2.0],
        "-inf": [-inf, 0.5],
        "all_nan": [nan] * 5,
        "huge": [1e30, -1e30, 3e29],
        "huge_pos": [1e30, 2e30],
        "fmax_range": [fmax, -fmax],          # range overflows: step -> inf -> NaN group
        "near_fmax": [fmax, fmax * 0.999],
        "neg_fmax": [-fmax, -fmax * 0.5],     # lo rounds down to -inf
        "denormal": [1e-40, 3e-41, -2e-42, 1e-45],
        "denormal_pos": [1e-45, 2e-45, 7e-45],
        "tiny": [tiny, 2 * tiny, -tiny],
        "constant": [0.3] * 7,                # not a bf16 value: step gets nudged up from 0
        "constant_bf16": [0.5] * 7,           # exact: step 0, codes 0
        "zeros": [0.0] * 9,
        "neg_zeros": [-0.0] * 9,
        "mixed_zero": [0.0, -0.0, 1.0, -0.0],  # the signed-zero exception
        "bf16_edges": [1.0, 1.00390625, 1.0078125, -1.00390625, 255.0, 256.0],
        "int_like": [float(i) for i in range(-20, 21)],
    }
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [True, False])
def test_special_values(dtype, stochastic):
    rows = _special_rows()
    d = 57
    g = torch.Generator().manual_seed(5)
    for name, vals in rows.items():
        # The special values sit inside ordinary data, in one group or spread over several.
        base = torch.randn(4, d, generator=g)
        base[0, : len(vals)] = torch.tensor(vals)
        base[1] = torch.tensor((vals * d)[:d])
        base[2, -len(vals):] = torch.tensor(vals)
        base[3, 13: 13 + len(vals)] = torch.tensor(vals)
        x = base.to(dtype)
        for gs in (8, 16, 256):
            for bits in (1, 2, 8):
                try:
                    check_parity(x, bits, gs, seed=11, stochastic=stochastic,
                                 out_dtypes=(torch.float32, torch.bfloat16, torch.float16))
                except AssertionError as e:
                    raise AssertionError(f"{name}, group_size={gs}, bits={bits}: {e}") from None


def test_nonfinite_group_is_nan_and_others_untouched():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    got = check_parity(x, 2, 32)
    lo = got[1].float()
    assert torch.isnan(lo[0, 0]) and torch.isfinite(lo[0, 1])
    assert torch.isnan(lo[1, 1]) and torch.isfinite(lo[1, 0])


def test_signed_zero_exception_is_only_the_sign():
    x = torch.tensor([[0.0, -0.0, 1.0, 2.0, -0.0, 0.0, 3.0, 0.5] * 4])
    got = check_parity(x, 2, 8)
    assert bool((got[1].float() == 0).all())


# ----------------------------------------------------------------------------------------------
# random shapes and values
# ----------------------------------------------------------------------------------------------
@st.composite
def _cases(draw):
    n = draw(st.integers(1, 4))
    d = draw(st.integers(1, 700))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    kind = draw(st.sampled_from(["normal", "uniform", "relu", "few", "constant"]))
    scale = 10.0 ** draw(st.integers(-42, 36))
    if kind == "normal":
        x = torch.randn(n, d, generator=gen) * scale
    elif kind == "uniform":
        x = torch.rand(n, d, generator=gen) * scale
    elif kind == "relu":
        x = torch.relu(torch.randn(n, d, generator=gen)) * scale
    elif kind == "few":
        x = torch.randint(-3, 4, (n, d), generator=gen).float() * scale
    else:
        x = torch.full((n, d), draw(st.floats(-1e6, 1e6, width=32)))
    specials = draw(st.lists(st.tuples(st.integers(0, n * d - 1),
                                       st.sampled_from([float("nan"), float("inf"),
                                                        -float("inf"), 0.0, -0.0, 1e-45])),
                             max_size=3))
    flat = x.view(-1)
    for i, v in specials:
        flat[i] = v
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):
        bits = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=n, max_size=n))
    else:
        bits = draw(st.sampled_from([1, 2, 4, 8]))
    group_size = draw(st.sampled_from([8, 16, 24, 32, 64, 256, 264, 1024]))
    return (x.to(dtype), bits, group_size, draw(st.integers(0, 2 ** 32 - 1)),
            draw(st.booleans()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_parity_random(case):
    x, bits, group_size, seed, stochastic = case
    check_parity(x, bits, group_size, seed=seed, stochastic=stochastic,
                 out_dtypes=(x.dtype, torch.float32))


# ----------------------------------------------------------------------------------------------
# threads, the public API, empty inputs
# ----------------------------------------------------------------------------------------------
def test_results_do_not_depend_on_thread_count():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 4099, generator=g)
    bits = [1, 2, 4, 8] * 4
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            res = []
            for gs in (32, 256):
                b, offsets, total = _layout(x, bits)
                q = _C.quantize(x, b, offsets, total, gs, 77, True)
                out = torch.empty_like(x)
                _C.dequantize(q[0], q[1], q[2], b, offsets, gs, out)
                res.append((q, out))
            runs.append(res)
    finally:
        torch.set_num_threads(before)
    for (q1, o1), (q2, o2) in zip(*runs):
        assert torch.equal(q1[0], q2[0])
        assert torch.equal(q1[1].view(torch.int16), q2[1].view(torch.int16))
        assert torch.equal(q1[2].view(torch.int16), q2[2].view(torch.int16))
        assert torch.equal(o1.view(torch.int32), o2.view(torch.int32))
    # and the whole thing matches the reference
    check_parity(x, bits, 256, seed=77)


def test_public_api_uses_compiled_kernels():
    assert az.backend_name() in ("cpp", "cuda")
    x = torch.randn(3, 5, 17)
    q = az.quantize(x, bits=2, group_size=32, seed=42)
    rows = x.reshape(3, -1)
    b, offsets, total = _layout(rows, 2)
    ref = R.quantize(rows, b, offsets, total, 32, 42, True)
    assert torch.equal(q.data, ref[0])
    assert torch.equal(q.lo.view(torch.int16), ref[1].view(torch.int16))
    assert torch.equal(q.step.view(torch.int16), ref[2].view(torch.int16))
    y = az.dequantize(q)
    want = torch.empty(3, 85)
    R.dequantize(ref[0], ref[1], ref[2], b, offsets, 32, want)
    assert torch.equal(y.reshape(3, -1), want)


def test_empty_inputs():
    for n, d in ((0, 5), (3, 0), (0, 0)):
        x = torch.empty(n, d)
        b, offsets, total = _layout(x, 2)
        data, lo, step = _C.quantize(x, b, offsets, total, 8, 0, True)
        assert data.numel() == 0 and lo.shape == (n, -(-d // 8)) and step.shape == lo.shape
        out = torch.empty(n, d)
        assert _C.dequantize(data, lo, step, b, offsets, 8, out) is not None
    assert _C.pack_mask(torch.empty(0, dtype=torch.bool)).numel() == 0
    assert _C.unpack_mask(torch.empty(0, dtype=torch.uint8), 0).numel() == 0


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5, 8, 9, 63, 64, 65, 1000, 100003])
def test_mask_parity(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < 0.3
    packed = _C.pack_mask(mask)
    assert torch.equal(packed, R.pack_mask(mask))
    assert torch.equal(_C.unpack_mask(packed, n), mask)
    # unused high bits of the last byte are zero
    if n % 8:
        assert int(packed[-1]) >> (n % 8) == 0
    # any byte pattern unpacks like the reference
    raw = torch.randint(0, 256, ((n + 7) // 8,), dtype=torch.uint8, generator=g)
    assert torch.equal(_C.unpack_mask(raw, n), R.unpack_mask(raw, n))


def test_mask_api_roundtrip():
    mask = torch.rand(3, 7, 11) > 0.5
    packed = az.quant.pack_mask(mask)
    assert packed.numel() == (mask.numel() + 7) // 8
    assert torch.equal(az.quant.unpack_mask(packed, mask.shape), mask)


# ----------------------------------------------------------------------------------------------
# misuse raises instead of crashing or writing out of bounds
# ----------------------------------------------------------------------------------------------
ERRORS = (RuntimeError, ValueError, TypeError)


def _good_quantize_args():
    x = torch.randn(4, 100)
    b, offsets, total = _layout(x, 2)
    return [x, b, offsets, total, 32, 0, True]


@pytest.mark.parametrize("case", [
    ("x float64", 0, lambda a: a[0].double()),
    ("x int32", 0, lambda a: a[0].int()),
    ("x 1-d", 0, lambda a: a[0].reshape(-1)),
    ("x 3-d", 0, lambda a: a[0].reshape(4, 10, 10)),
    ("x not contiguous", 0, lambda a: torch.randn(100, 4).t()),
    ("x on meta", 0, lambda a: a[0].to("meta")),
    ("bits int64", 1, lambda a: a[1].long()),
    ("bits too short", 1, lambda a: a[1][:3]),
    ("bits value 3", 1, lambda a: torch.tensor([2, 2, 3, 2], dtype=torch.uint8)),
    ("bits value 0", 1, lambda a: torch.tensor([2, 0, 2, 2], dtype=torch.uint8)),
    ("offsets int32", 2, lambda a: a[2].int()),
    ("offsets too short", 2, lambda a: a[2][:4]),
    ("offsets past total", 2, lambda a: a[2] + 1),
    ("offsets negative", 2, lambda a: a[2] - 1),
    ("offsets overlapping", 2, lambda a: torch.tensor([0, 10, 20, 75, 100])),
    ("total too small", 3, lambda a: a[3] - 1),
    ("total negative", 3, lambda a: -1),
    ("group_size 0", 4, lambda a: 0),
    ("group_size 12", 4, lambda a: 12),
    ("group_size -8", 4, lambda a: -8),
])
def test_quantize_bad_arguments(case):
    _, i, change = case
    args = _good_quantize_args()
    args[i] = change(args)
    with pytest.raises(ERRORS):
        _C.quantize(*args)


def _good_dequantize_args():
    x = torch.randn(4, 100)
    b, offsets, total = _layout(x, 2)
    data, lo, step = _C.quantize(x, b, offsets, total, 32, 0, True)
    return [data, lo, step, b, offsets, 32, torch.empty(4, 100)]


@pytest.mark.parametrize("case", [
    ("data too short", 0, lambda a: a[0][:-1].clone()),
    ("data int8", 0, lambda a: a[0].to(torch.int8)),
    ("data 2-d", 0, lambda a: a[0].view(4, -1)),
    ("lo float32", 1, lambda a: a[1].float()),
    ("lo wrong shape", 1, lambda a: a[1][:, :2].contiguous()),
    ("step wrong shape", 2, lambda a: a[2][:3].contiguous()),
    ("step not contiguous", 2, lambda a: a[2].t().contiguous().t()),
    ("bits wrong value", 3, lambda a: torch.tensor([2, 2, 2, 5], dtype=torch.uint8)),
    ("bits wider than stored", 3, lambda a: torch.tensor([2, 2, 2, 8], dtype=torch.uint8)),
    ("offsets out of range", 4, lambda a: a[4] * 4),
    ("group_size mismatch", 5, lambda a: 64),
    ("group_size 9", 5, lambda a: 9),
    ("out wrong shape", 6, lambda a: torch.empty(4, 101)),
    ("out int32", 6, lambda a: torch.empty(4, 100, dtype=torch.int32)),
    ("out float64", 6, lambda a: torch.empty(4, 100, dtype=torch.float64)),
    ("out not contiguous", 6, lambda a: torch.empty(100, 4).t()),
    ("out 1-d", 6, lambda a: torch.empty(400)),
    ("out on meta", 6, lambda a: torch.empty(4, 100, device="meta")),
])
def test_dequantize_bad_arguments(case):
    _, i, change = case
    args = _good_dequantize_args()
    args[i] = change(args)
    with pytest.raises(ERRORS):
        _C.dequantize(*args)


def test_mask_bad_arguments():
    with pytest.raises(ERRORS):
        _C.pack_mask(torch.ones(8, dtype=torch.uint8))
    with pytest.raises(ERRORS):
        _C.pack_mask(torch.ones(8, 2, dtype=torch.bool).t())
    with pytest.raises(ERRORS):
        _C.unpack_mask(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ERRORS):
        _C.unpack_mask(torch.zeros(2, dtype=torch.uint8), -1)
    with pytest.raises(ERRORS):
        _C.unpack_mask(torch.zeros(2, dtype=torch.int32), 16)


def test_has_cuda_flag():
    assert isinstance(_C.has_cuda, bool)
    if not _C.has_cuda:
        assert "quantize" in dir(_C) and "unpack_mask" in dir(_C)


# ----------------------------------------------------------------------------------------------
# one-width entry points: the kernels lay the rows out themselves
# ----------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 6), d=st.integers(0, 300), bits=st.sampled_from([1, 2, 4, 8]),
       group_size=st.sampled_from([8, 24, 256]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2 ** 32 - 1), stochastic=st.booleans(), data=st.data())
def test_uniform_entries_equal_the_general_ones(n, d, bits, group_size, dtype, seed,
                                                stochastic, data):
    """quantize_uniform / dequantize_uniform (compiled and reference) give exactly what
    quantize / dequantize give with the widths and offsets spelled out, for any row range."""
    g = torch.Generator().manual_seed(seed % 1000)
    x = torch.randn(n, d, generator=g).to(dtype)
    b, offsets, total = _layout(x, bits)
    want = _C.quantize(x, b, offsets, total, group_size, seed, stochastic)
    for impl in (_C, R):
        got = impl.quantize_uniform(x, bits, group_size, seed, stochastic)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(got[2].view(torch.int16), want[2].view(torch.int16))
    full = torch.empty(n, d, dtype=dtype)
    _C.dequantize(want[0], want[1], want[2], b, offsets, group_size, full)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    for impl in (_C, R):
        out = torch.full((stop - start, d), float("nan"), dtype=dtype)
        impl.dequantize_uniform(want[0], want[1], want[2], bits, group_size, start, out)
        assert torch.equal(out.view(-1).view(torch.uint8),
                           full[start:stop].reshape(-1).view(torch.uint8))


class _CountOps(TorchDispatchMode):
    """Every operator dispatched while it is on, the extension's internal ones included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["plain", "affine"])
def test_uniform_entries_make_no_layout_tensors_on_the_cpu(kind):
    """A one-width quantize allocates its three outputs and nothing else, a one-width
    dequantize into a given ``out`` (any row range) dispatches no operator: the CPU kernels lay
    the rows out themselves. Before, each call also made a widths and an offsets tensor (and
    dequantize two narrowed views): about a tenth of a converted GPT-2 step's operators."""
    # the plain entries read any shape's rows (here (3, 4, 25): rows of 100) without a view
    x, zero, one = torch.randn(3, 4, 25), torch.zeros(100), torch.ones(100)
    x2d = x.view(3, 100)  # (the normalizing entry takes (N, D))
    with _CountOps() as counted:
        if kind == "plain":
            data, lo, step = _C.quantize_uniform(x, 2, 32, 7, True)
        else:
            data, lo, step = _C.quantize_affine_uniform(x2d, zero, one, 0, 1, 2, 32, 7, True)
    assert sorted(counted.ops) == ["empty.memory_format"] * 3, counted.ops
    out = torch.empty(2, 4, 25)
    with _CountOps() as counted:
        _C.dequantize_uniform(data, lo, step, 2, 32, 1, out)
    assert counted.ops == []
    want = R.dequantize_uniform(data, lo, step, 2, 32, 1, torch.empty(2, 100))
    assert torch.equal(out.view(2, 100), want)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       bits=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2 ** 32 - 1))
def test_uniform_entries_read_any_shape_as_its_contract_rows(shape, bits, seed):
    """A tensor of any shape (0-d and 1-d included) quantizes, compiled and in the reference,
    exactly as its (N, D) row view does (dim 0 the sample; 0-d and 1-d one row), and decodes
    into an output of its shape exactly as into the row view."""
    x = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed % 1000))
    n, d = R.contract_rows(x.shape)
    for impl in (_C, R):
        want = impl.quantize_uniform(x.reshape(n, d), bits, 16, seed, True)
        got = impl.quantize_uniform(x, bits, 16, seed, True)
        for a, b in zip(got, want):  # (bfloat16 lo/step compared bit for bit)
            bits_of = (lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t)
            assert torch.equal(bits_of(a), bits_of(b))
        if n * d:
            out = torch.full(x.shape, float("nan"))
            impl.dequantize_uniform(*want, bits, 16, 0, out)
            rows = impl.dequantize_uniform(*want, bits, 16, 0, torch.empty(n, d))
            assert torch.equal(out.reshape(n, d), rows)


@pytest.mark.parametrize("impl", ["compiled", "reference"])
def test_uniform_entries_bad_arguments(impl):
    k = _C if impl == "compiled" else R
    x = torch.randn(4, 100)
    data, lo, step = k.quantize_uniform(x, 2, 32, 0, True)
    for bad in (0, 3, 16):
        with pytest.raises(ERRORS, match="bits"):
            k.quantize_uniform(x, bad, 32, 0, True)
        with pytest.raises(ERRORS, match="bits"):
            k.dequantize_uniform(data, lo, step, bad, 32, 0, torch.empty(4, 100))
    with pytest.raises(ERRORS):  # rows 2:6 of 4
        k.dequantize_uniform(data, lo, step, 2, 32, 2, torch.empty(4, 100))
    if impl == "compiled":  # the kernels check the rows fit; the reference indexes past them
        with pytest.raises(ERRORS, match="data"):  # 2-bit codes read as 4-bit ones
            k.dequantize_uniform(data, lo, step, 4, 32, 0, torch.empty(4, 100))


@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.sampled_from([1, 2, 4, 8]), max_size=40), d=st.integers(0, 1000),
       dtype=st.sampled_from([torch.uint8, torch.int64]))
def test_row_offsets_equal_the_reference(widths, d, dtype):
    """The compiled row layout of mixed widths (a loop on the CPU for uint8 widths, tensor ops
    otherwise) equals reference.row_offsets exactly, the empty batch included."""
    bits = torch.tensor(widths, dtype=dtype)
    got = _C.row_offsets(d, bits)
    assert got.dtype == torch.int64 and torch.equal(got, R.row_offsets(d, bits))


def test_row_offsets_bad_arguments():
    with pytest.raises(ERRORS, match="1-d"):
        _C.row_offsets(8, torch.ones(2, 2, dtype=torch.uint8))
    with pytest.raises(ERRORS, match="non-negative"):
        _C.row_offsets(-1, torch.ones(2, dtype=torch.uint8))
