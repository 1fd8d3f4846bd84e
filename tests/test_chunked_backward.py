"""Backward that decodes a saved input a chunk of samples at a time (``backward_chunks``).

The chunked path must give the gradients of the whole-tensor path (same compressed payload, so
the only difference is the order of a sum over samples: float rounding, checked at rtol 1e-5),
decode no more than one chunk at a time, and leave retain_graph, channels_last, odd batch sizes,
padding modes, float64 and per-sample widths working.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import actnn_zoo as az
from actnn_zoo.config import LayerQConfig, QuantConfig
from actnn_zoo.functional import _saving
from actnn_zoo.quant import (SampleBits, dequantize, dequantize_rows, dequantize_sparse, quantize,
                             quantize_sparse)
from actnn_zoo.quant.sparse import dequantize_sparse_rows, rows_decodable


# ------------------------------------------------------------------------- dequantize_rows ----
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), c=st.integers(1, 5), hw=st.integers(1, 7),
       bits=st.sampled_from([1, 2, 4, 8, "mixed"]), data=st.data())
def test_dequantize_rows_equals_a_slice_of_dequantize(n, c, hw, bits, data):
    x = torch.randn(n, c, hw, hw) * torch.rand(n, 1, 1, 1) * 10
    if bits == "mixed":
        widths = torch.tensor(data.draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=n,
                                                  max_size=n)), dtype=torch.uint8)
        q = quantize(x, SampleBits(widths, int(widths.sum())), group_size=32, seed=3)
    else:
        q = quantize(x, bits, group_size=32, seed=3)
    full = dequantize(q)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert torch.equal(dequantize_rows(q, start, stop), full[start:stop])


def test_dequantize_rows_writes_into_out_and_rejects_bad_arguments():
    x = torch.randn(6, 3, 4)
    q = quantize(x, 2, group_size=32, seed=0)
    buf = torch.empty(2, 3, 4)
    assert dequantize_rows(q, 1, 3, out=buf) is buf
    assert torch.equal(buf, dequantize(q)[1:3])
    with pytest.raises(ValueError, match="rows 4:2"):
        dequantize_rows(q, 4, 2)
    with pytest.raises(ValueError, match="rows 0:7"):
        dequantize_rows(q, 0, 7)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_rows(q, 0, 2, out=torch.empty(3, 3, 4))
    with pytest.raises(ValueError, match="sample dimension"):
        dequantize_rows(quantize(torch.randn(40), 2, group_size=32), 0, 1)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize_rows(x, 0, 1)


def test_sample_chunks_splits_evenly_and_only_when_worth_it(monkeypatch):
    q = quantize(torch.randn(10, 64, 32, 32), 2)  # 2.5 MiB decoded
    with torch.no_grad():  # as in a backward without create_graph
        assert _saving.sample_chunks(q, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
        assert _saving.sample_chunks(q, 1) == []
        assert _saving.sample_chunks(q, 16) == [(i, i + 1) for i in range(10)]
        assert _saving.sample_chunks(quantize(torch.randn(10, 8), 2), 4) == []  # under 1 MiB
        assert _saving.sample_chunks(None, 4) == []
    with torch.enable_grad():  # backward with create_graph=True: decode whole
        assert _saving.sample_chunks(q, 4) == []


# --------------------------------------------------------------- layers: chunked == whole ----
def _close_up_to_summation_order(b: torch.Tensor, a: torch.Tensor, eps: float = 1e-5) -> None:
    """Equal but for float rounding of a sum over samples split differently: every element
    within ``eps`` times the tensor's largest magnitude (float32 sums of tens of terms)."""
    torch.testing.assert_close(b, a, rtol=0, atol=eps * float(a.abs().max()) + 1e-12)


def _grads(layer: nn.Module, x: torch.Tensor, chunks: int, seed: int = 0, retain: bool = False):
    torch.manual_seed(seed)
    q = az.convert_model(copy.deepcopy(layer), QuantConfig(
        bits=8, strategy="uniform", capture=False, backward_chunks=chunks))
    xi = x.clone().requires_grad_(True)
    out = q(xi)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g, retain_graph=retain)
    first = [xi.grad.clone()] + [p.grad.clone() for p in q.parameters()]
    if retain:
        xi.grad = None
        for p in q.parameters():
            p.grad = None
        out.backward(g)
        again = [xi.grad] + [p.grad for p in q.parameters()]
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    return first


