"""The CUDA kernels (actnn_zoo._C built with ACTNN_ZOO_CUDA) against the executable spec
(quant/reference.py) and the CPU kernels, bit for bit; Q-layers on CUDA against fp32 autograd.

Skipped as a whole without a CUDA device or without CUDA kernels in the extension.

Comparison rules (the same as tests/test_kernels.py): packed codes byte for byte; lo/step as bf16
bit patterns, except that a group holding both +0.0 and -0.0 may get the other sign of zero than
torch's amin/amax picks (which zero a min-reduction returns depends on its order); dequantized
values bit for bit with NaN compared as NaN (torch writes different NaN payloads for bf16
depending on its vectorised or scalar path).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from actnn_zoo.quant import backend  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _C = backend.extension()
if _C is None or not getattr(_C, "has_cuda", False):
    pytest.skip("actnn_zoo._C has no CUDA kernels (built without ACTNN_ZOO_CUDA)",
                allow_module_level=True)

import actnn_zoo as az  # noqa: E402
from actnn_zoo.quant import reference as R  # noqa: E402
from actnn_zoo.quant import SampleBits  # noqa: E402

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _layout(x2d, bits):
    n = x2d.shape[0]
    if isinstance(bits, int):
        b = torch.full((n,), bits, dtype=torch.uint8)
    else:
        b = torch.as_tensor(bits, dtype=torch.uint8)
    offsets = R.row_offsets(x2d.shape[1], b)
    return b, offsets, int(offsets[-1])


def _mixed_zero_groups(x2d, group_size):
    """(N, G) bool: groups holding both +0.0 and -0.0 (the signed-zero exception)."""
    x = x2d.float().cpu()
    n, d = x.shape
    g = -(-d // group_size)
    pad = g * group_size - d
    pos = (x == 0) & ~torch.signbit(x)
    neg = (x == 0) & torch.signbit(x)
    pos = torch.nn.functional.pad(pos, (0, pad)).view(n, g, group_size).any(2)
    neg = torch.nn.functional.pad(neg, (0, pad)).view(n, g, group_size).any(2)
    return pos & neg


def _assert_bytes_equal(want, got, what):
    want, got = want.cpu(), got.cpu()
    assert got.dtype == torch.uint8 and got.shape == want.shape, (what, got.shape, want.shape)
    if not torch.equal(want, got):
        diff = (want != got).nonzero().flatten()[:5]
        raise AssertionError(f"{what}: bytes differ at {diff.tolist()}: want "
                             f"{want[diff].tolist()} got {got[diff].tolist()}")


def _assert_meta_equal(want, got, what, mixed_zero):
    want, got = want.cpu(), got.cpu()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, what
    wb, gb = want.view(torch.int16), got.view(torch.int16)
    same = (wb == gb) | (mixed_zero & (want.float() == 0) & (got.float() == 0))
    bad = (~same).nonzero()
    assert bad.numel() == 0, (f"{what} differs at {bad[:5].tolist()}: want "
                              f"{wb[~same][:5].tolist()} got {gb[~same][:5].tolist()}")


def _assert_float_bits_equal(want, got, what):
    want, got = want.cpu(), got.cpu()
    assert want.dtype == got.dtype and want.shape == got.shape, what
    wn, gn = torch.isnan(want), torch.isnan(got)
    assert torch.equal(wn, gn), f"{what}: NaN positions differ"
    iv = INT_VIEW[want.dtype]
    same = (want.view(iv) == got.view(iv)) | wn
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what} differs at {idx}: want {want[~same][:5].tolist()} "
                             f"got {got[~same][:5].tolist()}")


def check_parity(x2d, bits, group_size, seed=0, stochastic=True, out_dtypes=None,
                 with_cpu=True):
    """Quantize on CUDA, with the reference and with the CPU kernels; dequantize likewise."""
    x_cpu = x2d.detach().cpu().contiguous()
    x_gpu = x2d.detach().to(DEV).contiguous() if x2d.device.type != "cuda" else x2d.contiguous()
    b, offsets, total = _layout(x_cpu, bits)
    b_gpu, off_gpu = b.to(DEV), offsets.to(DEV)
    want = R.quantize(x_cpu, b, offsets, total, group_size, seed, stochastic)
    got = _C.quantize(x_gpu, b_gpu, off_gpu, total, group_size, seed, stochastic)
    assert all(t.device.type == "cuda" for t in got)
    mixed_zero = _mixed_zero_groups(x_cpu, group_size)
    _assert_bytes_equal(want[0], got[0], "packed codes (cuda vs reference)")
    _assert_meta_equal(want[1], got[1], "lo (cuda vs reference)", mixed_zero)
    _assert_meta_equal(want[2], got[2], "step (cuda vs reference)", mixed_zero)
    if with_cpu:
        cpu = _C.quantize(x_cpu, b, offsets, total, group_size, seed, stochastic)
        _assert_bytes_equal(cpu[0], got[0], "packed codes (cuda vs cpu)")
        _assert_meta_equal(cpu[1], got[1], "lo (cuda vs cpu)", mixed_zero)
        _assert_meta_equal(cpu[2], got[2], "step (cuda vs cpu)", mixed_zero)
    for dt in out_dtypes or (x_cpu.dtype,):
        ref_out = torch.empty(x_cpu.shape, dtype=dt)
        R.dequantize(want[0], want[1], want[2], b, offsets, group_size, ref_out)
        out = torch.empty(x_cpu.shape, dtype=dt, device=DEV)
        res = _C.dequantize(got[0], got[1], got[2], b_gpu, off_gpu, group_size, out)
        assert res.data_ptr() == out.data_ptr()
        _assert_float_bits_equal(ref_out, out, f"dequantized {dt} (cuda vs reference)")
        if with_cpu:
            cpu_out = torch.empty(x_cpu.shape, dtype=dt)
            _C.dequantize(got[0].cpu(), got[1].cpu(), got[2].cpu(), b, offsets, group_size,
                          cpu_out)
            _assert_float_bits_equal(cpu_out, out, f"dequantized {dt} (cuda vs cpu)")
    return got


# ----------------------------------------------------------------------------------------------
# parity
# ----------------------------------------------------------------------------------------------
# Group sizes that take every kernel path: 1, 4 and 32 lanes per group with one octet per lane
# (8, 32, 256), two (264), four (520, 1024) and the uncached loop (2048).
GROUP_SIZES = (8, 32, 256, 264, 520, 1024, 2048)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("stochastic", [True, False])
def test_parity_widths_dtypes(dtype, bits, stochastic):
    g = torch.Generator().manual_seed(bits * 10 + stochastic)
    x = (torch.randn(5, 2501, generator=g) * 3 + 1).to(dtype)
    for gs in GROUP_SIZES:
        check_parity(x, bits, gs, seed=1234 + gs, stochastic=stochastic,
                     out_dtypes=(torch.float32, dtype))


@pytest.mark.parametrize("d", [1, 3, 7, 8, 9, 13, 63, 64, 65, 255, 257, 520, 1031])
@pytest.mark.parametrize("group_size", [8, 32, 256, 264])
def test_parity_row_lengths(d, group_size):
    g = torch.Generator().manual_seed(d)
    x = torch.rand(3, d, generator=g) - 0.25
    for bits in (1, 2, 4, 8):
        check_parity(x, bits, group_size, seed=d * 7 + bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_mixed_row_widths(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 333, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(dtype)
    bits = [1, 2, 4, 8, 8, 4, 2, 1, 1]  # odd byte offsets: unaligned code stores
    for gs in (8, 32, 256, 264, 520):
        for stochastic in (True, False):
            check_parity(x, bits, gs, seed=99, stochastic=stochastic,
                         out_dtypes=(torch.float32, torch.float16, torch.bfloat16))


def test_parity_seeds():
    x = torch.randn(2, 300)
    for seed in (0, 1, 2 ** 31 - 1, 2 ** 32 - 1):
        check_parity(x, 2, 256, seed=seed)


# ----------------------------------------------------------------------------------------------
# special values
# ----------------------------------------------------------------------------------------------
def _specials(d, dtype):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(8, d, generator=g)
    x[0, 3 % d] = float("nan")
    x[1, d - 1] = float("inf")
    x[2, 0] = float("-inf")
    x[3] = 0.0
    x[3, 1::2] = -0.0                        # both zeros: the signed-zero exception
    x[4] = 1.5                               # constant row: step from the nudges only
    x[5] = torch.randn(d, generator=g) * 1e-40   # denormal range: step floored at 2^-126
    x[6] = -0.0
    x[7] = torch.randn(d, generator=g) * 1e30
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [True, False])
def test_special_values(dtype, stochastic):
    for d, gs in ((300, 256), (19, 8), (70, 64), (1100, 520), (2100, 2048)):
        x = _specials(d, dtype)
        for bits in (1, 2, 4, 8):
            check_parity(x, bits, gs, seed=d + bits, stochastic=stochastic,
                         out_dtypes=(torch.float32, torch.float16, torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# the lean quantize kernel (_C.quantize_lean; not yet the default): the same bytes as the CPU
# ----------------------------------------------------------------------------------------------
def check_lean(x2d, bits, group_size, seed=0, stochastic=True):
    """_C.quantize_lean on CUDA against _C.quantize on the CPU: codes, lo and step bit for bit
    (the mixed-zero groups' metadata compared as numbers, as check_parity does)."""
    x_cpu = x2d.detach().cpu().contiguous()
    b, offsets, total = _layout(x_cpu, bits)
    want = _C.quantize(x_cpu, b, offsets, total, group_size, seed, stochastic)
    got = _C.quantize_lean(x_cpu.to(DEV), b.to(DEV), offsets.to(DEV), total, group_size, seed,
                           stochastic)
    mixed_zero = _mixed_zero_groups(x_cpu, group_size)
    _assert_bytes_equal(want[0], got[0], "packed codes (lean cuda vs cpu)")
    _assert_meta_equal(want[1], got[1], "lo (lean cuda vs cpu)", mixed_zero)
    _assert_meta_equal(want[2], got[2], "step (lean cuda vs cpu)", mixed_zero)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [True, False])
