"""The quantization contract (docs/design.md), tested through the public API on the active backend."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import actnn_zoo as az
from actnn_zoo.quant import SampleBits, pack_mask, unpack_mask
from actnn_zoo.quant import reference as ref

BITS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def per_element(meta: torch.Tensor, shape, group_size: int) -> torch.Tensor:
    """(N, G) metadata expanded to the (N, D) rows of a tensor of ``shape``."""
    n = shape[0] if len(shape) >= 2 else 1
    d = math.prod(shape) // n if n else 0
    return meta.float().repeat_interleave(group_size, dim=1)[:, :d].reshape(shape)


def dtype_slack(dtype: torch.dtype, y: torch.Tensor) -> torch.Tensor:
    """Extra error from casting the fp32 dequantized value back to a 16-bit dtype."""
    if dtype == torch.float32:
        return torch.zeros_like(y)
    return y.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_one_step(bits, dtype):
    torch.manual_seed(0)
    x = (torch.randn(6, 1000) * 3).to(dtype)
    q = az.quantize(x, bits)
    y = az.dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    step = per_element(q.step, x.shape, 256)
    err = (y.float() - x.float()).abs()
    assert (err <= step + dtype_slack(dtype, y.float())).all()


@pytest.mark.parametrize("bits", BITS)
def test_values_lie_inside_the_stored_range(bits):
    torch.manual_seed(1)
    x = torch.randn(4, 700) * torch.logspace(-3, 3, 4).unsqueeze(1)
    q = az.quantize(x, bits, group_size=64)
    lo = per_element(q.lo, x.shape, 64)
    hi = lo + ((1 << bits) - 1) * per_element(q.step, x.shape, 64)
    assert (x >= lo).all() and (x <= hi).all()
    # lo and step are bfloat16: ~0.125 extra bits per value at group size 256.
    assert q.lo.dtype == torch.bfloat16 and q.step.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", BITS)
def test_nearest_rounding_error_is_at_most_half_a_step(bits):
    torch.manual_seed(2)
    x = torch.randn(3, 512)
    q = az.quantize(x, bits, rounding="nearest")
    step = per_element(q.step, x.shape, 256)
    err = (az.dequantize(q) - x).abs()
    assert (err <= 0.5 * step * (1 + 1e-5) + 1e-7).all()


# ----------------------------------------------------------------------------- unbiasedness
@pytest.mark.parametrize("bits", (1, 2))
def test_mean_over_seeds_converges_at_one_over_sqrt_k(bits):
    """E[dequantize(quantize(x))] = x, and the error of the mean falls like 1/sqrt(K).

    One draw's error per value is a two-point variable of variance <= step^2 / 4, so the mean of
    K draws has standard error <= step / (2 sqrt(K)). We require every one of the 1024 values to
    be within 5 standard errors (a false alarm has probability < 1e-3), and the RMS error at
    K = 4000 to be 2.5x-6x smaller than at K = 250 (1/sqrt(K) predicts 4x).
    """
    torch.manual_seed(3)
    x = torch.randn(4, 256) * 2
    k_small, k_big = 250, 4000
    total = torch.zeros_like(x)
    rms = {}
    for s in range(k_big):
        total += az.dequantize(az.quantize(x, bits, seed=s))
        if s + 1 == k_small:
            rms[k_small] = ((total / k_small - x) ** 2).mean().sqrt()
    mean = total / k_big
    rms[k_big] = ((mean - x) ** 2).mean().sqrt()
    step = per_element(az.quantize(x, bits, seed=0).step, x.shape, 256)
    assert ((mean - x).abs() <= 5 * step / (2 * math.sqrt(k_big))).all()
    assert 2.5 < rms[k_small] / rms[k_big] < 6.0


def test_seed_determinism_and_torch_generator():
    x = torch.randn(3, 300)
    a, b = az.quantize(x, 2, seed=7), az.quantize(x, 2, seed=7)
    assert torch.equal(a.data, b.data)
    assert not torch.equal(a.data, az.quantize(x, 2, seed=8).data)
    torch.manual_seed(11)
    c = az.quantize(x, 2)
    torch.manual_seed(11)
    d = az.quantize(x, 2)
    assert torch.equal(c.data, d.data)


def test_result_does_not_depend_on_strides():
    torch.manual_seed(4)
    x = torch.randn(8, 16, 5, 5)
    cl = x.to(memory_format=torch.channels_last)
    assert torch.equal(az.quantize(x, 2, seed=1).data, az.quantize(cl, 2, seed=1).data)
    t = torch.randn(40, 30).t()  # non-contiguous
    assert torch.equal(az.quantize(t, 4, seed=2).data, az.quantize(t.contiguous(), 4, seed=2).data)
    y = az.dequantize(az.quantize(cl, 8, seed=3))
    assert y.shape == x.shape and (y - x).abs().max() < 0.1


# ------------------------------------------------------------------------ packing and sizes
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("d", (1, 7, 8, 9, 255, 257, 1000))
def test_packing_is_exact_at_every_length(bits, d):
    torch.manual_seed(d)
    codes = torch.randint(0, 1 << bits, (3, d), dtype=torch.uint8)
    row_bits = torch.full((3,), bits, dtype=torch.uint8)
    offsets = ref.row_offsets(d, row_bits)
    packed = ref.pack_codes(codes, row_bits, offsets, int(offsets[-1]))
    assert packed.numel() == 3 * math.ceil(d * bits / 8)
    assert torch.equal(ref.unpack_codes(packed, row_bits, offsets, d), codes)


@pytest.mark.parametrize("bits", BITS)
def test_codes_round_trip_through_the_backend(bits):
    """Values already on the quantization grid come back exactly, at every width."""
    torch.manual_seed(5)
    d = 301
    levels = (1 << bits) - 1
    codes = torch.randint(0, levels + 1, (2, d)).float()
    codes[:, 0], codes[:, 1] = 0, levels  # pin the range to [0, levels]
    q = az.quantize(codes, bits, group_size=512)
    assert torch.equal(q.lo.float(), torch.zeros(2, 1)) and torch.equal(q.step.float(), torch.ones(2, 1))
    assert torch.equal(az.dequantize(q), codes)
    assert q.data.numel() == 2 * math.ceil(d * bits / 8)


def test_mixed_precision_buffer_has_exactly_the_implied_size():
    torch.manual_seed(6)
    d = 777
    widths = torch.tensor([1, 8, 2, 4, 2, 1, 8])
    x = torch.randn(len(widths), d)
    q = az.quantize(x, widths, group_size=128)
    assert q.mixed and q.data.numel() == sum(math.ceil(d * int(b) / 8) for b in widths)
    y = az.dequantize(q)
    step = per_element(q.step, x.shape, 128)
    assert ((y - x).abs() <= step).all()
    for n, b in enumerate(widths.tolist()):  # each row matches a uniform quantization's range
        row = az.quantize(x[n:n + 1], b, group_size=128)
        assert torch.equal(row.step, q.step[n:n + 1])
    assert q.nbytes == (q.data.numel() + 2 * 2 * q.lo.numel() + widths.numel()
                        + 8 * (widths.numel() + 1))


@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.sampled_from(BITS), min_size=1, max_size=12),
       d=st.integers(1, 700), spare=st.integers(0, 40), seed=st.integers(0, 2 ** 31 - 1))
def test_sample_bits_reads_nothing_back_and_matches_a_widths_tensor(widths, d, spare, seed):
    """SampleBits sizes the buffer from the host bound (rows first, zeros after them) and
    otherwise gives exactly what a plain widths tensor gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(widths), d, generator=g)
    b = torch.tensor(widths, dtype=torch.uint8)
    plain = az.quantize(x, b, group_size=64, seed=seed)
    bound = az.quantize(x, SampleBits(b, sum(widths) + spare), group_size=64, seed=seed)
    used = plain.data.numel()
    assert bound.data.numel() == (d * (sum(widths) + spare) + 7 * len(widths)) // 8 >= used
    assert torch.equal(bound.data[:used], plain.data)
    assert not bool(bound.data[used:].any())
    assert torch.equal(bound.lo.view(torch.int16), plain.lo.view(torch.int16))
    assert torch.equal(bound.offsets, plain.offsets) and torch.equal(bound.row_bits, b)
    assert torch.equal(az.dequantize(bound), az.dequantize(plain))
    assert bound.nbytes == plain.nbytes + bound.data.numel() - used