CASES = {
    "conv2d": (lambda: nn.Conv2d(3, 8, 3, padding=1), (7, 3, 9, 9)),
    "conv2d_reflect_stride": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=2,
                                                padding_mode="reflect"), (5, 3, 11, 10)),
    "conv2d_same_even": (lambda: nn.Conv2d(2, 4, 4, padding="same", bias=False), (6, 2, 8, 8)),
    "conv1d_groups": (lambda: nn.Conv1d(4, 8, 3, groups=2), (9, 4, 20)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 5, 3, stride=2, output_padding=1),
                         (5, 3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (4, 2, 5, 5, 5)),
    "linear_3d": (lambda: nn.Linear(16, 12), (6, 5, 16)),
    "linear_2d": (lambda: nn.Linear(16, 12), (11, 16)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(6), (7, 6, 5, 5)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(6), (9, 6, 10)),
    "batchnorm2d_no_affine": (lambda: nn.BatchNorm2d(6, affine=False), (5, 6, 4, 4)),
    "gelu": (lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU()), (7, 5, 8)),
    "silu_4d": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.SiLU()), (6, 3, 5, 5)),
    "tanh": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), (9, 8)),
}


@pytest.fixture
def chunk_everything(monkeypatch):
    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 0)


@pytest.mark.parametrize("name,channels_last",
                         [(n, False) for n in sorted(CASES)]
                         + [(n, True) for n in sorted(CASES) if len(CASES[n][1]) == 4])
def test_chunked_backward_equals_whole_backward(name, channels_last, monkeypatch):
    """Against the whole input in one backward call (a conv's small-input path, which shares
    no code with the chunked one)."""
    build, shape = CASES[name]
    torch.manual_seed(0)
    layer = build()
    x = torch.randn(shape) * torch.linspace(0.1, 3, shape[1]).view([1, -1] + [1] * (len(shape) - 2))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 1 << 40)
    whole = _grads(layer, x, chunks=1)
    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 0)  # chunk everything
    chunked = _grads(layer, x, chunks=3, retain=True)
    for a, b in zip(whole, chunked):
        _close_up_to_summation_order(b, a)


@pytest.mark.parametrize("name", ["conv2d", "linear_2d", "batchnorm2d", "gelu"])
def test_chunked_backward_in_float64(name, chunk_everything):
    build, shape = CASES[name]
    torch.manual_seed(0)
    layer = build().double()
    x = torch.randn(shape, dtype=torch.float64)
    whole = _grads(layer, x, chunks=1)
    chunked = _grads(layer, x, chunks=4)
    for a, b in zip(whole, chunked):
        assert b.dtype == torch.float64
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)


def test_chunked_batchnorm_matches_fp32_autograd_at_8_bits(chunk_everything):
    """The chunked formula is torch's batch-norm backward written in x_hat: against exact fp32
    autograd at 8 bits the gradients agree as closely as the whole path's do."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(6, 8, 7, 7) * torch.logspace(-2, 2, 8).view(1, -1, 1, 1)
    xr = x.clone().requires_grad_(True)
    ref = nn.BatchNorm2d(8)
    ref.load_state_dict(bn.state_dict())
    out = ref(xr)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    exact = [xr.grad] + [p.grad for p in ref.parameters()]
    chunked = _grads(bn, x, chunks=4)
    for a, b in zip(exact, chunked):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos >= 0.9999, float(cos)


def test_chunked_backward_with_per_sample_widths(chunk_everything):
    """Under the default strategy (per-sample widths) the chunked path reads each sample at its
    own width: two training steps, then chunked and whole gradients of the same payload agree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 36, 4))
    x = torch.randn(8, 3, 6, 6) * torch.rand(8, 1, 1, 1) * 4
    grads = {}
    for chunks in (1, 4):
        torch.manual_seed(0)
        q = az.convert_model(copy.deepcopy(model),
                             QuantConfig(bits=2, capture=False, backward_chunks=chunks))
        for _ in range(3):  # widths are re-allocated from step 2 on
            q.zero_grad()
            torch.manual_seed(5)
            q(x).square().mean().backward()
        grads[chunks] = [p.grad.clone() for p in q.parameters()]
    for a, b in zip(grads[1], grads[4]):
        _close_up_to_summation_order(b, a)