def test_lean_quantize_equals_cpu(dtype, stochastic):
    """Every width, uniform and mixed rows; group sizes the lean kernel takes (129-256: one
    warp a group, lanes past the group's end idle) and ones it leaves to the general kernel;
    rows that end in a short group; rows of D % 8 != 0 (the general kernel); specials."""
    g = torch.Generator().manual_seed(7 + stochastic)
    for d in (256, 2048, 2056, 1000, 8, 2501):
        x = (torch.randn(6, d, generator=g) * torch.logspace(-2, 2, 6).unsqueeze(1)).to(dtype)
        for gs in (256, 136, 200, 248, 32, 264):
            for bits in (1, 2, 4, 8, [1, 2, 4, 8, 2, 1]):
                check_lean(x, bits, gs, seed=d + gs, stochastic=stochastic)
    for d in (300, 2100):
        x = _specials(d, dtype)
        for bits in (1, 2, 4, 8):
            check_lean(x, bits, 256, seed=d + bits, stochastic=stochastic)


def test_lean_quantize_extremes_and_seeds():
    rows = [[3.4e38, -3.4e38, 1.0, 0.0] * 64, [3.3e38, 3.39e38, 3.0e38, 1e38] * 64,
            [-3.39e38, 0.0, 0.0, 0.0] * 64, [1e-45, 0.0, 0.0, 0.0] * 64,
            [-0.0, 0.0] * 128, [float("-inf")] + [1.0] * 255, [float("nan")] + [2.0] * 255]
    x = torch.tensor(rows)
    for bits in (1, 2, 4, 8):
        check_lean(x, bits, 256)
    big = torch.randn(3, 1 << 20)  # indices past 2^21: the hash's high word
    for seed in (0, 1, 2 ** 31 - 1):
        check_lean(big, 2, 256, seed=seed)


def test_lean_quantize_refuses_cpu_tensors():
    x = torch.randn(2, 256)
    b, offsets, total = _layout(x, 2)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        _C.quantize_lean(x, b, offsets, total, 256, 0, True)


def test_extreme_magnitudes():
    rows = [[3.4e38, -3.4e38, 1.0, 0.0] * 4,        # range overflows fp32: NaN group
            [3.3e38, 3.39e38, 3.0e38, 1e38] * 4,      # near the top of bf16
            [-3.39e38, 0.0, 0.0, 0.0] * 4,            # lo rounds down to -inf: NaN group
            [1e-45, 0.0, 0.0, 0.0] * 4]               # smallest denormal
    x = torch.tensor(rows)
    for bits in (1, 2, 4, 8):
        for gs in (8, 16):
            check_parity(x, bits, gs, out_dtypes=(torch.float32, torch.float16, torch.bfloat16))
    h = torch.tensor([[65504.0, -65504.0, 0.0, 1.0] * 2, [float("nan")] + [1.0] * 7,
                      [6e-8, 0, 0, 0] * 2], dtype=torch.float16)
    for bits in (1, 8):
        check_parity(h, bits, 8, out_dtypes=(torch.float32, torch.float16))


def test_nonfinite_group_is_nan_and_others_untouched():
    x = torch.randn(2, 512)
    x[0, 300] = float("nan")
    data, lo, step = check_parity(x, 2, 256, seed=5)
    assert torch.isnan(lo[0, 1].float()) and torch.isnan(step[0, 1].float())
    assert torch.isfinite(lo[0, 0].float()) and torch.isfinite(lo[1].float()).all()


