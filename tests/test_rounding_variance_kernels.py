"""The compiled kernels of the sampled rounding variances (``cpp_ext/variance_cpu.cpp``) against
their torch twins in ``functional/_rounding_variance.py``, bit for bit.

Forward (``rounding_variance_codes``): the 1-bit codes (data, lo, step) of the variances at
``offset, offset + stride, ...``, over shapes, widths (one, per sample), group sizes, source
dtypes and layouts (contiguous, transposed, channels-last), plain values and a norm's fused
``(x - shift) * scale`` with per-row and per-channel statistics, and special values (NaN and
Inf groups, values on the grid, constant groups). Backward (``rounding_variance_correct_``):
the in-place correction over gradient layouts (expanded, channels-last) and optional scale,
weight and divisor. Plus: the same bits at one and two threads, the (offset, seed) draw
(uniform, reproducible under ``torch.manual_seed``, no tensor read), and bad input named.
Statistics of the estimator itself are ``tests/test_bias.py``'s.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from actnn_zoo.functional import _rounding_variance as rv
from actnn_zoo.quant import SampleBits, quantize

from _ext import compiled_extension

NEEDED = ("rounding_variance_codes", "rounding_variance_correct_", "draw_sample")
SHAPES = [(7,), (3, 5), (4, 3, 6), (2, 3, 4, 5), (5, 40), (1, 300), (3, 2, 2, 2, 3)]


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    """The saved buffers ([lo | step | bits], uint8) equal byte for byte (NaN metadata too)."""
    assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
    assert torch.equal(a, b), "codes differ"


def _widths(kind: str, n: int):
    if kind == "sample":
        b = torch.tensor([2, 4, 1, 8, 2, 2, 4][:n], dtype=torch.uint8)
        return SampleBits(b, int(b.sum()))
    return int(kind)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (same values, same logical order) laid out differently in memory."""
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t


def _source(shape, dtype, gen):
    x = torch.randn(shape, generator=gen) * 2.0
    return x.to(dtype)


def _both(q, src, stride, draw, **kw):
    """(kernel's codes, twin's codes) for one draw."""
    sample, got = rv.sample_variance(q, src, "stochastic", stride, draw=draw, **kw)
    assert sample == (draw[0], stride)
    shift, scale = kw.get("shift"), kw.get("scale")
    want = rv._sample_torch(q, src, shift, scale, kw.get("stat", (1, 0)), draw[0], stride,
                            draw[1])
    return got, want