@settings(max_examples=30, deadline=None)
@given(widths=st.lists(st.sampled_from(BITS), min_size=1, max_size=6),
       inner=st.lists(st.integers(1, 40), min_size=1, max_size=2), spare=st.integers(0, 9),
       group=st.sampled_from([32, 64, 256]), seed=st.integers(0, 2 ** 31 - 1))
def test_sample_bits_one_call_equals_the_checked_layout(widths, inner, spare, group, seed):
    """On the CPU, SampleBits quantize in one compiled call (``quantize_samples``: layout and
    kernel); with the debug checks on (``validate=True``) the layout is made in Python and
    checked first: the same payload, field for field."""
    from actnn_zoo.quant.backend import kernels

    x = torch.randn(len(widths), *inner, generator=torch.Generator().manual_seed(seed))
    sb = SampleBits(torch.tensor(widths, dtype=torch.uint8), sum(widths) + spare)
    ext = kernels(x.device)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = ext.quantize_samples
        mp.setattr(ext, "quantize_samples", lambda *a: calls.append(1) or real(*a))
        fast = az.quantize(x, sb, group_size=group, seed=seed)
        checked = az.quantize(x, sb, group_size=group, seed=seed, validate=True)
    assert len(calls) == 1  # the one call took the first; the checks, the second
    for name in ("data", "lo", "step", "row_bits", "offsets"):
        a, b = getattr(fast, name), getattr(checked, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert fast.shape == checked.shape == x.shape and fast.bits is None


def test_sample_bits_promises_are_checked_on_cpu():
    x = torch.randn(3, 50)
    b = torch.tensor([2, 4, 1], dtype=torch.uint8)
    with pytest.raises(ValueError, match="sums to 7, more than max_sum=6"):
        az.quantize(x, SampleBits(b, 6))
    with pytest.raises(ValueError, match=r"entries must be in \(1, 2, 4, 8\)"):
        az.quantize(x, SampleBits(torch.tensor([2, 3, 1], dtype=torch.uint8), 10))
    with pytest.raises(ValueError, match="3 entries but the tensor has 4 samples"):
        az.quantize(torch.randn(4, 50), SampleBits(b, 7))
    with pytest.raises(TypeError, match="1-d uint8"):
        SampleBits(b.long(), 7)
    with pytest.raises(ValueError, match="non-negative int"):
        SampleBits(b, -1)


@pytest.mark.parametrize("bits,limit", [(2, 1 / 15), (4, 1 / 7.5), (8, 1 / 3.8)])
def test_storage_limits(bits, limit):
    x = torch.randn(64, 4096)
    q = az.quantize(x, bits)
    assert q.nbytes <= limit * x.numel() * x.element_size()
    assert q.bits_per_value == pytest.approx(bits + 32 / 256, rel=1e-6)


# -------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3)])
def test_empty(shape):
    x = torch.empty(shape)
    q = az.quantize(x, 2)
    y = az.dequantize(q)
    assert y.shape == x.shape and q.data.numel() == 0


def test_zero_dim_and_single_element():
    for x in (torch.tensor(3.25), torch.tensor([-1.5]), torch.tensor([[7.0]])):
        q = az.quantize(x, 2)
        y = az.dequantize(q)
        assert y.shape == x.shape
        assert (y - x).abs().max() <= q.step.float().max()


def test_constant_groups_are_exact_when_representable():
    x = torch.full((3, 600), 0.75)  # 0.75 is a bfloat16 value: lo = 0.75, step = 0
    q = az.quantize(x, 2)
    assert torch.equal(az.dequantize(q), x)
    y = torch.full((2, 300), 0.1)  # not a bfloat16 value: still within one step
    qy = az.quantize(y, 2)
    assert ((az.dequantize(qy) - y).abs() <= qy.step.float().max()).all()


def test_huge_and_denormal_values():
    big = torch.tensor([[1e30, -1e30, 3e29, 0.0] * 64])
    q = az.quantize(big, 8)
    y = az.dequantize(q)
    assert torch.isfinite(y).all() and ((y - big).abs() <= q.step.float().max()).all()
    tiny = torch.tensor([[1e-40, -3e-41, 0.0, 5e-39] * 64])  # float32 denormals
    qt = az.quantize(tiny, 8)
    yt = az.dequantize(qt)
    assert torch.isfinite(yt).all() and ((yt - tiny).abs() <= qt.step.float().max()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_poison_only_their_group(bad):
    x = torch.randn(2, 512)
    x[1, 300] = bad
    y = az.dequantize(az.quantize(x, 2, group_size=256))
    assert torch.isnan(y[1, 256:]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :256]).all()


# ------------------------------------------------------------------------------- bad input
def test_bad_arguments_name_the_problem():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bits"):
        az.quantize(x, 3)
    with pytest.raises(ValueError, match="bits"):
        az.quantize(x, True)
    with pytest.raises(ValueError, match="group_size"):
        az.quantize(x, 2, group_size=0)
    with pytest.raises(ValueError, match="group_size"):
        az.quantize(x, 2, group_size=12)
    with pytest.raises(TypeError, match="x must be"):
        az.quantize(torch.arange(8), 2)
    with pytest.raises(TypeError, match="x must be"):
        az.quantize(x.double(), 2)
    with pytest.raises(ValueError, match="rounding"):
        az.quantize(x, 2, rounding="up")
    with pytest.raises(ValueError, match="4 samples"):
        az.quantize(x, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="bits entries"):
        az.quantize(x, torch.tensor([2, 3, 2, 2]))
    with pytest.raises(TypeError, match="bits as a tensor"):
        az.quantize(x, torch.tensor([2.0, 2.0, 2.0, 2.0]))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        az.dequantize(x)


# ------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("n", (0, 1, 7, 8, 9, 1001))
def test_mask_packing_round_trip(n):
    torch.manual_seed(n)
    m = torch.rand(n) > 0.5
    p = pack_mask(m)
    assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
    assert torch.equal(unpack_mask(p, m.shape), m)


def test_mask_keeps_shape_and_rejects_bad_input():
    m = torch.rand(3, 5, 7) > 0.3
    assert torch.equal(unpack_mask(pack_mask(m), m.shape), m)
    with pytest.raises(TypeError, match="bool"):
        pack_mask(torch.ones(3))
    with pytest.raises(ValueError, match="does not hold"):
        unpack_mask(pack_mask(m), (3, 5, 9))


# -------------------------------------------------------------------------- random shapes
@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 37), min_size=0, max_size=4),
       bits=st.sampled_from(BITS), group_size=st.sampled_from((8, 32, 256)),
       dtype=st.sampled_from(DTYPES), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2 ** 31 - 2))