# ----------------------------------------------------------------------------------------------
# layout corner cases: alignment, big grids, gaps
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_input_and_output(dtype):
    """Storage offsets of one element: the kernels must take their scalar paths."""
    n, d = 3, 512
    buf = torch.randn(n * d + 1, device=DEV).to(dtype)
    x = buf[1:].view(n, d)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    b, offsets, total = _layout(x, 2)
    got = _C.quantize(x, b.to(DEV), offsets.to(DEV), total, 256, 3, True)
    want = R.quantize(x.cpu(), b, offsets, total, 256, 3, True)
    _assert_bytes_equal(want[0], got[0], "codes")
    obuf = torch.empty(n * d + 1, dtype=dtype, device=DEV)
    out = obuf[1:].view(n, d)
    _C.dequantize(got[0], got[1], got[2], b.to(DEV), offsets.to(DEV), 256, out)
    ref_out = torch.empty(n, d, dtype=dtype)
    R.dequantize(want[0], want[1], want[2], b, offsets, 256, ref_out)
    _assert_float_bits_equal(ref_out, out, "dequantized")


def test_more_than_65535_groups():
    """70,001 groups in one row at group size 256 (more than the capped grid covers in one
    pass, so the grid-stride loop runs) and 70,001 groups of 8 in rows of one group."""
    x = torch.randn(1, 70001 * 256 - 5)
    check_parity(x, 2, 256, seed=11, with_cpu=True)
    y = torch.randn(70001, 8)
    check_parity(y, 1, 8, seed=12, with_cpu=True)


def test_gaps_between_rows_are_zero():
    x = torch.randn(3, 37)
    b = torch.tensor([2, 8, 1], dtype=torch.uint8)
    offsets = torch.tensor([3, 17, 55, 66])          # rows of 10, 37 and 5 bytes, with gaps
    total = 66
    want = R.quantize(x, b, offsets, total, 16, 5, True)
    got = _C.quantize(x.to(DEV), b.to(DEV), offsets.to(DEV), total, 16, 5, True)
    _assert_bytes_equal(want[0], got[0], "codes with gaps")


def test_empty_inputs():
    for shape in ((0, 5), (3, 0), (0,), (0, 0, 4)):
        x = torch.empty(shape, device=DEV)
        q = az.quantize(x, 2)
        y = az.dequantize(q)
        assert y.shape == x.shape and y.device.type == "cuda"


def test_kernels_on_degenerate_shapes():
    x = torch.empty(3, 0, device=DEV)
    b = torch.full((3,), 2, dtype=torch.uint8, device=DEV)
    offsets = torch.zeros(4, dtype=torch.int64, device=DEV)
    data, lo, step = _C.quantize(x, b, offsets, 0, 256, 0, True)
    assert data.numel() == 0 and lo.shape == (3, 0) and step.shape == (3, 0)
    out = torch.empty(3, 0, device=DEV)
    assert _C.dequantize(data, lo, step, b, offsets, 256, out).shape == (3, 0)
    assert _C.pack_mask(torch.empty(0, dtype=torch.bool, device=DEV)).numel() == 0
    assert _C.unpack_mask(torch.empty(0, dtype=torch.uint8, device=DEV), 0).numel() == 0


# Run in a child process: on the first GPU run (H100, torch 2.11, extension built just in
# time) one of these calls crashed the interpreter with a segmentation fault, which took the
# rest of the file down with it; the child reports which call was running when it died.
_BAD_ARGUMENTS = r"""
import sys, torch
from actnn_zoo.quant import backend, reference as R
_C = backend.extension()
DEV = torch.device("cuda")
x = torch.randn(4, 100, device=DEV)
b = torch.full((4,), 2, dtype=torch.uint8)
offsets = R.row_offsets(100, b)
total = int(offsets[-1])
b, offsets = b.to(DEV), offsets.to(DEV)
good = [x, b, offsets, total, 32, 0, True]
cases = [("quantize", good, i, bad, label) for i, bad, label in [
    (0, x.double(), "x float64"), (0, x.t(), "x not contiguous"), (0, x.reshape(-1), "x 1-d"),
    (1, b.cpu(), "bits on cpu"), (1, b.long(), "bits int64"), (1, b[:3], "bits too short"),
    (2, offsets.int(), "offsets int32"), (2, offsets[:4], "offsets too short"),
    (3, -1, "total < 0"), (4, 12, "group 12"), (4, 0, "group 0")]]
data, lo, step = _C.quantize(*good)
dgood = [data, lo, step, b, offsets, 32, torch.empty(4, 100, device=DEV)]
cases += [("dequantize", dgood, i, bad, label) for i, bad, label in [
    (0, data.to(torch.int8), "data int8"), (1, lo.float(), "lo float32"),
    (1, lo[:, :2], "lo shape"), (2, step[:3], "step shape"), (3, b.cpu(), "bits on cpu"),
    (5, 64, "group 64"), (5, 9, "group 9"), (6, torch.empty(4, 200, device=DEV), "out shape"),
    (6, torch.empty(4, 100, device=DEV, dtype=torch.float64), "out float64"),
    (6, torch.empty(100, 4, device=DEV).t(), "out not contiguous"),
    (6, torch.empty(4, 100), "out on cpu")]]
# DIVISION: the CPU twin's checks (cpp_ext/division_checks.h), less the rows' values
x5 = torch.randn(2, 3, 4, 4, 1, device=DEV)
b2 = torch.full((2,), 2, dtype=torch.uint8)
off2 = R.row_offsets(48, b2)
t2 = int(off2[-1])
b2, off2 = b2.to(DEV), off2.to(DEV)
vgood = [x5, b2, off2, t2, 2, True, 0, True]
cases += [("division_quantize", vgood, i, bad, label) for i, bad, label in [
    (0, x5.double(), "x5 float64"), (0, x5.reshape(2, 3, 16), "x5 3-d"),
    (0, x5.transpose(2, 3), "x5 not contiguous"), (1, b2[:1], "bits too short"),
    (1, b2.cpu(), "bits on cpu"), (2, off2.int(), "offsets int32"), (3, -1, "total < 0"),
    (4, 0, "block 0")]]
vdata, vlow, vlo, vstep = _C.division_quantize(*vgood)
vdgood = [vdata, vlow, vlo, vstep, b2, off2, 2, True, torch.empty_like(x5)]
cases += [("division_dequantize", vdgood, i, bad, label) for i, bad, label in [
    (1, vlow[:1], "low shape"), (2, vlo[:1], "lo shape"), (3, vstep.float(), "step float32"),
    (4, b2[:1], "bits too short"), (5, off2.cpu(), "offsets on cpu"),
    (8, torch.empty(2, 3, 16, device=DEV), "out 3-d"), (8, torch.empty_like(x5.cpu()),
                                                         "out on cpu")]]
cases += [("pack_mask", [torch.ones(8, dtype=torch.uint8, device=DEV)], None, None, "uint8 mask"),
          ("unpack_mask", [torch.zeros(2, dtype=torch.uint8, device=DEV), 17], None, None,
           "17 values in 2 bytes")]
for fn, good_args, i, bad, label in cases:
    args = list(good_args)
    if i is not None:
        args[i] = bad
    print(f"start {fn}: {label}", flush=True)
    try:
        getattr(_C, fn)(*args)
        print(f"NO ERROR {fn}: {label}", flush=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        print(f"raised {fn}: {label}: {type(exc).__name__}", flush=True)
torch.cuda.synchronize()  # nothing asynchronous went wrong either
print("done", flush=True)
"""