@settings(max_examples=80, deadline=None)
@given(shape=st.sampled_from(SHAPES), widths=st.sampled_from(["1", "2", "4", "8", "sample"]),
       group=st.sampled_from([8, 16, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       layout=st.sampled_from(["contiguous", "transposed", "channels_last"]),
       stride=st.integers(1, 40), data=st.data())
def test_codes_match_the_twin(shape, widths, group, dtype, layout, stride, data):
    compiled_extension(*NEEDED)
    seed = data.draw(st.integers(0, 2 ** 31 - 2), "seed")
    offset = data.draw(st.integers(0, stride - 1), "offset")
    gen = torch.Generator().manual_seed(seed)
    x = _source(shape, dtype, gen)
    q = quantize(x.float(), _widths(widths, shape[0] if len(shape) >= 2 else 1), group,
                 seed=seed)
    got, want = _both(q, _layout(x, layout), stride, (offset, seed))
    _same_codes(got, want)
    unpacked = rv.unpack_codes(got, x.numel(), stride)
    assert unpacked.numel() == -(-x.numel() // stride) and unpacked.bits == 1
    assert got.numel() == rv.variance_nbytes(x.numel(), stride)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 4), c=st.integers(1, 6), spatial=st.sampled_from([(), (3,), (2, 5)]),
       per_channel=st.booleans(), widths=st.sampled_from(["2", "4", "sample"]),
       group=st.sampled_from([8, 32, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       stride=st.integers(1, 20), data=st.data())
def test_normalized_codes_match_the_twin(n, c, spatial, per_channel, widths, group, dtype,
                                         stride, data):
    """A norm's fused path: x_hat = (x - shift[s]) * scale[s], s per channel (batch norm) or
    per row of the trailing dims (layer norm), computed in float64 for a float64 x."""
    compiled_extension(*NEEDED)
    seed = data.draw(st.integers(0, 2 ** 31 - 2), "seed")
    offset = data.draw(st.integers(0, stride - 1), "offset")
    gen = torch.Generator().manual_seed(seed)
    shape = (n, c) + spatial
    x = _source(shape, dtype, gen) + 0.5
    work = torch.float64 if dtype == torch.float64 else torch.float32
    hw = max(math.prod(spatial), 1)
    if per_channel:
        stats, stat = c, (hw, c)
        view = [1, c] + [1] * len(spatial)
    else:
        stats, stat = n * c, (hw, 0)
        view = [n, c] + [1] * len(spatial)
    shift = (torch.randn(stats, generator=gen) * 0.3).to(work)
    scale = (torch.rand(stats, generator=gen) + 0.5).to(work)
    x_hat = ((x.to(work) - shift.view(view)) * scale.view(view)).float()
    q = quantize(x_hat, _widths(widths, n), group, seed=seed)
    got, want = _both(q, x, stride, (offset, seed), shift=shift.view(view),
                      scale=scale.view(view), stat=stat)
    _same_codes(got, want)


def test_special_values_match_the_twin():
    """NaN and Inf groups (bad metadata), values exactly on the grid (no variance), constant
    groups (step 0), a huge step whose square overflows."""
    compiled_extension(*NEEDED)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    x[0, 3] = float("nan")
    x[1, 10] = float("inf")
    x[2] = 1.25  # one value: step 0
    x[3] = torch.arange(64, dtype=torch.float32) % 4  # on the 2-bit grid of [0, 3]
    x[4, :16] = 3e38  # a range past float32's largest value: a NaN group
    x[4, 16:32] = -3e38
    x[4, 32:48] = 1e38 * torch.rand(16, generator=torch.Generator().manual_seed(6))
    x[4, 48:] = -1e38  # step ~ 7e37: its square overflows to an Inf variance
    for stride in (1, 3, 8):
        for group in (8, 64):
            q = quantize(x, 2, group, seed=9)
            got, want = _both(q, x, stride, (stride - 1, 123))
            _same_codes(got, want)


def _correct_both(gi, go, draw, stride, codes, **kw):
    got = rv.correct_(gi.clone(memory_format=torch.preserve_format), go, draw, codes, **kw)
    want = rv._correct_torch(gi.clone(memory_format=torch.preserve_format), go, draw[0],
                             stride, codes, kw.get("scale"), kw.get("weight"),
                             kw.get("stat", (1, 0)), kw.get("weight_stat", (1, 0)),
                             kw.get("divisor", 1.0))
    return got, want


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 4), c=st.integers(1, 6), spatial=st.sampled_from([(), (3,), (2, 5)]),
       stride=st.integers(1, 20), with_scale=st.booleans(), with_weight=st.booleans(),
       per_channel=st.booleans(), divisor=st.sampled_from([1.0, 3.0, 7.0, 1000.0]),
       grad_layout=st.sampled_from(["contiguous", "expanded", "channels_last", "transposed"]),
       gi_layout=st.sampled_from(["contiguous", "channels_last", "transposed"]), data=st.data())
def test_correction_matches_the_twin(n, c, spatial, stride, with_scale, with_weight,
                                     per_channel, divisor, grad_layout, gi_layout, data):
    compiled_extension(*NEEDED)
    seed = data.draw(st.integers(0, 2 ** 31 - 2), "seed")
    offset = data.draw(st.integers(0, stride - 1), "offset")
    gen = torch.Generator().manual_seed(seed)
    shape = (n, c) + spatial
    x = torch.randn(shape, generator=gen)
    q = quantize(x, 2, 32, seed=seed)
    draw, codes = rv.sample_variance(q, x, "stochastic", stride, draw=(offset, seed))
    hw = max(math.prod(spatial), 1)
    stat = (hw, c) if per_channel else (hw, 0)
    stats = c if per_channel else n * c
    scale = torch.rand(stats, generator=gen) + 0.5 if with_scale else None
    weight = torch.randn(c, generator=gen) if with_weight else None
    if grad_layout == "expanded":
        go = torch.randn((), generator=gen).expand(shape)
    else:
        go = _layout(torch.randn(shape, generator=gen), grad_layout)
    gi = _layout(torch.randn(shape, generator=gen), gi_layout)
    got, want = _correct_both(gi, go, draw, stride, codes, scale=scale, weight=weight,
                              stat=stat, weight_stat=(hw, c), divisor=divisor)
    assert torch.equal(got, want)
    assert got.stride() == gi.stride()


@settings(max_examples=12, deadline=None)
@given(per_channel=st.booleans(), group=st.sampled_from([24, 256]),
       stride=st.sampled_from([1, 3, 8]), widths=st.sampled_from(["2", "sample"]),
       data=st.data())
def test_walked_indices_match_the_twin_across_groups_and_tasks(per_channel, group, stride,
                                                               widths, data):
    """The CPU loops step the row, group and statistic indices from a task's first kept value
    on (no division per value): a norm-sized input of 144,627 values, so the forward fills
    hundreds of 256-slot groups and the backward runs several 16,384-value tasks at every
    stride, rows of 48,209 values (the walk crosses rows and groups mid-task), a group size
    that is not a power of two, and both factors of the correction."""
    compiled_extension(*NEEDED)
    seed = data.draw(st.integers(0, 2 ** 31 - 2), "seed")
    offset = data.draw(st.integers(0, stride - 1), "offset")
    gen = torch.Generator().manual_seed(seed)
    n, c, spatial = 3, 7, (71, 97)
    hw = math.prod(spatial)
    x = torch.randn((n, c) + spatial, generator=gen) + 0.5
    if per_channel:
        stats, stat, view = c, (hw, c), [1, c, 1, 1]
    else:
        stats, stat, view = n * c, (hw, 0), [n, c, 1, 1]
    shift = torch.randn(stats, generator=gen) * 0.3
    scale = torch.rand(stats, generator=gen) + 0.5
    q = quantize((x - shift.view(view)) * scale.view(view), _widths(widths, n), group, seed=seed)
    got, want = _both(q, x, stride, (offset, seed), shift=shift.view(view),
                      scale=scale.view(view), stat=stat)
    _same_codes(got, want)
    go, gi = torch.randn(x.shape, generator=gen), torch.randn(x.shape, generator=gen)
    weight = torch.randn(c, generator=gen)
    fixed, twin = _correct_both(gi, go, (offset, stride), stride, got, scale=scale,
                                weight=weight, stat=stat, weight_stat=(hw, c), divisor=7.0)
    assert torch.equal(fixed, twin)
    assert not torch.equal(fixed, gi)  # the correction was added


def test_same_bits_at_any_thread_count():
    """Work is split into 1-bit groups of 256 slots (forward) and runs of kept indices
    (backward): the result must not depend on the split."""
    compiled_extension(*NEEDED)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4096, generator=gen)
    q = quantize(x, 2, 256, seed=1)
    go, gi = torch.randn(x.shape, generator=gen), torch.randn(x.shape, generator=gen)
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            sample, codes = rv.sample_variance(q, x, "stochastic", 3, draw=(1, 77))
            out.append((codes, rv.correct_(gi.clone(), go, sample, codes)))
    finally:
        torch.set_num_threads(before)
    _same_codes(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_draw_is_uniform_reproducible_and_reads_no_tensor():
    compiled_extension(*NEEDED)
    torch.manual_seed(4)
    first = [rv.draw_sample(7) for _ in range(5)]
    torch.manual_seed(4)
    assert [rv.draw_sample(7) for _ in range(5)] == first
    assert all(0 <= s < 2 ** 31 for _, s in first)
    # offsets uniform over [0, 7): chi-square with 6 degrees of freedom over 7000 draws;
    # P(chi2 > 30) ~ 4e-5
    counts = [0] * 7
    for _ in range(7000):
        counts[rv.draw_sample(7)[0]] += 1
    chi2 = sum((k - 1000) ** 2 / 1000 for k in counts)
    assert chi2 < 30, counts
    # a whole sample + correction on the CPU dispatches no torch op but the allocation of the
    # codes: no host read (_local_scalar_dense), no small ops
    x = torch.randn(4, 16)
    q = quantize(x, 2, 256, seed=1)
    gi, go = torch.randn(4, 16), torch.randn(4, 16)
    with _Ops() as ops:
        sample, codes = rv.sample_variance(q, x, "stochastic", 8)
        rv.correct_(gi, go, sample, codes)
    assert ops.names == ["empty"], ops.names


def test_bad_input_is_named():
    ext = compiled_extension(*NEEDED)
    x = torch.randn(4, 16)
    q = quantize(x, 2, 8, seed=1)
    with pytest.raises(ValueError, match="stride"):
        rv.sample_variance(q, x, "stochastic", 0)
    with pytest.raises(ValueError, match="offset"):
        rv.sample_variance(q, x, "stochastic", 4, draw=(4, 1))
    with pytest.raises(ValueError, match="values for a payload"):
        rv.sample_variance(q, x[:2], "stochastic", 4)
    with pytest.raises(ValueError, match="together"):
        rv.sample_variance(q, x, "stochastic", 4, shift=torch.zeros(4))
    with pytest.raises(ValueError, match="block"):
        rv.sample_variance(q, x, "stochastic", 4, shift=torch.zeros(4), scale=torch.ones(4),
                           stat=(0, 0))
    sample, codes = rv.sample_variance(q, x, "stochastic", 4, draw=(1, 3))
    with pytest.raises(ValueError, match="one shape"):
        rv.correct_(torch.zeros(4, 16), torch.zeros(2, 16), sample, codes)
    with pytest.raises((RuntimeError, ValueError), match="scale has 2 values"):
        rv.correct_(torch.zeros(4, 16), torch.zeros(4, 16), sample, codes,
                    scale=torch.ones(2), stat=(16, 0))
    with pytest.raises((RuntimeError, ValueError), match="lo and step"):
        ext.rounding_variance_codes(q.lo.float(), q.step, None, 2, 8, x, None, None, 1, 0, 0,
                                    4, 1)
    with pytest.raises((RuntimeError, ValueError), match="groups per row"):
        ext.rounding_variance_codes(q.lo[:2], q.step[:2], None, 2, 8, x, None, None, 1, 0, 0,
                                    4, 1)
    with pytest.raises((RuntimeError, ValueError), match="bits must be"):
        ext.rounding_variance_codes(q.lo, q.step, None, 3, 8, x, None, None, 1, 0, 0, 4, 1)
    with pytest.raises((RuntimeError, ValueError), match="grad_in and grad must be float32"):
        ext.rounding_variance_correct_(torch.zeros(4, 16, dtype=torch.float64),
                                       torch.zeros(4, 16), codes, 1, 4, None, 1, 0, None, 1, 0,
                                       1.0)
    with pytest.raises((RuntimeError, ValueError), match="overlap"):
        ext.rounding_variance_correct_(torch.zeros(16).expand(4, 16), torch.zeros(4, 16),
                                       codes, 1, 4, None, 1, 0, None, 1, 0, 1.0)
    with pytest.raises((RuntimeError, ValueError), match="codes must be"):
        ext.rounding_variance_correct_(torch.zeros(4, 32), torch.zeros(4, 32), codes, 1, 4,
                                       None, 1, 0, None, 1, 0, 1.0)
    with pytest.raises(ValueError, match="uint8 bytes"):
        rv.unpack_codes(codes[1:], 64, 4)