@pytest.mark.parametrize("name", ["conv2d", "linear_3d", "batchnorm2d", "gelu", "silu_4d"])
def test_chunked_backward_decodes_one_chunk_at_a_time(name, chunk_everything, monkeypatch):
    """What lowers the peak: no decode of the whole saved input when chunks > 1."""
    calls = []
    real_rows, real_whole = _saving.dequantize_rows, _saving.decompress

    def rows(q, start, stop, *a, **k):
        calls.append(("rows", stop - start, q.shape[0]))
        return real_rows(q, start, stop, *a, **k)

    def whole(q, *a, **k):
        calls.append(("whole", q.shape[0], q.shape[0]))
        return real_whole(q, *a, **k)

    import actnn_zoo.functional.activation as act_f
    import actnn_zoo.functional.conv as conv_f
    import actnn_zoo.functional.linear as linear_f
    import actnn_zoo.functional.norm as norm_f
    for mod in (act_f, conv_f, linear_f, norm_f):
        monkeypatch.setattr(mod, "dequantize_rows", rows)
    monkeypatch.setattr(_saving, "decompress", whole)  # what restore() decodes whole with
    build, shape = CASES[name]
    _grads(build(), torch.randn(shape), chunks=4)
    assert all(kind == "rows" for kind, _, _ in calls), calls
    if name == "batchnorm2d" and reads_codes_here():
        assert calls == []  # batch norm reads its codes without decoding (test_bn_backward_codes)
        return
    assert calls
    assert max(size for _, size, _ in calls) <= -(-shape[0] // 4)


def reads_codes_here() -> bool:
    from actnn_zoo.quant.backend import kernels
    return getattr(kernels(torch.device("cpu")), "batch_norm_backward_codes", None) is not None


# ------------------------------------------------- sparse codes (a ReLU output) by samples ----
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), c=st.integers(1, 4), hw=st.sampled_from([4, 8]),
       bits=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_sparse_rows_equal_a_slice_of_dequantize_sparse(n, c, hw, bits, data):
    x = torch.relu(torch.randn(n, c, hw, hw) * torch.rand(n, 1, 1, 1) * 10)
    q = quantize_sparse(x, bits, group_size=32, seed=4)
    full = dequantize_sparse(q)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert torch.equal(_saving.dequantize_rows(q, start, stop), full[start:stop])
    out = torch.empty((stop - start, c, hw, hw))
    assert dequantize_sparse_rows(q, start, stop, out=out) is out


def test_sparse_rows_need_whole_mask_bytes():
    q = quantize_sparse(torch.relu(torch.randn(6, 3, 3)), 2, group_size=32)  # 9 per sample
    assert not rows_decodable(q)
    with torch.no_grad():
        assert _saving.sample_chunks(q, 4) == []
    with pytest.raises(ValueError, match="multiple of 8"):
        dequantize_sparse_rows(q, 0, 2)
    q = quantize_sparse(torch.relu(torch.randn(6, 2, 4)), 2, group_size=32)
    with pytest.raises(ValueError, match="rows 5:7"):
        dequantize_sparse_rows(q, 5, 7)
    with pytest.raises(TypeError, match="SparseQuantizedTensor"):
        dequantize_sparse_rows(quantize(torch.randn(6, 8), 2), 0, 1)


def test_conv_after_relu_decodes_its_sparse_input_by_chunks(chunk_everything, monkeypatch):
    """Under capture a ReLU output is saved as sparse codes; the conv reading it chunks them
    too, with the gradients of the whole decode."""
    def grads(chunks):
        torch.manual_seed(0)
        model = az.convert_model(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                               nn.Conv2d(4, 4, 3, padding=1)),
                                 QuantConfig(bits=8, strategy="uniform", backward_chunks=chunks))
        x = torch.randn(6, 3, 8, 8, requires_grad=True)
        model(x).square().mean().backward()  # the ReLU learns its consumer saves its output
        x.grad = None
        model.zero_grad()
        model(x).square().mean().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    seen = []
    real = _saving.dequantize_sparse_rows
    monkeypatch.setattr(_saving, "dequantize_sparse_rows",
                        lambda q, a, b: seen.append(b - a) or real(q, a, b))
    whole, chunked = grads(1), grads(3)
    assert seen and max(seen) <= 2
    for a, b in zip(whole, chunked):
        _close_up_to_summation_order(b, a)


def test_backward_chunks_config_key():
    assert QuantConfig().backward_chunks == 1  # opt-in: chunks cost CPU step time
    assert "backward_chunks" not in QuantConfig().to_dict()  # written only when not the default
    cfg = QuantConfig.from_dict({"backward_chunks": 4})
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.resolve("conv", nn.Conv2d(1, 1, 1)).backward_chunks == 4
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match="backward_chunks"):
            QuantConfig.from_dict({"backward_chunks": bad})
        with pytest.raises(ValueError, match="backward_chunks"):
            LayerQConfig(backward_chunks=bad)