def test_random_shapes_round_trip(shape, bits, group_size, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    q = az.quantize(x, bits, group_size=group_size, seed=seed)
    y = az.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    n = x.shape[0] if x.dim() >= 2 else 1
    d = x.numel() // n if n else 0
    assert q.data.numel() == n * math.ceil(d * bits / 8)
    if x.numel():
        step = per_element(q.step, x.shape, group_size)
        assert ((y.float() - x.float()).abs() <= step + dtype_slack(dtype, y.float())).all()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), d=st.integers(0, 300), bits=st.sampled_from([1, 2, 4, 8]))
def test_compiled_uniform_layout_is_the_reference_layout(n, d, bits):
    """_C.uniform_layout (what a one-width payload's row_layout uses on the CPU) gives the
    widths and row offsets the torch reference makes; a bad width is named."""
    from _ext import compiled_extension

    ext = compiled_extension("uniform_layout")
    widths, offsets = ext.uniform_layout(n, d, bits)
    assert torch.equal(widths, torch.full((n,), bits, dtype=torch.uint8))
    assert torch.equal(offsets, ref.uniform_offsets(n, d, bits, torch.device("cpu")))
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8, got 3"):
        ext.uniform_layout(n, d, 3)


def test_one_width_row_layout_matches_its_codes():
    x = torch.randn(5, 3, 7)
    q = az.quantize(x, 4, group_size=8, seed=1)
    widths, offsets = q.row_layout()
    assert torch.equal(widths, torch.full((5,), 4, dtype=torch.uint8))
    assert int(offsets[-1]) == q.data.numel()  # the rows tile the codes exactly
    mixed = az.quantize(x, torch.tensor([4, 4, 4, 4, 4]), group_size=8, seed=1)
    assert torch.equal(mixed.offsets, offsets) and torch.equal(mixed.data, q.data)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=4),
       width=st.sampled_from(BITS + ("samples",)), group=st.sampled_from((8, 32, 256)),
       dtype=st.sampled_from(DTYPES), stochastic=st.booleans(), seed=st.integers(0, 2 ** 20))