def test_bad_arguments_raise():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _BAD_ARGUMENTS], capture_output=True,
                          text=True, timeout=300, env=env)
    lines = proc.stdout.splitlines()
    started = [ln for ln in lines if ln.startswith("start ")]
    assert proc.returncode == 0, (f"child died with {proc.returncode} during "
                                  f"{started[-1] if started else 'set-up'}: "
                                  f"{proc.stderr[-2000:]}")
    assert not [ln for ln in lines if ln.startswith("NO ERROR")], lines
    assert len([ln for ln in lines if ln.startswith("raised ")]) == len(started) == 39, lines
    assert lines[-1] == "done"


def test_deterministic_and_stream_safe():
    x = torch.randn(64, 4096, device=DEV)
    b, offsets, total = _layout(x, 2)
    args = (b.to(DEV), offsets.to(DEV), total, 256, 42, True)
    first = _C.quantize(x, *args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        second = _C.quantize(x, *args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for a, c in zip(first, second):
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000, 4097, 1 << 20])
def test_mask_parity(n):
    g = torch.Generator().manual_seed(n)
    m = torch.rand(n, generator=g) > 0.5
    want = R.pack_mask(m)
    got = _C.pack_mask(m.to(DEV))
    _assert_bytes_equal(want, got, "packed mask")
    _assert_bytes_equal(_C.pack_mask(m), got, "packed mask (cpu)")
    back = _C.unpack_mask(got, n)
    assert back.dtype == torch.bool and back.device.type == "cuda"
    assert torch.equal(back.cpu(), m)


def test_mask_unaligned_and_api():
    buf = torch.rand(1002, device=DEV) > 0.3
    m = buf[1:]                                   # contiguous, 1 byte off alignment
    _assert_bytes_equal(R.pack_mask(m.cpu()), _C.pack_mask(m), "unaligned mask")
    mask = torch.rand(4, 5, 7, device=DEV) > 0.5
    packed = az.quant.pack_mask(mask)
    assert packed.device.type == "cuda" and packed.numel() == (mask.numel() + 7) // 8
    assert torch.equal(az.quant.unpack_mask(packed, mask.shape), mask)


# ----------------------------------------------------------------------------------------------
# the public API on CUDA
# ----------------------------------------------------------------------------------------------
def test_backend_is_cuda():
    assert az.backend_name() == "cuda"
    assert backend.kernels(DEV) is _C


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_api_same_on_cpu_and_cuda(dtype, bits):
    x = (torch.randn(4, 3, 33, 17) * 2).to(dtype)
    qc = az.quantize(x, bits, seed=123)
    qg = az.quantize(x.to(DEV), bits, seed=123)
    assert qg.device.type == "cuda"
    _assert_bytes_equal(qc.data, qg.data, "api codes")
    y = az.dequantize(qg)
    assert y.shape == x.shape and y.dtype == dtype and y.device.type == "cuda"
    _assert_float_bits_equal(az.dequantize(qc), y, "api dequantized")


def test_api_mixed_bits_on_cuda():
    x = torch.randn(6, 1000)
    bits = torch.tensor([1, 2, 4, 8, 2, 1])
    qc = az.quantize(x, bits, seed=9)
    qg = az.quantize(x.to(DEV), bits.to(DEV), seed=9)
    _assert_bytes_equal(qc.data, qg.data, "mixed codes")
    _assert_float_bits_equal(az.dequantize(qc), az.dequantize(qg), "mixed dequantized")


def test_stochastic_rounding_is_unbiased_on_cuda():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device=DEV)
    acc = torch.zeros_like(x)
    k = 200
    for _ in range(k):
        acc += az.dequantize(az.quantize(x, 2))
    q = az.quantize(x, 2)
    step = q.step.float().repeat_interleave(256, dim=1)[:, :4096]
    # mean of k draws: error std <= step / (2 sqrt(k)); allow 6 sigma
    assert ((acc / k - x).abs() <= 6 * step / (2 * k ** 0.5) + 1e-6).all()


# ----------------------------------------------------------------------------------------------
# Q-layers on CUDA: gradients at 8 bits against fp32 autograd; autocast
# ----------------------------------------------------------------------------------------------
def _qnn(name):
    import actnn_zoo.nn as qnn
    cls = getattr(qnn, name, None)
    if cls is None:
        pytest.skip(f"actnn_zoo.nn has no {name}")
    return cls


def _qconfig(bits):
    from actnn_zoo.config import LayerQConfig
    return LayerQConfig(bits=bits)


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def _grads(module, x, grad_out_seed=12345):
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    g = torch.Generator(device=out.device).manual_seed(grad_out_seed)
    gout = torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)
    out.backward(gout)
    grads = [x.grad] + [p.grad for p in module.parameters() if p.grad is not None]
    return out.detach(), grads


