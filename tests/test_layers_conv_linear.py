"""QConv1d/2d/3d, QConvTranspose1d/2d/3d, QLinear against the torch layers they replace."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from _checks_a import (cos, grads_of, loss_grad, make_pair, params, qbytes, rel_err,
                       saved_bytes)
from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional import conv as fconv
from actnn_zoo.functional import linear as flinear
from actnn_zoo.nn import (QConv1d, QConv2d, QConv3d, QConvTranspose1d, QConvTranspose2d,
                          QConvTranspose3d, QLinear)



# tiny ops: one torch thread (tests/conftest.py, one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


# name: (torch layer factory, input shape, Q class, forward kwargs, shape that gets compressed;
# None: the input shape. padding_mode != 'zeros' compresses the unpadded input.)
CASES = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 20), QConv1d, {}, None),
    "conv1d_unbatched_circular_nobias": (
        lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="circular", bias=False), (3, 20),
        QConv1d, {}, (1, 3, 20)),
    "conv2d_groups_dilation_stride": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (2, 4, 10, 10),
        QConv2d, {}, None),
    "conv2d_same_even_kernel": (
        lambda: nn.Conv2d(4, 6, (4, 3), padding="same", dilation=(1, 2)), (2, 4, 9, 9), QConv2d,
        {}, None),
    "conv2d_valid": (lambda: nn.Conv2d(4, 6, 3, padding="valid"), (2, 4, 9, 9), QConv2d, {},
                     None),
    "conv2d_reflect": (lambda: nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode="reflect"),
                       (2, 4, 9, 9), QConv2d, {}, None),
    "conv2d_replicate_same": (
        lambda: nn.Conv2d(4, 6, 4, padding="same", padding_mode="replicate"), (2, 4, 9, 9),
        QConv2d, {}, None),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 2), padding=1), (2, 2, 5, 6, 6), QConv3d,
               {}, None),
    "conv3d_reflect": (lambda: nn.Conv3d(2, 3, 3, padding=(1, 2, 1), padding_mode="reflect"),
                       (2, 2, 4, 5, 5), QConv3d, {}, None),
    "convT1d_output_size": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1),
                            (2, 3, 20), QConvTranspose1d, {"output_size": [40]}, None),
    "convT2d_groups_dilation": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2,
                                   dilation=2), (2, 4, 6, 6), QConvTranspose2d, {}, None),
    "convT2d_unbatched_output_size": (lambda: nn.ConvTranspose2d(3, 2, 3, stride=2),
                                      (3, 4, 4), QConvTranspose2d, {"output_size": [10, 10]},
                                      (1, 3, 4, 4)),
    "convT3d": (lambda: nn.ConvTranspose3d(2, 3, 3, stride=2, bias=False), (2, 2, 3, 3, 3),
                QConvTranspose3d, {}, None),
    "linear": (lambda: nn.Linear(16, 8), (6, 16), QLinear, {}, None),
    "linear_3d_nobias": (lambda: nn.Linear(16, 8, bias=False), (2, 5, 16), QLinear, {}, None),
    "linear_1d": (lambda: nn.Linear(16, 8), (16,), QLinear, {}, None),
}
IDS = list(CASES)


def _setup(name: str, bits: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    factory, shape, qcls, kw, qshape = CASES[name]
    layer = factory()
    ref, q = make_pair(layer, qcls, LayerQConfig(bits=bits))
    x = torch.randn(shape)
    return ref, q, x, kw, qshape or shape


@pytest.mark.parametrize("name", IDS)
def test_forward_identical_and_8bit_grads(name):
    ref, q, x, kw, _ = _setup(name, bits=8)
    out_ref = ref(x, **kw)
    out_q = q(x.clone().requires_grad_(), **kw)
    assert torch.equal(out_ref, out_q)
    g = loss_grad(out_ref)
    gx_ref, gp_ref = grads_of(ref, x, g, **kw)
    gx_q, gp_q = grads_of(q, x, g, **kw)
    assert cos(gx_q, gx_ref) >= 0.9999
    for a, b in zip(gp_q, gp_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert cos(a, b) >= 0.9999


@pytest.mark.parametrize("name", ["conv1d_unbatched_circular_nobias", "conv2d_same_even_kernel",
                                  "conv2d_reflect", "conv3d", "convT1d_output_size",
                                  "convT2d_groups_dilation", "convT3d", "linear_3d_nobias"])
def test_2bit_weight_grad_unbiased_input_grad_exact(name):
    """Conv/linear backward is linear in the saved input: grad_W = f(grad_y, x_hat), so with
    E[x_hat] = x the K-pass mean converges to the exact grad_W. The K errors are independent and
    zero-mean, so ||mean - exact|| ~ rms(single error) / sqrt(K); we allow 3x that. A biased
    quantizer (e.g. round-to-nearest, checked below) keeps the single-pass error however large
    K is. grad_x and grad_b never read the saved input, so they are exact at 2 bits."""
    ref, q, x, kw, _ = _setup(name, bits=2, seed=1)
    g = torch.randn_like(ref(x, **kw))
    gx_ref, gp_ref = grads_of(ref, x, g, **kw)
    K = 200
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in gp_ref]
    sq_err = 0.0
    for _ in range(K):
        gx, gp = grads_of(q, x, g, **kw)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
        for s, a in zip(sums, gp):
            s += a
        sq_err += rel_err(gp[0], gp_ref[0]) ** 2
    single = math.sqrt(sq_err / K)
    assert single > 1e-3  # 2 bits really are noisy: the test below is not vacuous
    mean_err = rel_err(sums[0] / K, gp_ref[0])
    assert mean_err < 3 / math.sqrt(K) * single, (mean_err, single)
    for s, b in zip(sums[1:], gp_ref[1:]):  # bias
        torch.testing.assert_close((s / K).float(), b, rtol=1e-5, atol=1e-5)

    # Round-to-nearest is deterministic and biased: its mean error does not shrink.
    q.qconfig = LayerQConfig(bits=2, rounding="nearest")
    near = [grads_of(q, x, g, **kw)[1][0] for _ in range(2)]
    assert torch.equal(near[0], near[1]) and rel_err(near[0], gp_ref[0]) > 1e-3


@pytest.mark.parametrize("name", IDS)
def test_saved_bytes_are_the_compressed_input(name):
    ref, q, x, kw, qshape = _setup(name, bits=2)
    xg = x.clone().requires_grad_()
    out, nbytes = saved_bytes(lambda: q(xg, **kw), exclude=params(q))
    # the compressed input only: 2-bit codes + bf16 (lo, step) per group of 256
    assert nbytes == qbytes(qshape, 2)
    _, ref_bytes = saved_bytes(lambda: ref(x.clone().requires_grad_(), **kw),
                               exclude=params(ref))
    assert ref_bytes >= 4 * x.numel() and nbytes < ref_bytes / 4
    out.sum().backward()  # and it is usable


def test_mixed_per_sample_bits_saved_bytes():
    ref, q, x, kw, _ = _setup("conv2d_groups_dilation_stride")
    q.sample_bits = torch.tensor([2, 8])
    out, nbytes = saved_bytes(lambda: q(x.clone().requires_grad_()), exclude=params(q))
    d = x[0].numel()
    codes = math.ceil(d * 2 / 8) + math.ceil(d * 8 / 8)
    # + bf16 lo/step per group + per-row widths (uint8) and offsets (int64, N + 1)
    assert nbytes == codes + 2 * 2 * 2 * math.ceil(d / 256) + 2 + 8 * 3
    # the per-sample widths are what is used: all-8-bit widths give 8-bit accuracy
    q.sample_bits = torch.tensor([8, 8])
    g = loss_grad(out)
    assert cos(grads_of(q, x, g)[1][0], grads_of(ref, x, g)[1][0]) >= 0.9999


def test_frozen_weight_saves_nothing_and_grad_input_exact():
    torch.manual_seed(0)
    for layer, qcls, shape in [(nn.Conv2d(4, 6, 4, padding="same"), QConv2d, (2, 4, 7, 7)),
                               (nn.ConvTranspose2d(4, 6, 3, stride=2), QConvTranspose2d,
                                (2, 4, 5, 5)),
                               (nn.Linear(8, 5), QLinear, (3, 8))]:
        layer.weight.requires_grad_(False)
        ref, q = make_pair(layer, qcls)
        x = torch.randn(shape)
        out, nbytes = saved_bytes(lambda: q(x.clone().requires_grad_()), exclude=params(q))
        assert nbytes == 0
        g = torch.randn_like(out)
        gx_ref, (gb_ref,) = grads_of(ref, x, g)
        gx, (gb,) = grads_of(q, x, g)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, gb_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["conv1d_unbatched_circular_nobias", "conv2d_reflect",
                                  "convT1d_output_size", "linear"])
def test_eval_no_grad_and_disabled_are_plain_torch(name, monkeypatch):
    ref, q, x, kw, _ = _setup(name)

    def boom(*a, **k):
        raise AssertionError("compressed outside training")

    monkeypatch.setattr(fconv, "compress", boom)
    monkeypatch.setattr(flinear, "compress", boom)
    # eval (grad enabled): same output and the same saved tensors as the torch layer
    ref.eval(), q.eval()
    out_ref, b_ref = saved_bytes(lambda: ref(x.clone().requires_grad_(), **kw), params(ref))
    out_q, b_q = saved_bytes(lambda: q(x.clone().requires_grad_(), **kw), params(q))
    assert torch.equal(out_ref, out_q) and b_q == b_ref
    # no_grad in training mode: nothing saved at all
    ref.train(), q.train()
    with torch.no_grad():
        out_q, b_q = saved_bytes(lambda: q(x, **kw))
        assert torch.equal(out_q, ref(x, **kw)) and b_q == 0
    # qconfig.enabled=False in training: plain torch
    q.qconfig = LayerQConfig(enabled=False)
    out_ref, b_ref = saved_bytes(lambda: ref(x.clone().requires_grad_(), **kw), params(ref))
    out_q, b_q = saved_bytes(lambda: q(x.clone().requires_grad_(), **kw), params(q))
    assert torch.equal(out_ref, out_q) and b_q == b_ref


@pytest.mark.parametrize("name", ["conv1d", "conv2d_valid", "conv3d", "convT1d_output_size",
                                  "convT2d_groups_dilation", "convT3d", "linear"])
def test_from_float_shares_parameters_and_round_trips(name):
    factory, _, qcls, _, _ = CASES[name]
    layer = factory()
    hook_calls = []
    layer.register_forward_hook(lambda m, i, o: hook_calls.append(1))
    q = qcls.from_float(layer)
    assert isinstance(q, qcls._FLOAT_MODULE) and isinstance(q, qcls)
    assert q.weight is layer.weight and q.bias is layer.bias
    assert list(q.state_dict()) == list(layer.state_dict())
    q(torch.randn(CASES[name][1]), **CASES[name][3])
    assert hook_calls == [1]
    back = q.to_float()
    assert type(back) is qcls._FLOAT_MODULE and back.weight is layer.weight
    assert list(back.state_dict()) == list(layer.state_dict())
    with pytest.raises(TypeError):
        qcls.from_float(nn.Identity())


def test_constructor_signature_matches_torch():
    torch.manual_seed(0)
    a = nn.Conv2d(4, 6, 3, 2, 1, 1, 2, False, "reflect")
    torch.manual_seed(0)
    b = QConv2d(4, 6, 3, 2, 1, 1, 2, False, "reflect", qconfig=LayerQConfig(bits=4))
    assert b.qconfig.bits == 4 and b.padding_mode == "reflect" and b.bias is None
    assert torch.equal(a.weight, b.weight)
    torch.manual_seed(0)
    a = nn.ConvTranspose3d(2, 4, 3, 2, 1, 1, 2, True, 1)
    torch.manual_seed(0)
    b = QConvTranspose3d(2, 4, 3, 2, 1, 1, 2, True, 1)
    assert torch.equal(a.weight, b.weight) and b.output_padding == (1, 1, 1)
    assert QLinear(3, 2, False, dtype=torch.float16).weight.dtype == torch.float16
    with pytest.raises(ValueError, match="zeros"):
        QConvTranspose2d(2, 2, 3, padding_mode="reflect")
    assert "bits=2" in repr(QConv1d(1, 1, 1))


@pytest.mark.parametrize("qcls,layer,shape", [
    (QConv2d, lambda: nn.Conv2d(2, 3, 3), (1, 2, 5, 5)),
    (QConvTranspose1d, lambda: nn.ConvTranspose1d(2, 3, 3), (1, 2, 5)),
    (QLinear, lambda: nn.Linear(4, 3), (2, 4)),
])
def test_float64_inputs_are_compressed_as_float32(qcls, layer, shape):
    # float64 is quantized through a float32 copy (tests/test_reliability.py compares the
    # gradients with torch's float64 ones); gradients come back float64
    q = qcls.from_float(layer().double())
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    q(x).sum().backward()
    assert x.grad.dtype == q.weight.grad.dtype == torch.float64
    q.qconfig = LayerQConfig(enabled=False)  # the way out of compression
    q(torch.randn(shape, dtype=torch.float64, requires_grad=True))


def test_nested_input_raises():
    q = QLinear(4, 3)
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    with pytest.raises(NotImplementedError, match="^QLinear: nested"):  # named by its class
        q(nt)


@pytest.mark.parametrize("name", ["conv2d_same_even_kernel", "convT3d", "linear_3d_nobias"])
def test_backward_twice_with_retain_graph(name):
    ref, q, x, kw, _ = _setup(name)
    xg = x.clone().requires_grad_()
    out = q(xg, **kw)
    loss = (out * torch.randn_like(out)).sum()
    first = torch.autograd.grad(loss, [xg] + params(q), retain_graph=True)
    second = torch.autograd.grad(loss, [xg] + params(q))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qcls,layer,shape", [
    (QConv2d, lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 8, 8)),
    (QLinear, lambda: nn.Linear(32, 16), (2, 5, 32)),
])
def test_autocast_bfloat16_cpu(qcls, layer, shape):
    torch.manual_seed(0)
    ref, q = make_pair(layer(), qcls, LayerQConfig(bits=8))
    x = torch.randn(shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x)
        out_q = q(x)
    assert out_q.dtype == torch.bfloat16 and torch.equal(out_ref, out_q)
    g = loss_grad(out_ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gx_ref, gp_ref = grads_of(ref, x, g)
        gx_q, gp_q = grads_of(q, x, g)
    assert gx_q.dtype == torch.float32
    assert cos(gx_q, gx_ref) >= 0.9999
    for a, b in zip(gp_q, gp_ref):
        assert a.dtype == torch.float32 == b.dtype and cos(a, b) >= 0.9999


def test_backward_helpers_skip_work_that_changes_nothing(monkeypatch):
    """``cast`` hands back the tensor itself for its own dtype (no ``to`` call) and
    ``no_autocast`` switches autocast off only where it is on (else a no-op context): what the
    backward glue of every Q-layer calls several times per step."""
    t = torch.ones(3)
    calls = []
    real_to, real_autocast = torch.Tensor.to, torch.autocast
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append("to")
                        or real_to(self, *a, **k))
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: calls.append("autocast")
                        or real_autocast(*a, **k))
    flinear.cast(t, torch.float32)
    with flinear.no_autocast("cpu"):
        pass
    assert calls == []  # neither call is made where it would change nothing
    flinear.cast(t, torch.float64)
    with real_autocast("cpu", dtype=torch.bfloat16):
        with flinear.no_autocast("cpu"):
            pass
    assert calls == ["to", "autocast"]
    monkeypatch.undo()
    assert flinear.cast(t, torch.float32) is t and flinear.cast(None, torch.float32) is None
    assert flinear.cast(t, None) is t
    d = flinear.cast(t, torch.float64)
    assert d.dtype == torch.float64 and torch.equal(d, t.double())
    with flinear.no_autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with flinear.no_autocast("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert torch.mm(t.view(1, 3), t.view(3, 1)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


def test_autocast_on_answers_as_the_device_query_does():
    """``autocast_on(x)``, the layers' per-call check (``x.is_cpu`` and a literal device type,
    no ``x.device`` object), answers what ``torch.is_autocast_enabled(x.device.type)`` does,
    inside and outside autocast, and False for the meta device (which autocast does not know,
    where torch's query raises)."""
    from actnn_zoo.functional._autocast import autocast_enabled, autocast_on

    t = torch.ones(3)
    assert autocast_on(t) is False is torch.is_autocast_enabled(t.device.type)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_on(t) is True is torch.is_autocast_enabled(t.device.type)
        with torch.autocast("cpu", enabled=False):
            assert autocast_on(t) is False
    meta = torch.ones(3, device="meta")
    assert autocast_on(meta) is False and autocast_enabled(meta) is False
    with pytest.raises(RuntimeError):
        torch.is_autocast_enabled("meta")


@pytest.mark.parametrize("qcls,layer,shape,fmt", [
    (QConv2d, lambda: nn.Conv2d(4, 6, 3, padding=1, stride=2), (2, 4, 9, 9),
     torch.channels_last),
    (QConv3d, lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 5, 5), torch.channels_last_3d),
])
def test_channels_last(qcls, layer, shape, fmt):
    torch.manual_seed(0)
    ref, q = make_pair(layer(), qcls, LayerQConfig(bits=8))
    ref.to(memory_format=fmt), q.to(memory_format=fmt)
    x = torch.randn(shape).to(memory_format=fmt)
    assert torch.equal(ref(x), q(x))
    g = loss_grad(ref(x))
    gx_ref, gp_ref = grads_of(ref, x, g)
    gx_q, gp_q = grads_of(q, x, g)
    assert gx_q.is_contiguous(memory_format=fmt) == gx_ref.is_contiguous(memory_format=fmt)
    assert cos(gx_q, gx_ref) >= 0.9999
    assert all(cos(a, b) >= 0.9999 for a, b in zip(gp_q, gp_ref))