@pytest.mark.parametrize("need", ["both", "weight", "input"])
def test_weight_gradient_first_equals_one_call(need, monkeypatch):
    """A large saved input (large_input) is decoded for the weight gradient and freed before a
    second call gives the input gradient; a small one takes one call. Same gradients."""
    def grads(threshold):
        monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", threshold)
        torch.manual_seed(0)
        conv = az.convert_model(nn.Conv2d(3, 5, 3, padding=1, bias=True),
                                QuantConfig(bits=8, strategy="uniform", capture=False))
        conv.weight.requires_grad_(need != "input")
        x = torch.randn(4, 3, 9, 9, requires_grad=need != "weight")
        conv(x).square().sum().backward()
        return [t.grad for t in (x, conv.weight, conv.bias) if t.grad is not None]

    assert _saving.large_input(quantize(torch.randn(4, 3, 9, 9), 2)) is False
    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 0)
    assert _saving.large_input(quantize(torch.randn(4, 3, 9, 9), 2)) is True
    split, one = grads(0), grads(1 << 40)
    assert len(split) == len(one) == (3 if need == "both" else 2)
    for a, b in zip(split, one):
        _close_up_to_summation_order(a, b)


_CONV_CLASSES = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (3, False): nn.Conv3d,
                 (1, True): nn.ConvTranspose1d, (2, True): nn.ConvTranspose2d,
                 (3, True): nn.ConvTranspose3d}


@settings(max_examples=60, deadline=None)
@given(dims=st.integers(1, 3), transposed=st.booleans(), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), kernel=st.integers(1, 4), groups=st.sampled_from([1, 2]),
       size=st.integers(5, 9), data=st.data())
def test_input_gradient_of_the_split_backward_is_exact(dims, transposed, stride, dilation,
                                                       kernel, groups, size, data):
    """With the weight gradient first (large_input), the input gradient comes from the adjoint
    op (``ConvSpec.input_grad``: transposed conv for a conv, conv for a transposed one) or, where
    sizes do not fit, aten's backward with a stand-in input. It does not read the saved input,
    so it must equal fp32 autograd's up to summation order, for every stride / padding /
    dilation / groups / output padding / padding mode."""
    kw = dict(stride=stride, dilation=dilation, groups=groups, bias=data.draw(st.booleans()))
    if transposed:
        kw["padding"] = data.draw(st.integers(0, dilation * (kernel - 1) // 2))
        kw["output_padding"] = data.draw(st.integers(0, max(stride, dilation) - 1))
    else:
        kw["padding"] = data.draw(st.sampled_from(
            [0, 1, "valid"] + (["same"] if stride == 1 else [])))
        if kw["padding"] not in ("same", "valid") and data.draw(st.booleans()):
            kw["padding_mode"] = data.draw(st.sampled_from(["reflect", "replicate", "circular"]))
            kw["padding"] = 1
    if not transposed and size + 2 * (kw["padding"] if isinstance(kw["padding"], int) else 0) \
            < dilation * (kernel - 1) + 1:
        return  # the conv would have no output
    torch.manual_seed(0)
    layer = _CONV_CLASSES[dims, transposed](2 * groups, 3 * groups, kernel, **kw)
    x = torch.randn((2, 2 * groups) + (size,) * dims, requires_grad=True)
    out = layer(x)
    g = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, x, g)

    _saving.CHUNK_MIN_BYTES, saved = 0, _saving.CHUNK_MIN_BYTES
    try:
        q = az.convert_model(copy.deepcopy(layer), QuantConfig(bits=2, strategy="uniform",
                                                               capture=False))
        xq = x.detach().clone().requires_grad_()
        (got,) = torch.autograd.grad(q(xq), xq, g)
    finally:
        _saving.CHUNK_MIN_BYTES = saved
    assert got.shape == want.shape
    _close_up_to_summation_order(got, want)


def test_input_gradient_falls_back_where_sizes_do_not_fit():
    """A transposed conv with output padding of its stride or more (allowed when below the
    dilation) has no plain conv of the right size as its adjoint: None, and the aten path."""
    from actnn_zoo.functional.conv import ConvSpec

    spec = ConvSpec(dims=1, stride=(1,), padding=(0,), dilation=(3,), groups=1, transposed=True,
                    output_padding=(2,))
    w = torch.randn(2, 3, 2)
    x = torch.randn(1, 2, 5)
    out = torch.nn.functional.conv_transpose1d(x, w, None, 1, 0, 2, 1, 3)
    assert spec.input_grad(torch.randn_like(out), w, [0], x.shape) is None
    layer = nn.ConvTranspose1d(2, 3, 2, dilation=3, output_padding=2)
    x.requires_grad_()
    g = torch.randn_like(layer(x))
    (want,) = torch.autograd.grad(layer(x), x, g)
    _saving.CHUNK_MIN_BYTES, saved = 0, _saving.CHUNK_MIN_BYTES
    try:
        q = az.convert_model(copy.deepcopy(layer), QuantConfig(bits=2, capture=False))
        xq = x.detach().clone().requires_grad_()
        (got,) = torch.autograd.grad(q(xq), xq, g)
    finally:
        _saving.CHUNK_MIN_BYTES = saved
    _close_up_to_summation_order(got, want)