LAYERS = {
    "QConv2d": (lambda: torch.nn.Conv2d(8, 16, 3, padding=1), (4, 8, 16, 16)),
    "QLinear": (lambda: torch.nn.Linear(300, 64), (32, 300)),
    "QBatchNorm2d": (lambda: torch.nn.BatchNorm2d(8), (4, 8, 16, 16)),
    "QReLU": (lambda: torch.nn.ReLU(), (4, 8, 16, 16)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_gradients_at_8_bits(name):
    cls = _qnn(name)
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    ref = make().to(DEV).train()
    q = cls.from_float(copy.deepcopy(ref), _qconfig(8)).train()
    x = torch.randn(shape, device=DEV)
    out_ref, g_ref = _grads(ref, x)
    out_q, g_q = _grads(q, x)
    torch.testing.assert_close(out_q, out_ref)  # forward runs the real op
    assert len(g_ref) == len(g_q)
    for a, b in zip(g_ref, g_q):
        assert _cos(a, b) >= 0.9999, (name, _cos(a, b))
    if name == "QReLU":
        assert torch.equal(g_ref[0], g_q[0])  # the 1-bit mask is exact


@pytest.mark.parametrize("name", ["QConv2d", "QLinear"])
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_layer_autocast(name, amp_dtype):
    cls = _qnn(name)
    make, shape = LAYERS[name]
    torch.manual_seed(1)
    ref = make().to(DEV).train()
    q = cls.from_float(copy.deepcopy(ref), _qconfig(8)).train()
    x = torch.randn(shape, device=DEV)
    with torch.autocast("cuda", dtype=amp_dtype):
        out_ref, g_ref = _grads(ref, x)
        out_q, g_q = _grads(q, x)
    assert out_q.dtype == out_ref.dtype == amp_dtype
    torch.testing.assert_close(out_q, out_ref)
    for a, b in zip(g_ref, g_q):
        assert a.dtype == b.dtype
        assert torch.isfinite(b).all()
        assert _cos(a, b) >= 0.999, (name, amp_dtype, _cos(a, b))


# ----------------------------------------------------------------------------------------------
# auto precision on the GPU: no device synchronisation per layer or per step
# ----------------------------------------------------------------------------------------------
def test_auto_precision_steps_do_not_synchronise():
    """strategy: actnn on CUDA. After the first re-allocation has applied, training steps run
    under torch.cuda.set_sync_debug_mode('error'): any synchronising call (an .item(), a
    blocking device-to-host copy) raises. SampleBits must match a widths tensor's result.

    With update_interval 3 the strategy solves at steps 2 and 4 and applies each solve at the
    next step: steps 4 (a solve on the device) and 5 (its read, which waits on one event) run
    under the debug mode. (Written for an older schedule, this test expected a second update
    by step 4; on an H200 it found updates == 1 there, which is the schedule's answer.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.GELU(), torch.nn.Flatten(),
        torch.nn.Linear(16 * 8 * 8, 10)).to(DEV)
    model = az.convert_model(model, strategy="actnn", bits=1.5, update_interval=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 3, 8, 8, device=DEV) * torch.rand(32, 1, 1, 1, device=DEV) * 10
    y = torch.randint(0, 10, (32,), device=DEV)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):  # step 2 solves, step 3 applies
        step()
    strategy = az.precision_strategy(model)
    assert strategy.step == 3 and strategy.updates == 1
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # step 4: per-sample widths, and the next re-allocation is solved
        step()  # step 5: that re-allocation applies
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert strategy.step == 5 and strategy.updates == 2
    widths = model[0].sample_bits
    assert isinstance(widths, SampleBits) and widths.bits.device.type == "cuda"
    assert int(widths.bits.sum()) <= widths.max_sum
    q = az.quantize(x, widths, group_size=64, seed=5)
    plain = az.quantize(x, widths.bits, group_size=64, seed=5)
    used = plain.data.numel()
    assert torch.equal(q.data[:used], plain.data) and not bool(q.data[used:].any())


# ----------------------------------------------------------------------------------------------
# every Q-layer on CUDA at 8 bits against the torch layer's own autograd
# ----------------------------------------------------------------------------------------------
nn = torch.nn
# name -> (torch layer factory, input shape, how the input gradient compares):
#   "exact": nothing lossy is saved for it (masks, positions, shapes): equal to float rounding;
#   "cos": a compressed tensor enters it: cosine >= 0.9999 at 8 bits;
#   "dropout": the keep-mask is drawn by the layer itself: grad = grad_out * mask / (1 - p).
EVERY_LAYER = {
    "QConv1d": (lambda: nn.Conv1d(4, 8, 3, padding=1), (4, 4, 32), "cos"),
    "QConv2d": (lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1), (4, 8, 16, 16), "cos"),
    "QConv3d": (lambda: nn.Conv3d(4, 8, 3, padding=1), (2, 4, 8, 8, 8), "cos"),
    "QConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 8, 3, stride=2), (4, 4, 16), "cos"),
    "QConvTranspose2d": (lambda: nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1,
                                                    output_padding=1), (2, 8, 8, 8), "cos"),
    "QConvTranspose3d": (lambda: nn.ConvTranspose3d(4, 4, 3, stride=2), (2, 4, 4, 4, 4), "cos"),
    "QLinear": (lambda: nn.Linear(300, 64), (32, 300), "cos"),
    "QBatchNorm1d": (lambda: nn.BatchNorm1d(16), (32, 16, 20), "cos"),
    "QBatchNorm2d": (lambda: nn.BatchNorm2d(8), (4, 8, 16, 16), "cos"),
    "QBatchNorm3d": (lambda: nn.BatchNorm3d(4), (2, 4, 8, 8, 8), "cos"),
    "QLayerNorm": (lambda: nn.LayerNorm(64), (8, 10, 64), "cos"),
    "QGroupNorm": (lambda: nn.GroupNorm(4, 16), (4, 16, 8, 8), "cos"),
    "QReLU": (lambda: nn.ReLU(), (4, 8, 16, 16), "exact"),
    "QReLU6": (lambda: nn.ReLU6(), (4, 8, 16, 16), "exact"),
    "QLeakyReLU": (lambda: nn.LeakyReLU(0.1), (4, 8, 16, 16), "exact"),
    "QHardtanh": (lambda: nn.Hardtanh(-0.5, 0.5), (4, 8, 16, 16), "exact"),
    "QGELU": (lambda: nn.GELU(), (4, 8, 16, 16), "cos"),
    "QSiLU": (lambda: nn.SiLU(), (4, 8, 16, 16), "cos"),
    "QSigmoid": (lambda: nn.Sigmoid(), (4, 8, 16, 16), "cos"),
    "QTanh": (lambda: nn.Tanh(), (4, 8, 16, 16), "cos"),
    "QELU": (lambda: nn.ELU(), (4, 8, 16, 16), "cos"),
    "QSoftplus": (lambda: nn.Softplus(), (4, 8, 16, 16), "cos"),
    "QSoftmax": (lambda: nn.Softmax(dim=-1), (8, 10, 64), "cos"),
    "QDropout": (lambda: nn.Dropout(0.3), (4, 8, 16, 16), "dropout"),
    "QDropout1d": (lambda: nn.Dropout1d(0.3), (4, 8, 32), "dropout"),
    "QDropout2d": (lambda: nn.Dropout2d(0.3), (4, 8, 16, 16), "dropout"),
    "QDropout3d": (lambda: nn.Dropout3d(0.3), (2, 4, 4, 4, 4), "dropout"),
    "QMaxPool1d": (lambda: nn.MaxPool1d(3, 2), (4, 8, 33), "exact"),
    "QMaxPool2d": (lambda: nn.MaxPool2d(3, 2, padding=1), (4, 8, 16, 16), "exact"),
    "QMaxPool3d": (lambda: nn.MaxPool3d(2), (2, 4, 8, 8, 8), "exact"),
    "QAdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(5), (4, 8, 33), "exact"),
    "QAdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d((5, 7)), (4, 8, 16, 16), "exact"),
    "QAdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(3), (2, 4, 8, 8, 8), "exact"),
    "QAvgPool1d": (lambda: nn.AvgPool1d(3, 2), (4, 8, 33), "exact"),
    "QAvgPool2d": (lambda: nn.AvgPool2d(3, 2, padding=1), (4, 8, 16, 16), "exact"),
    "QAvgPool3d": (lambda: nn.AvgPool3d(2), (2, 4, 8, 8, 8), "exact"),
    "QAdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(5), (4, 8, 33), "exact"),
    "QAdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((5, 7)), (4, 8, 16, 16), "exact"),
    "QAdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(3), (2, 4, 8, 8, 8), "exact"),
    "QUpsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (2, 4, 8, 8), "exact"),
    "QHardswish": (lambda: nn.Hardswish(), (4, 8, 16, 16), "cos"),
    "QHardsigmoid": (lambda: nn.Hardsigmoid(), (4, 8, 16, 16), "cos"),
    "QMish": (lambda: nn.Mish(), (4, 8, 16, 16), "cos"),
    "QRMSNorm": (lambda: nn.RMSNorm(64), (8, 10, 64), "cos"),
    # Third-party classes (tests/test_third_party.py checks them on CPU, skipped without them).
    "QHFConv1D": (lambda: _third_party("transformers.pytorch_utils", "Conv1D")(64, 300),
                  (8, 10, 300), "cos"),
    "QLayerNorm2d": (lambda: _third_party("torchvision.models.convnext", "LayerNorm2d")(16),
                     (4, 16, 8, 8), "cos"),
    "QBatchNormAct2d": (lambda: _third_party("timm.layers.norm_act", "BatchNormAct2d")(8),
                        (4, 8, 16, 16), "cos"),
}
def _third_party(module: str, name: str):
    """A class of transformers / torchvision / timm (the latter two from .bench_deps, see
    scripts/third_party.py); skips the test when it is not importable."""
    import importlib

    from _scripts import load_script
    if module.split(".")[0] != "transformers":
        # .bench_deps on sys.path, torchvision's operator schemas
        load_script("third_party.py").import_vision()
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"{module}.{name} is not importable: {exc}")


# QSyncBatchNorm needs an initialised process group; it runs with two gloo processes on CPU
# (tests/test_layers_norm.py) and is the only Q-layer not exercised here.
NOT_HERE = {"QSyncBatchNorm"}


def test_every_q_layer_is_covered_on_cuda():
    import actnn_zoo.nn as qnn
    exported = {n for n in qnn.__all__ if n != "QModule"}
    assert exported - NOT_HERE == set(EVERY_LAYER), exported ^ set(EVERY_LAYER)


@pytest.mark.parametrize("name", sorted(EVERY_LAYER))
def test_every_layer_gradients_on_cuda(name):
    make, shape, kind = EVERY_LAYER[name]
    cls = _qnn(name)
    torch.manual_seed(0)
    ref = make().to(DEV).train()
    q = cls.from_float(copy.deepcopy(ref), _qconfig(8)).train()
    x = torch.randn(shape, device=DEV)
    out_q, g_q = _grads(q, x)
    assert out_q.device.type == "cuda"
    assert all(g.device.type == "cuda" and torch.isfinite(g).all() for g in g_q)
    if kind == "dropout":
        p = q.p
        keep = out_q != 0
        assert 0.6 < keep.float().mean().item() < 0.8
        torch.testing.assert_close(out_q, x * keep / (1 - p))
        gen = torch.Generator(device=DEV).manual_seed(12345)
        gout = torch.randn(out_q.shape, generator=gen, device=DEV)
        torch.testing.assert_close(g_q[0], gout * keep / (1 - p))
        return
    out_ref, g_ref = _grads(ref, x)
    torch.testing.assert_close(out_q, out_ref)  # forward runs the real op
    assert len(g_ref) == len(g_q)
    for i, (a, b) in enumerate(zip(g_ref, g_q)):
        if kind == "exact":
            torch.testing.assert_close(b, a)
        else:
            assert _cos(a, b) >= 0.9999, (name, i, _cos(a, b))


def test_training_step_with_many_layer_types_does_not_synchronise():
    """A uniform 2-bit training step through conv, norms, the mask layers, max-pool, smooth
    activations, softmax and linear, under set_sync_debug_mode('error') after a warm-up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.GroupNorm(4, 16),
        torch.nn.SiLU(), torch.nn.Dropout2d(0.1), torch.nn.AdaptiveMaxPool2d(4),
        torch.nn.Flatten(), torch.nn.Linear(256, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
        torch.nn.Dropout(0.1), torch.nn.Linear(64, 10), torch.nn.Softmax(dim=-1)).to(DEV)
    model = az.convert_model(model, strategy="uniform", bits=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3, 16, 16, device=DEV)
    y = torch.randn(16, 10, device=DEV)

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    step()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ----------------------------------------------------------------------------- CUDA graphs
def _capture(fn):
    """Run ``fn`` while a CUDA graph captures the current stream (torch.cuda.graph)."""
    static = torch.randn(64, 512, device=DEV)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn(static)  # warm-up outside the capture, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    return graph, static, out


def test_stochastic_rounding_refuses_cuda_graph_capture():
    """A CUDA graph replays a launch with the seed drawn when it was captured: every replay
    would round alike (biased across steps). Capturing stochastic quantize raises, naming the
    way out; DIVISION's quantizer too."""
    with pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph"):
        _capture(lambda x: az.quant.quantize(x, 2))
    from actnn_zoo.quant.division import division_quantize
    with pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph"):
        _capture(lambda x: division_quantize(x.view(2, 32, 16, 32), 2, 8))


def test_nearest_rounding_captures_and_replays_exactly():
    """Round-to-nearest draws nothing: it captures, and a replay equals an eager call."""
    graph, static, out = _capture(lambda x: az.quant.quantize(x, 4, rounding="nearest").data)
    static.copy_(torch.randn_like(static))
    graph.replay()
    want = az.quant.quantize(static, 4, rounding="nearest").data
    assert torch.equal(out, want)


def test_attention_dropout_refuses_cuda_graph_capture():
    """Attention's dropout mask is a hash of a host seed: captured, every replay would drop
    the same entries; it raises instead, naming the way out."""
    from actnn_zoo.functional.attention import scaled_dot_product_attention

    def attend(x):
        q = x.view(2, 4, 64, 64).detach().requires_grad_(True)
        return scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    with pytest.raises(RuntimeError, match="dropout cannot be captured into a CUDA graph"):
        _capture(attend)


# ---------------------------------------------------------------- the layers' compiled nodes
@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("widths", ["one", "per-sample"])
def test_compiled_nodes_equal_the_python_functions_on_cuda(kind, widths):
    """``_C.qlinear`` / ``_C.qconv`` (cpp_ext/qlayers.cpp) on CUDA: outputs and gradients bit
    for bit those of the Python Functions at the same seed (tests/test_qlayer_nodes.py on the
    CPU)."""
    from actnn_zoo.config import LayerQConfig
    from actnn_zoo.functional import conv as fconv
    from actnn_zoo.functional import linear as flinear

    torch.manual_seed(0)
    if kind == "linear":
        layer = torch.nn.Linear(48, 24).to(DEV)
        x = torch.randn(6, 5, 48, device=DEV)
        module, attr, node = flinear, "_QLINEAR", "QLinearFunction"

        def forward(xi, bits):
            return flinear.linear(xi, layer.weight, layer.bias, LayerQConfig(bits=2), bits)
    else:
        layer = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1).to(DEV)
        x = torch.randn(6, 4, 9, 9, device=DEV)
        spec = fconv.ConvSpec(2, (2, 2), (1, 1), (1, 1), 1)
        module, attr, node = fconv, "_QCONV", "QConvFunction"

        def forward(xi, bits):
            return fconv.conv(xi, layer.weight, layer.bias, spec, LayerQConfig(bits=2), bits)
    w = torch.tensor([1, 2, 4, 8, 2, 1], dtype=torch.uint8, device=DEV)
    bits = 2 if widths == "one" else SampleBits(w, int(w.sum()))
    assert getattr(module, attr) is not None

    def run():
        torch.manual_seed(3)
        xi = x.clone().requires_grad_(True)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            out = forward(xi, bits)
            out.backward(torch.linspace(-1, 1, out.numel(), device=DEV).view(out.shape))
        grads = [xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
        layer.weight.grad = layer.bias.grad = None
        return out, grads

    out, got = run()
    assert node in out.grad_fn.name()
    saved = getattr(module, attr)
    try:
        setattr(module, attr, None)
        out2, want = run()
    finally:
        setattr(module, attr, saved)
    assert torch.equal(out, out2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["gelu", "silu", "relu", "relu-inplace", "leaky_relu"])
def test_activation_nodes_equal_the_python_functions_on_cuda(op):
    """``_C.qderivative`` / ``_C.qmask`` (cpp_ext/qlayers.cpp) on CUDA, where ReLUs always keep
    their own mask: outputs and gradients bit for bit those of the Python Functions at the
    same seed (tests/test_qlayer_nodes.py on the CPU), double backward of the mask included."""
    from actnn_zoo.config import LayerQConfig
    from actnn_zoo.functional import activation as fact

    attr = "_QDERIVATIVE" if op in ("gelu", "silu") else "_QMASK"
    assert getattr(fact, attr) is not None
    x = torch.randn(6, 5, 48, device=DEV) * 3
    g = torch.linspace(-1, 1, x.numel(), device=DEV).view(x.shape)
    call = {"gelu": lambda t: fact.gelu(t, qconfig=LayerQConfig(bits=2)),
            "silu": lambda t: fact.silu(t, qconfig=LayerQConfig(bits=2)),
            "relu": lambda t: fact.relu(t),
            "relu-inplace": lambda t: fact.relu(t, inplace=True),
            "leaky_relu": lambda t: fact.leaky_relu(t, 0.1)}[op]

    def run():
        torch.manual_seed(3)
        leaf = x.clone().requires_grad_(True)
        gv = g.clone().requires_grad_(True)
        out = call(leaf * 1.0)
        name = out.grad_fn.name()
        if attr == "_QMASK":  # differentiable in the incoming gradient
            (gx,) = torch.autograd.grad(out, leaf, gv, create_graph=True)
            (gg,) = torch.autograd.grad(gx.sum(), gv)
            return name, [out.detach(), gx.detach(), gg]
        out.backward(g)
        return name, [out.detach(), leaf.grad]

    name, got = run()
    assert ("QMaskFunction" if attr == "_QMASK" else "QDerivativeFunction") in name
    saved = getattr(fact, attr)
    try:
        setattr(fact, attr, None)
        _, want = run()
    finally:
        setattr(fact, attr, saved)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_compiled_nodes_skip_the_stores_own_hooks_on_cuda(monkeypatch):
    """Under capture on CUDA the compiled nodes' saves skip the store's hooks as on the CPU
    (tests/test_capture_hooks.py): none of them reaches the pack hook, and the gradients are
    those of the hooks' path, bit for bit."""
    from _spy import OwnSavesSpy

    spy = OwnSavesSpy(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 16, 32),
                                torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4)).to(DEV)
    x = torch.randn(4, 3, 4, 4, device=DEV)
    grads = {}
    for name in ("skipped", "hooks"):
        spy.take(name)
        spy.reset()
        q = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
        torch.manual_seed(1)
        q(x).square().sum().backward()
        assert spy.own and spy.own_packed() == (0 if name == "skipped" else len(spy.own))
        grads[name] = [p.grad for p in q.parameters()]
    for a, b in zip(grads["skipped"], grads["hooks"]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# the sampled rounding variances (cpp_ext/variance_cuda.cu) against the torch twin and the CPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("widths", ["2", "sample"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("normalized", [False, True])
def test_rounding_variance_codes_on_cuda(dtype, widths, layout, normalized):
    """The CUDA entry's 1-bit codes equal the torch twin's on CUDA and the CPU kernel's, byte
    for byte, over source dtypes, per-sample widths, a strided source and a norm's fused
    (x - shift) * scale per channel."""
    from actnn_zoo.functional import _rounding_variance as rv
    from actnn_zoo.quant import quantize

    gen = torch.Generator().manual_seed(11)
    n, c, h, w = 6, 5, 7, 9
    x = (torch.randn(n, c, h, w, generator=gen) * 2.0).to(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    kw = {}
    if normalized:
        shift = (torch.randn(c, generator=gen) * 0.3).to(work)
        scale = (torch.rand(c, generator=gen) + 0.5).to(work)
        x_hat = ((x.to(work) - shift.view(1, c, 1, 1)) * scale.view(1, c, 1, 1)).float()
        kw = {"shift": shift.view(1, c, 1, 1), "scale": scale.view(1, c, 1, 1),
              "stat": (h * w, c)}
    else:
        x_hat = x.float()
    bits = (SampleBits(torch.tensor([2, 4, 1, 8, 2, 2], dtype=torch.uint8), 19)
            if widths == "sample" else 2)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    for stride in (1, 3, 8, 40):
        draw = (stride // 2, 1234 + stride)
        q_cpu = quantize(x_hat, bits, 64, seed=5)
        _, on_cpu = rv.sample_variance(q_cpu, x, "stochastic", stride, draw=draw, **kw)
        q = quantize(x_hat.to(DEV), SampleBits(bits.bits.to(DEV), bits.max_sum)
                     if widths == "sample" else bits, 64, seed=5)
        dev_kw = {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in kw.items()}
        _, got = rv.sample_variance(q, x.to(DEV), "stochastic", stride, draw=draw, **dev_kw)
        twin = rv._sample_torch(q, x.to(DEV), dev_kw.get("shift"), dev_kw.get("scale"),
                                dev_kw.get("stat", (1, 0)), draw[0], stride, draw[1])
        assert torch.equal(got.cpu(), twin.cpu()), f"kernel and twin differ at stride {stride}"
        assert torch.equal(got.cpu(), on_cpu), f"CUDA and CPU differ at stride {stride}"


@pytest.mark.parametrize("grad_layout", ["contiguous", "expanded", "channels_last"])
def test_rounding_variance_correction_on_cuda(grad_layout):
    """The CUDA correction equals the torch twin's and the CPU kernel's, bit for bit, with a
    scale per channel, a weight and a divisor, through the gradients' strides."""
    from actnn_zoo.functional import _rounding_variance as rv
    from actnn_zoo.quant import quantize

    gen = torch.Generator().manual_seed(3)
    shape, c, hw = (4, 6, 5, 3), 6, 15
    x = torch.randn(shape, generator=gen)
    scale = torch.rand(c, generator=gen) + 0.5
    weight = torch.randn(c, generator=gen)
    if grad_layout == "expanded":
        go = torch.randn((), generator=gen).expand(shape)
    elif grad_layout == "channels_last":
        go = torch.randn(shape, generator=gen).contiguous(memory_format=torch.channels_last)
    else:
        go = torch.randn(shape, generator=gen)
    gi = torch.randn(shape, generator=gen)
    for stride in (1, 4, 9):
        draw, codes = rv.sample_variance(quantize(x, 2, 32, seed=2), x, "stochastic", stride,
                                         draw=(stride - 1, 99))
        kw = {"stat": (hw, c), "weight_stat": (hw, c), "divisor": 7.0}
        want = rv.correct_(gi.clone(), go, draw, codes, scale=scale, weight=weight, **kw)
        got = rv.correct_(gi.to(DEV, copy=True), go.to(DEV), draw, codes.to(DEV),
                          scale=scale.to(DEV), weight=weight.to(DEV), **kw)
        twin = rv._correct_torch(gi.to(DEV, copy=True), go.to(DEV), draw[0], stride,
                                 codes.to(DEV), scale.to(DEV), weight.to(DEV), kw["stat"],
                                 kw["weight_stat"], kw["divisor"])
        assert torch.equal(got.cpu(), want) and torch.equal(twin.cpu(), want)


def test_rounding_variance_bad_arguments_raise_on_cuda():
    """Mixed devices and bad widths are named before any kernel runs (the checks are host code,
    shared with the CPU entry)."""
    from actnn_zoo.quant import quantize

    x = torch.randn(4, 16, device=DEV)
    q = quantize(x, 2, 8, seed=1)
    with pytest.raises(RuntimeError, match="one device"):
        _C.rounding_variance_codes(q.lo.cpu(), q.step.cpu(), None, 2, 8, x, None, None, 1, 0,
                                   0, 4, 1)
    with pytest.raises(ValueError, match="bits must be"):
        _C.rounding_variance_codes(q.lo, q.step, None, 3, 8, x, None, None, 1, 0, 0, 4, 1)
    with pytest.raises(RuntimeError, match="one device"):
        _C.rounding_variance_correct_(torch.zeros(4, 16, device=DEV), torch.zeros(4, 16),
                                      torch.zeros(20, dtype=torch.uint8, device=DEV), 0, 4,
                                      None, 1, 0, None, 1, 0, 1.0)


@pytest.mark.parametrize("big", [False, True])
def test_attention_keep_mask_on_cuda(big):
    """The CUDA keep-mask of a tile (cpp_ext/attention_dropout_cuda.cu) equals the CPU kernel's
    and the torch program's on CUDA, bit for bit, also for rows past 2^32 (the row's high
    word enters the hash)."""
    from actnn_zoo.functional import attention as attn

    for seed, p, L, S in ((3, 0.1, 37, 53), (2 ** 31 - 5, 0.9, 8, 300), (0, 0.5, 1, 1)):
        on_gpu = attn._Dropout(seed, p, L, S, DEV)
        on_cpu = attn._Dropout(seed, p, L, S, torch.device("cpu"))
        assert on_gpu.compiled
        n0 = (1 << 32) // L + 3 if big else 0
        for n1, r0, r1, cols in ((n0 + 4, 0, L, S), (n0 + 1, L // 2, L, S // 2 + 1)):
            got = on_gpu.keep(n0, n1, r0, r1, cols)
            assert got.device.type == DEV.type and got.dtype == torch.bool
            assert torch.equal(got.cpu(), on_cpu.keep(n0, n1, r0, r1, cols))
            assert torch.equal(got, on_gpu.keep_torch(n0, n1, r0, r1, cols))


@pytest.mark.parametrize("m", [1, 7, 64, 600, 2500])
def test_allocate_widths_on_cuda(m):
    """The CUDA width greedy (cpp_ext/widths_cuda.cu) equals the CPU kernel's and the torch
    program's on CUDA, for budgets from nothing to everything, with ties (zero and repeated
    scores) and past the shared-memory size (2,500 items: a global scratch buffer)."""
    from actnn_zoo.precision import solver

    gen = torch.Generator().manual_seed(m)
    score = torch.rand(m, generator=gen) ** 4
    score[::5] = 0.0
    score[1::7] = score[0]
    for extra in (0.0, 1.0, float(m // 3), float(m), 3.5 * m, 7.0 * m, 10.0 * m):
        want = solver._allocate_samples_torch(score, extra)
        on_cpu = _C.allocate_widths(score, extra)
        got = _C.allocate_widths(score.to(DEV), extra)
        assert got.device.type == DEV.type and got.dtype == torch.uint8
        assert torch.equal(on_cpu, want), f"CPU kernel and torch program differ at {extra}"
        assert torch.equal(got.cpu(), want), f"CUDA kernel and torch program differ at {extra}"
        assert torch.equal(solver._allocate_samples_torch(score.to(DEV), extra).cpu(), want)


@pytest.mark.parametrize("n", [0, 1, 5, 64, 1000, 5000])
def test_row_offsets_on_cuda(n):
    """The CUDA row offsets of per-sample widths (cpp_ext/widths_cuda.cu) equal the reference's
    and the CPU kernel's, for any number of rows (more rows than threads: chunks) and row
    lengths whose sizes are not whole bytes."""
    gen = torch.Generator().manual_seed(n)
    bits = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)[torch.randint(0, 4, (n,), generator=gen)]
    for d in (1, 3, 37, 4096):
        want = R.row_offsets(d, bits)
        assert torch.equal(_C.row_offsets(d, bits), want)
        got = _C.row_offsets(d, bits.to(DEV))
        assert got.device.type == DEV.type and got.dtype == torch.int64
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_statistic_on_cuda(dtype):
    """The CUDA range statistic (cpp_ext/widths_cuda.cu) equals the CPU kernel's bit for bit
    (the same per-group terms, summed in group order in double) and the torch version up to
    float rounding, with short last groups, NaN and Inf groups (0), and rows of more groups
    than one pass of the block (300 x 16 = 4,800 values at group size 16)."""
    from actnn_zoo.precision import stats

    gen = torch.Generator().manual_seed(4)
    for n, d, group in ((3, 1000, 256), (7, 4800, 16), (1, 5, 8), (65, 256, 256)):
        x = (torch.randn(n, d, generator=gen) * 3.0).to(dtype)
        x[0, min(3, d - 1)] = float("nan")
        if n > 1:
            x[1, 0] = float("inf")
        want = _C.range_statistic(x, group)
        got = _C.range_statistic(x.to(DEV), group)
        assert got.device.type == DEV.type and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want)
        torch.testing.assert_close(got.cpu(), stats._range_statistic_torch(x.float(), group),
                                   rtol=1e-5, atol=0.0)