def test_deepcopy_and_state_dict_load():
    q = QConv2d(2, 3, 3, qconfig=LayerQConfig(bits=4))
    c = copy.deepcopy(q)
    assert c.qconfig == q.qconfig and c.weight is not q.weight
    plain = nn.Conv2d(2, 3, 3)
    q.load_state_dict(plain.state_dict())
    assert torch.equal(q.weight, plain.weight)


@pytest.mark.parametrize("name", ["conv1d", "conv2d_reflect", "convT2d_groups_dilation",
                                  "linear_3d_nobias"])
def test_input_without_grad_still_gives_parameter_grads(name):
    """A first layer: only the parameters need gradients."""
    ref, q, x, kw, _ = _setup(name, bits=8)
    g = loss_grad(ref(x, **kw))
    (ref(x, **kw) * g).sum().backward()
    (q(x, **kw) * g).sum().backward()
    for a, b in zip(ref.parameters(), q.parameters()):
        assert b.grad is not None and cos(b.grad, a.grad) >= 0.9999


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("padding", ["same", "valid", 1, (2, 1, 0)])
def test_pad_widths_match_torchs_for_non_zero_padding_modes(dims, padding):
    """QConv's F.pad widths come from public attributes; torch's own (private) value is the
    oracle here only."""
    from actnn_zoo.nn.conv import pad_widths

    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    pad = padding[:dims] if isinstance(padding, tuple) else padding
    conv = cls(2, 2, (4, 3, 2)[:dims], padding=pad, dilation=(1, 2, 3)[:dims],
               padding_mode="reflect")
    assert pad_widths(conv.padding, conv.kernel_size, conv.dilation) == tuple(
        conv._reversed_padding_repeated_twice)


@pytest.mark.parametrize("chunks", [1, 3])
def test_weight_stored_in_out_gets_its_gradient_in_that_layout(monkeypatch, chunks):
    """GPT-2's Conv1D stores its weight (in, out) and the Q-layer hands the Function its
    transpose. The weight gradient comes back laid out as the Parameter is (contiguous at the
    Parameter's hook), so AccumulateGrad keeps it without a weight-sized copy per step; its
    value is torch's at 8 bits, also decoded in chunks of samples."""
    from actnn_zoo.functional import _saving

    monkeypatch.setattr(_saving, "CHUNK_MIN_BYTES", 0)  # chunk even this small input
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 24))  # (in, out)
    b = nn.Parameter(torch.randn(24))
    x = torch.randn(6, 5, 16)
    seen = []
    w.register_hook(lambda g: seen.append(g))
    out = flinear.LinearFunction.apply(x, w.t(), b, LayerQConfig(bits=8, backward_chunks=chunks),
                                       8)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = x.reshape(-1, 16).t() @ grad.reshape(-1, 24)
    assert seen[0].is_contiguous() and seen[0].shape == (16, 24)
    assert cos(w.grad, want) >= 0.9999
    assert torch.allclose(b.grad, grad.reshape(-1, 24).sum(0))