def test_layers_entry_matches_the_public_quantize(shape, width, group, dtype, stochastic, seed):
    """quantize_saved / dequantize_saved (what the Q-layers call, skipping the checks their
    qconfig made) give the public functions' payload and values: same seed drawn, same
    codes, ranges, widths and offsets, same decoded tensor."""
    from actnn_zoo.quant.api import dequantize_saved, quantize_saved
    quantize, dequantize = az.quant.quantize, az.quant.dequantize

    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    n = x.shape[0] if x.dim() >= 2 else 1
    if width == "samples":
        w = torch.tensor([(1, 2, 4, 8)[i % 4] for i in range(n)], dtype=torch.uint8)
        bits = SampleBits(w, int(w.sum()))
    else:
        bits = width
    torch.manual_seed(seed)
    got = quantize_saved(x, bits, group, stochastic)
    torch.manual_seed(seed)
    want = quantize(x, bits, group, rounding="stochastic" if stochastic else "nearest")
    assert got.spec() == want.spec()
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(dequantize_saved(got), dequantize(want))


@pytest.mark.parametrize("mixed", [False, True])
def test_made_payload_is_the_constructed_one(mixed):
    """``QuantizedTensor.made`` (the quantizers' constructor without the dataclass's per-field
    setattr) gives the object the public constructor gives: the same fields, holding the same
    objects, frozen alike."""
    import dataclasses

    from actnn_zoo.quant.tensor import QuantizedTensor

    data, lo, step = torch.zeros(8, dtype=torch.uint8), torch.zeros(2, 1), torch.ones(2, 1)
    rb, off = ((torch.tensor([2, 2], dtype=torch.uint8), torch.tensor([0, 4, 8]))
               if mixed else (None, None))
    args = (data, lo, step, torch.Size([2, 16]), torch.float16, None if mixed else 2, 64, rb,
            off, "hadamard", 7)
    a, b = QuantizedTensor(*args), QuantizedTensor.made(*args)
    assert type(b) is QuantizedTensor and list(vars(a)) == list(vars(b))
    assert all(vars(a)[k] is vars(b)[k] for k in vars(a))
    assert b.spec() == a.spec() and b.mixed is mixed and repr(a) == repr(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.bits = 4


@pytest.mark.parametrize("width", [2, "samples"])
def test_layers_entry_reads_an_input_that_requires_grad_as_it_is(width):
    """On the CPU with the compiled kernels, quantize_saved of an input that requires a
    gradient (a layer's input in the forward, grad mode on) dispatches no detach of it: the
    kernels read it through its pointer (per-sample widths through a row view made in C++
    under no_grad). The payload is the detached input's, code for code, and nothing of it
    requires a gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from actnn_zoo.quant.api import quantize_saved
    from actnn_zoo.quant.backend import extension

    if extension() is None:
        pytest.skip("the reference kernels are torch ops: they take the input detached")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 5, 40, requires_grad=True)
    bits = (SampleBits(torch.tensor([2, 4, 1], dtype=torch.uint8), 7) if width == "samples"
            else width)
    torch.manual_seed(3)
    with Ops() as ops:
        got = quantize_saved(x, bits, 32, True)
    assert "aten.detach" not in ops.names and "aten.reshape" not in ops.names, ops.names
    assert ops.names.count("aten.view") == (width == "samples"), ops.names
    torch.manual_seed(3)
    want = quantize_saved(x.detach(), bits, 32, True)
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(a, b) and not a.requires_grad
    assert x.grad_fn is None and x._version == 0


def test_layers_entry_checks_what_the_qconfig_does_not():
    """The Q-layers' entry still refuses what no qconfig vouches for: an unsupported dtype,
    an invalid int width, per-sample widths of the wrong length."""
    from actnn_zoo.quant.api import quantize_saved

    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quantize_saved(torch.zeros(2, 4, dtype=torch.float64), 2, 256, True)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_saved(torch.zeros(2, 4), 3, 256, True)
    with pytest.raises(ValueError, match="entries"):
        quantize_saved(torch.zeros(2, 4), SampleBits(torch.full((3,), 2, dtype=torch.uint8),
                                                     6), 256, True)


# ----------------------------------------------------------------------------------------------
# dropout's scale, computed on the host
# ----------------------------------------------------------------------------------------------
_EDGE_P = [0.0, 1e-9, 2.0 ** -30, 0.1, 0.5, 0.9, 1 - 2.0 ** -24, 0.999999, 1 - 1e-12, 1.0]


@settings(max_examples=400, deadline=None)
@given(p=st.one_of(st.floats(0.0, 1.0), st.sampled_from(_EDGE_P)),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_dropout_scale_equals_the_tensor_division(p, dtype):
    """``dropout_scale`` (host arithmetic) is bit for bit what torch's dropout computes its
    noise with, ``ones(dtype).div_(1 - p)`` on the CPU, for every float dtype and p in [0, 1]
    (overflow to inf in half precision, and p = 1, included)."""
    from actnn_zoo.quant.api import dropout_scale

    want = torch.ones((), dtype=dtype).div_(1 - p).item()
    got = dropout_scale(dtype, p)
    assert got == want or (math.isnan(got) and math.isnan(want)), (p, dtype, got, want)


def test_dropout_scale_makes_no_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    from actnn_zoo.quant.api import dropout_scale

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            dropout_scale(dtype, 0.1)
    assert Count.n == 0
