"""Q-pools and QUpsample: outputs and gradients identical to torch; max-pools save only the
bit-packed argmax position inside each window, average pools and upsampling save nothing."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo.nn as qnn
from actnn_zoo.functional.pool import _window_offsets, code_bits, pack_codes, unpack_codes
from actnn_zoo.nn import QModule

from _checks_b import assert_identical, run, saved_bytes


def _q(float_mod: nn.Module) -> QModule:
    return getattr(qnn, "Q" + type(float_mod).__name__).from_float(float_mod)


def _x(shape, dtype=torch.float32, layout=None, ties=False, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
    x = x.to(dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    return x


def _check_same(ref: nn.Module, x: torch.Tensor, kind: str):
    y_ref, g_ref, grad = run(ref, x)
    q = _q(ref)
    y_q, g_q, _ = run(q, x, grad)
    if isinstance(y_ref, tuple):
        assert_identical(y_q[1], y_ref[1])  # return_indices: torch's indices
        y_ref, y_q = y_ref[0], y_q[0]
    assert type(y_q.grad_fn).__name__ == kind
    assert_identical(y_q, y_ref)
    assert_identical(g_q, g_ref)
    return y_q


# ----------------------------------------------------------------------------------------------
# Max pooling: identical outputs and exact gradients (overlapping windows included)
# ----------------------------------------------------------------------------------------------
MAXPOOL_CASES = [
    (nn.MaxPool1d(2), (2, 3, 11)),
    (nn.MaxPool1d(3, stride=1, padding=1), (2, 3, 11)),                # overlapping
    (nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True), (2, 3, 12)),
    (nn.MaxPool1d(4, 3, return_indices=True), (3, 13)),                # unbatched
    (nn.MaxPool2d(2), (2, 3, 8, 9)),
    (nn.MaxPool2d(3, 2, 1), (2, 3, 9, 9)),                             # overlapping, ResNet
    (nn.MaxPool2d(3, 1), (2, 2, 7, 8)),                                # heavy overlap
    (nn.MaxPool2d((2, 3), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True), (2, 3, 9, 10)),
    (nn.MaxPool2d(3, 2, ceil_mode=True, return_indices=True), (3, 8, 8)),  # unbatched
    (nn.MaxPool2d(5, 1, 2), (1, 2, 7, 7)),                             # 25 -> 5 bits
    (nn.MaxPool2d(3, 1, 1), (1, 2, 2, 2)),          # window wider than input: slow path
    (nn.MaxPool2d(3, 1, 1, dilation=(1, 2)), (2, 2, 4, 4)),                # slow path
    (nn.MaxPool3d(2), (2, 2, 4, 6, 6)),
    (nn.MaxPool3d(3, 2, 1), (1, 2, 5, 6, 7)),                          # 27 -> 5 bits
    (nn.MaxPool3d((1, 3, 2), (1, 1, 2), (0, 1, 1), dilation=(1, 2, 1), ceil_mode=True,
                  return_indices=True), (1, 2, 3, 8, 7)),
]


def test_window_tables_are_built_once_per_geometry_and_reused_exactly():
    """The position tables of a pooling geometry are built once (``_positions``) and read by
    every later call: calls with other batch sizes, channels_last inputs and in between
    another geometry still give torch's outputs and exact gradients, and the shared tables
    come out of those calls unchanged."""
    from actnn_zoo.functional.pool import _positions
    pool = nn.MaxPool2d(3, 2, 1)
    _positions.cache_clear()
    _check_same(pool, _x((2, 3, 9, 9)), "MaxPoolFunctionBackward")
    assert _positions.cache_info().misses == 1  # built in forward, reused in backward
    args = ("max", (9, 9), (5, 5), (2, 2), (1, 1), (1, 1), (3, 3), 4, torch.device("cpu"))
    pos = _positions(*args)  # the forward's entry, not a new one
    assert _positions.cache_info().misses == 1
    before = (pos.table.clone(), pos.offsets.clone(), pos.base.clone())
    for shape, layout, seed in [((5, 3, 9, 9), None, 1), ((4, 3, 9, 9), torch.channels_last, 2)]:
        _check_same(pool, _x(shape, layout=layout, seed=seed), "MaxPoolFunctionBackward")
        _check_same(nn.MaxPool2d(2), _x((2, 3, 8, 9), seed=seed), "MaxPoolFunctionBackward")
    assert _positions.cache_info().misses == 2  # one more geometry
    assert _positions(*args) is pos
    for a, b in zip(before, (pos.table, pos.offsets, pos.base)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", range(len(MAXPOOL_CASES)))
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_identical_and_exact(case, ties):
    mod, shape = MAXPOOL_CASES[case]
    _check_same(mod, _x(shape, ties=ties), "MaxPoolFunctionBackward")


@pytest.mark.parametrize("mod,shape,layout", [
    (nn.MaxPool2d(3, 2, 1), (2, 8, 9, 9), torch.channels_last),
    (nn.MaxPool2d(2), (2, 8, 8, 8), torch.channels_last),
    (nn.MaxPool3d(3, 1, 1), (1, 4, 4, 5, 5), torch.channels_last_3d),
])
def test_max_pool_channels_last(mod, shape, layout):
    x = _x(shape, layout=layout)
    y = _check_same(mod, x, "MaxPoolFunctionBackward")
    assert y.is_contiguous(memory_format=layout)  # the input grad may come back contiguous
    nbytes, _ = saved_bytes(lambda: _q(mod)(x.clone().requires_grad_(True) * 1))
    assert nbytes == math.ceil(code_bits(math.prod(mod.kernel_size if isinstance(
        mod.kernel_size, tuple) else (mod.kernel_size,) * (len(shape) - 2))) * y.numel() / 8)


@pytest.mark.parametrize("layout", [None, torch.channels_last])
def test_max_pool_bf16_overlapping_exact(layout):
    # torch's CPU kernel rounds to bf16 after every add; the same op runs here
    _check_same(nn.MaxPool2d(3, 1, 1), _x((2, 3, 8, 8), dtype=torch.bfloat16, layout=layout),
                "MaxPoolFunctionBackward")


@pytest.mark.parametrize("mod,shape", [(nn.MaxPool2d(3, 2, 1), (2, 8, 9, 9)),
                                       (nn.MaxPool3d(2), (1, 4, 4, 6, 6)),
                                       (nn.AvgPool3d(2), (1, 4, 4, 6, 6)),
                                       (nn.Upsample(scale_factor=2, mode="bilinear"),
                                        (2, 3, 5, 5))])
def test_pool_autocast_bf16(mod, shape):
    # A conv under CPU autocast feeds bf16; torch's autocast casts some pools (max_pool3d,
    # avg_pool3d) to float32 and the Q-layers must give the same dtype and values.
    torch.manual_seed(0)
    conv = (nn.Conv2d if len(shape) == 4 else nn.Conv3d)(shape[1], shape[1], 1)
    x = _x(shape)
    res = []
    for m in (mod, _q(mod)):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(conv(leaf))
        y.float().pow(2).sum().backward()
        res.append((y, leaf.grad))
    assert_identical(res[1][0], res[0][0])
    assert_identical(res[1][1], res[0][1])


@pytest.mark.parametrize("mod,shape", [(nn.MaxPool2d(3, 2, 1), (1, 2, 5, 5)),
                                       (nn.MaxPool1d(3, 1), (2, 2, 7)),
                                       (nn.MaxPool3d(2, 1), (1, 1, 3, 3, 3)),
                                       (nn.AdaptiveMaxPool2d((2, 3)), (1, 2, 5, 5))])
def test_max_pool_gradcheck_and_create_graph(mod, shape):
    # float64, distinct values: the argmax is stable under gradcheck's perturbations.
    x = (torch.randperm(math.prod(shape), dtype=torch.float64) / 7).view(shape)
    x.requires_grad_(True)
    q = _q(mod)
    torch.autograd.gradcheck(lambda t: q(t), (x,), fast_mode=True)
    torch.autograd.gradgradcheck(lambda t: q(t), (x,), fast_mode=True)


@pytest.mark.parametrize("mod,shape,bits", [
    (nn.MaxPool2d(2), (4, 8, 16, 16), 2),
    (nn.MaxPool2d(3, 2, 1), (4, 8, 16, 16), 4),
    (nn.MaxPool1d(2), (4, 8, 32), 1),
    (nn.MaxPool3d(3, 2, 1), (2, 4, 6, 6, 6), 5),
    (nn.MaxPool2d(1), (2, 3, 4, 4), 0),
    (nn.AdaptiveMaxPool2d(4), (2, 8, 16, 16), 4),    # windows of exactly 4x4
    (nn.AdaptiveMaxPool2d(3), (2, 8, 7, 7), 4),      # 7 -> 3: windows up to 3 wide
])
def test_max_pool_saved_bytes(mod, shape, bits):
    x = _x(shape).requires_grad_(True)
    nbytes, y = saved_bytes(lambda: _q(mod)(x * 1))
    assert nbytes == math.ceil(bits * y.numel() / 8)
    ref, _ = saved_bytes(lambda: mod(x * 1))
    assert ref >= 4 * x.numel() + 8 * y.numel()  # torch: the input and int64 indices


@pytest.mark.parametrize("volume,bits", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (9, 4),
                                         (16, 4), (17, 5), (27, 5), (49, 6), (343, 9)])
def test_code_bits_and_packing_round_trip(volume, bits):
    assert code_bits(volume) == bits
    codes = torch.randint(0, volume, (1001,))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(bits * 1001 / 8)
    assert torch.equal(unpack_codes(packed, bits, 1001).long(), codes if bits else codes * 0)


@settings(max_examples=60, deadline=None)
@given(nd=st.integers(1, 3), data=st.data())
def test_max_pool_random_configs_exact(nd, data):
    """Any valid kernel / stride / padding / dilation / ceil_mode / size: torch's output,
    indices and gradient, bit for bit."""
    ints = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * nd)  # noqa: E731
    kernel = data.draw(ints(1, 4))
    stride = data.draw(ints(1, 3))
    dilation = data.draw(ints(1, 2))
    padding = tuple(data.draw(st.integers(0, k // 2)) for k in kernel)
    size = data.draw(ints(1, 7))
    ceil_mode = data.draw(st.booleans())
    mod = [nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d][nd - 1](
        kernel, stride, padding, dilation, return_indices=True, ceil_mode=ceil_mode)
    x = _x((2, 2) + size, ties=data.draw(st.booleans()), seed=data.draw(st.integers(0, 99)))
    try:
        y, _ = mod(x)
    except RuntimeError:  # torch rejects it (e.g. output size 0): nothing to compare
        assume(False)
    if torch.isinf(y).any():
        # a window with no input element: torch gives -inf and an out-of-range index (its
        # backward writes out of bounds), so the Q-layer refuses, naming the problem
        with pytest.raises(NotImplementedError, match="no input element"):
            _q(mod)(x.clone().requires_grad_(True))
        return
    _check_same(mod, x, "MaxPoolFunctionBackward")


@settings(max_examples=30, deadline=None)
@given(nd=st.integers(1, 3), data=st.data())
def test_adaptive_max_pool_random_sizes_exact(nd, data):
    size = data.draw(st.tuples(*[st.integers(1, 9)] * nd))
    out = data.draw(st.tuples(*[st.integers(1, 9)] * nd))
    mod = [nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d][nd - 1](
        out, return_indices=True)
    _check_same(mod, _x((2, 2) + size, ties=True, seed=data.draw(st.integers(0, 99))),
                "MaxPoolFunctionBackward")


@pytest.mark.parametrize("in_sizes,dilation,window,fast", [
    ((8, 8), (1, 1), (3, 3), True), ((2, 2), (1, 1), (3, 3), False),
    ((4, 4), (1, 2), (3, 3), False), ((5, 6, 7), (2, 1, 3), (2, 3, 2), True)])
def test_window_offsets_fast_path_only_when_unambiguous(in_sizes, dilation, window, fast):
    offs = _window_offsets(in_sizes, dilation, window)
    assert len(offs) == math.prod(window)
    assert (len(set(offs)) == len(offs)) == fast


ADAPTIVE_MAX_CASES = [
    (nn.AdaptiveMaxPool1d(4), (2, 3, 10)),
    (nn.AdaptiveMaxPool1d(7, return_indices=True), (3, 10)),
    (nn.AdaptiveMaxPool2d((3, 5)), (2, 3, 7, 11)),
    (nn.AdaptiveMaxPool2d((None, 2), return_indices=True), (2, 3, 5, 7)),
    (nn.AdaptiveMaxPool2d(4), (3, 9, 9)),
    (nn.AdaptiveMaxPool2d(6), (1, 2, 4, 5)),        # upsampling-like: windows overlap
    (nn.AdaptiveMaxPool3d((2, 3, 2)), (1, 2, 5, 7, 4)),
]


@pytest.mark.parametrize("case", range(len(ADAPTIVE_MAX_CASES)))
def test_adaptive_max_pool_identical_and_exact(case):
    mod, shape = ADAPTIVE_MAX_CASES[case]
    _check_same(mod, _x(shape, ties=case % 2 == 0), "MaxPoolFunctionBackward")


def test_adaptive_max_pool_channels_last():
    y = _check_same(nn.AdaptiveMaxPool2d(3), _x((2, 6, 8, 7), layout=torch.channels_last),
                    "MaxPoolFunctionBackward")
    assert y.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------------------------
# Average pools and upsampling: identical, exact, nothing saved
# ----------------------------------------------------------------------------------------------
LINEAR_CASES = [
    (nn.AvgPool1d(3), (2, 3, 10)),
    (nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 10)),
    (nn.AvgPool2d(2), (2, 3, 8, 8)),
    (nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 9, 10)),
    (nn.AvgPool2d((3, 2), 1, (1, 0), divisor_override=5), (3, 7, 6)),
    (nn.AvgPool3d(2, 1, 1, ceil_mode=True, divisor_override=3), (1, 2, 4, 5, 5)),
    (nn.AvgPool3d(3, 2, 1, count_include_pad=False), (1, 2, 5, 6, 7)),
    (nn.AdaptiveAvgPool1d(4), (2, 3, 10)),
    (nn.AdaptiveAvgPool2d((3, None)), (2, 3, 7, 5)),
    (nn.AdaptiveAvgPool2d(1), (4, 8, 5, 5)),
    (nn.AdaptiveAvgPool3d((2, 3, 1)), (1, 2, 5, 7, 3)),
    (nn.Upsample(scale_factor=2), (2, 3, 4, 5)),
    (nn.Upsample(size=(7, 9), mode="nearest-exact"), (2, 3, 4, 5)),
    (nn.Upsample(scale_factor=3, mode="linear", align_corners=True), (2, 3, 5)),
    (nn.Upsample(scale_factor=1.7, mode="bilinear"), (2, 3, 4, 5)),
    (nn.Upsample(scale_factor=1.7, mode="bilinear", recompute_scale_factor=True), (2, 3, 4, 5)),
    (nn.Upsample(size=(6, 7), mode="bicubic", align_corners=True), (2, 3, 4, 5)),
    (nn.Upsample(scale_factor=(2, 1, 1.5), mode="trilinear"), (1, 2, 3, 4, 4)),
    (nn.Upsample(size=3, mode="area"), (2, 3, 7, 8)),
]


@pytest.mark.parametrize("case", range(len(LINEAR_CASES)))
def test_linear_layers_identical_exact_and_save_nothing(case):
    mod, shape = LINEAR_CASES[case]
    _check_same(mod, _x(shape), "ShapeOnlyFunctionBackward")
    x = _x(shape).requires_grad_(True)
    nbytes, _ = saved_bytes(lambda: _q(mod)(x * 1))
    assert nbytes == 0


@settings(max_examples=40, deadline=None)
@given(nd=st.integers(1, 3), data=st.data())
def test_avg_pool_random_configs_exact(nd, data):
    ints = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * nd)  # noqa: E731
    kernel = data.draw(ints(1, 4))
    stride = data.draw(ints(1, 3))
    padding = tuple(data.draw(st.integers(0, k // 2)) for k in kernel)
    kwargs = dict(ceil_mode=data.draw(st.booleans()),
                  count_include_pad=data.draw(st.booleans()))
    if nd > 1:
        kwargs["divisor_override"] = data.draw(st.none() | st.integers(1, 5))
    mod = [nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d][nd - 1](kernel, stride, padding, **kwargs)
    x = _x((2, 2) + data.draw(ints(1, 7)), seed=data.draw(st.integers(0, 99)))
    try:
        mod(x)
    except RuntimeError:
        assume(False)
    _check_same(mod, x, "ShapeOnlyFunctionBackward")


def test_avg_pool_is_a_real_average():
    # ActNN's QAvgPool2d ran max-pool; ours must average.
    x = torch.arange(16.0).view(1, 1, 4, 4).requires_grad_(True)
    y = qnn.QAvgPool2d(2)(x * 1)
    assert torch.equal(y, torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 0.25))


def test_torch_avg_pool_keeps_input_but_ours_does_not():
    x = _x((4, 8, 16, 16)).requires_grad_(True)
    ref, _ = saved_bytes(lambda: nn.AdaptiveAvgPool2d(3)(x * 1))
    ours, _ = saved_bytes(lambda: qnn.QAdaptiveAvgPool2d(3)(x * 1))
    assert ref >= 4 * x.numel() and ours == 0


@pytest.mark.parametrize("mod,shape,layout", [
    (nn.AvgPool2d(3, 2, 1), (2, 8, 9, 9), torch.channels_last),
    (nn.AdaptiveAvgPool2d(2), (2, 8, 5, 5), torch.channels_last),
    (nn.Upsample(scale_factor=2, mode="bilinear"), (2, 8, 4, 4), torch.channels_last),
    (nn.AvgPool3d(2), (1, 4, 4, 4, 4), torch.channels_last_3d),
])
def test_linear_layers_channels_last(mod, shape, layout):
    x = _x(shape, layout=layout)
    y = _check_same(mod, x, "ShapeOnlyFunctionBackward")
    y_ref, g_ref, grad = run(mod, x)
    _, g, _ = run(_q(mod), x, grad)
    # the zero input of the backward keeps the layout, so strides follow torch's
    assert y.stride() == y_ref.stride() and g.stride() == g_ref.stride()


@pytest.mark.parametrize("mod,shape", [(nn.AvgPool2d(3, 2, 1), (1, 2, 5, 5)),
                                       (nn.AdaptiveAvgPool2d((2, 3)), (1, 2, 5, 7)),
                                       (nn.Upsample(scale_factor=2, mode="bicubic"),
                                        (1, 2, 3, 3))])
def test_linear_layers_gradcheck_and_double_backward(mod, shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    q = _q(mod)
    torch.autograd.gradcheck(lambda t: q(t), (x,), fast_mode=True)
    torch.autograd.gradgradcheck(lambda t: q(t), (x,), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# Module plumbing
# ----------------------------------------------------------------------------------------------
ALL_POOL = [nn.MaxPool1d(3, 2, 1, 1, True, True), nn.MaxPool2d(2), nn.MaxPool3d(3, 1),
            nn.AvgPool1d(2, 1, 1, True, False), nn.AvgPool2d(3, 1, 1, divisor_override=2),
            nn.AvgPool3d(2), nn.AdaptiveAvgPool1d(3), nn.AdaptiveAvgPool2d((2, 3)),
            nn.AdaptiveAvgPool3d(1), nn.AdaptiveMaxPool1d(2), nn.AdaptiveMaxPool2d(3, True),
            nn.AdaptiveMaxPool3d(2), nn.Upsample(scale_factor=2, mode="nearest")]


@pytest.mark.parametrize("mod", ALL_POOL, ids=lambda m: type(m).__name__)
def test_from_float_to_float_round_trip(mod):
    q = _q(mod)
    assert isinstance(q, type(mod)) and isinstance(q, QModule)
    for key in mod.__constants__:
        assert getattr(q, key) == getattr(mod, key)
    back = q.to_float()
    assert type(back) is type(mod) and back.__dict__.keys() == mod.__dict__.keys()
    assert all(getattr(back, k) == getattr(mod, k) for k in mod.__constants__)
    with pytest.raises(TypeError):
        type(q).from_float(nn.ReLU())


def test_constructors_take_torch_arguments():
    m = qnn.QMaxPool2d(3, 2, 1, 1, False, True)
    assert (m.kernel_size, m.stride, m.padding, m.ceil_mode) == (3, 2, 1, True)
    assert qnn.QAvgPool2d(2, divisor_override=3).divisor_override == 3
    assert qnn.QUpsample(scale_factor=2.0, mode="bilinear", align_corners=False).mode == \
        "bilinear"
    assert qnn.QAdaptiveMaxPool2d((2, None), return_indices=True).return_indices


def test_empty_window_raises_not_implemented():
    # kernel 2, dilation 2, padding 1 on a length-1 input: the only window covers positions
    # -1 and 1, both outside; torch returns -inf with index 1 (out of range).
    x = torch.randn(1, 1, 1, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no input element"):
        qnn.QMaxPool1d(2, 1, 1, 2)(x)


def test_errors_like_torch():
    x = torch.randn(1, 1, 3, 3, requires_grad=True)
    with pytest.raises(RuntimeError):
        qnn.QMaxPool2d(2, padding=2)(x)  # padding > kernel / 2
    with pytest.raises(ValueError):
        qnn.QUpsample(scale_factor=2, mode="nearest", align_corners=True)(x)


@pytest.mark.parametrize("make", [lambda: qnn.QMaxPool2d(2), lambda: qnn.QAvgPool2d(2),
                                  lambda: qnn.QUpsample(scale_factor=2)])
def test_plain_path_in_eval_and_no_grad(make):
    m = make()
    x = _x((2, 3, 4, 4)).requires_grad_(True)
    assert "Function" in type(m(x).grad_fn).__name__
    m.eval()
    assert "Function" not in type(m(x).grad_fn).__name__
    m.train()
    with torch.no_grad():
        assert m(x).grad_fn is None
    m.qconfig = m.qconfig.replace(enabled=False)
    assert "Function" not in type(m(x).grad_fn).__name__


@pytest.mark.parametrize("mod", [qnn.QMaxPool2d(3, 1), qnn.QAvgPool2d(2),
                                 qnn.QAdaptiveMaxPool2d(3), qnn.QUpsample(scale_factor=2)],
                         ids=lambda m: type(m).__name__)
def test_retain_graph_backward_twice_identical(mod):
    leaf = _x((2, 3, 6, 6)).requires_grad_(True)
    y = mod(leaf * 1)
    g = torch.randn_like(y)
    (g1,) = torch.autograd.grad(y, leaf, g, retain_graph=True)
    (g2,) = torch.autograd.grad(y, leaf, g)
    assert_identical(g1, g2)


def test_empty_batch():
    for mod in (qnn.QMaxPool2d(2), qnn.QAvgPool2d(2), qnn.QAdaptiveMaxPool2d(2)):
        leaf = torch.randn(0, 3, 4, 4, requires_grad=True)
        mod(leaf * 1).sum().backward()
        assert leaf.grad.shape == leaf.shape


def test_small_cnn_with_q_layers_matches_torch_exactly():
    """Conv -> in-place ReLU -> overlapping max-pool -> conv -> ReLU6 -> avg-pool -> dropout
    -> linear: every Q-layer here is lossless, so all parameter gradients equal torch's."""
    def make(q: bool) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU6(), nn.AdaptiveAvgPool2d(2),
                  nn.Flatten(), nn.Dropout(0.3), nn.Linear(32, 5)]
        if q:  # only the layers of this file family (conv / linear stay plain torch)
            mine = (nn.ReLU, nn.ReLU6, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.Dropout)
            layers = [_q(m) if type(m) in mine else m for m in layers]
        return nn.Sequential(*layers)

    x = _x((4, 3, 9, 9))
    grads, saved = [], []
    for q in (False, True):
        model = make(q)
        torch.manual_seed(5)  # same dropout noise
        nbytes, y = saved_bytes(lambda: model(x))
        y.square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
        saved.append(nbytes)
    for a, b in zip(*grads):
        assert_identical(a, b)
    assert saved[1] < saved[0]
