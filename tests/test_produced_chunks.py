"""compress_produced: a tensor made only to be compressed (an activation's derivative) is made
and quantized a chunk of samples at a time, with the codes of the whole tensor.

With round-to-nearest the codes do not depend on the seed, so the chunked payload must
dequantize to exactly what quantizing the whole tensor gives (groups never cross rows, rows
are samples): uniform widths, per-sample widths, channels_last. And the smooth activations
that use it keep their gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional import _saving
from actnn_zoo.functional.activation import gelu, silu
from actnn_zoo.quant import SampleBits, dequantize, quantize


@pytest.mark.parametrize("bits", [2, "per-sample"])
def test_chunked_equals_whole_with_nearest_rounding(bits, monkeypatch):
    monkeypatch.setattr(_saving, "PRODUCE_CHUNK_BYTES", 1 << 14)  # force several chunks
    g = torch.Generator().manual_seed(0)
    t = torch.randn(12, 5, 77, generator=g)
    qc = LayerQConfig(bits=2, rounding="nearest")
    b = SampleBits(torch.tensor([1, 2, 4, 8] * 3, dtype=torch.uint8), 45) \
        if bits == "per-sample" else 2
    calls = []

    def produce(start, stop):
        calls.append((start, stop))
        return t[start:stop]

    q = _saving.compress_produced(produce, t.shape, qc, b)
    assert q is not None and len(calls) >= 2 and calls[0][0] == 0 and calls[-1][1] == 12
    whole = quantize(t, b, 256, rounding="nearest")
    assert torch.equal(dequantize(q), dequantize(whole))
    assert q.nbytes <= whole.nbytes + 8 * len(calls)


def test_not_chunked_when_small_or_other_compressor():
    t = torch.randn(4, 100)
    assert _saving.compress_produced(lambda a, b: t[a:b], t.shape, LayerQConfig()) is None
    big = torch.Size([64, 8192])  # 2 MiB of float32
    assert _saving.compress_produced(lambda a, b: None, big,
                                     LayerQConfig(compressor="division")) is None


@pytest.mark.parametrize("fn,ref", [(gelu, F.gelu), (silu, F.silu)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_activation_gradients_with_chunked_derivative(fn, ref, channels_last, monkeypatch):
    """8-bit derivative made in chunks: input gradient cosine with fp32 >= 0.9999."""
    monkeypatch.setattr(_saving, "PRODUCE_CHUNK_BYTES", 1 << 15)
    torch.manual_seed(0)
    x = torch.randn(16, 8, 12, 12)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(16, 8, 12, 12)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(x1) * grad).sum().backward()
    (fn(x2, qconfig=LayerQConfig(bits=8)) * grad).sum().backward()
    assert F.cosine_similarity(x1.grad.flatten(), x2.grad.flatten(), dim=0) >= 0.9999


def _norm_grads(layer, x, grad):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    (layer(x) * grad).sum().backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("make,shape", [
    (lambda: torch.nn.BatchNorm2d(8), (16, 8, 12, 12)),
    (lambda: torch.nn.LayerNorm(96), (16, 20, 96)),
    (lambda: torch.nn.GroupNorm(4, 8), (16, 8, 12, 12)),
])
def test_norms_normalized_copy_in_chunks(make, shape, monkeypatch):
    """The norms' normalized copy x_hat made and quantized in chunks: with round-to-nearest the
    gradients equal those of the whole-map path bit for bit, and at 8 bits they match fp32.
    (On the CPU the norms normalize inside the quantizer instead, tests/
    test_quantize_normalized.py; the chunks are what they do elsewhere, so that is off here.)"""
    import copy

    import actnn_zoo as az
    import actnn_zoo.functional._saving as saving

    monkeypatch.setattr(saving, "normalizes_in_kernel", lambda *args: False)
    import actnn_zoo.functional.norm as fnorm  # and the norms' fused CPU calls (the same)
    for name in ("_BN_FORWARD", "_LN_FORWARD", "_GN_FORWARD"):
        monkeypatch.setattr(fnorm, name, None)

    torch.manual_seed(0)
    ref = make()
    x, grad = torch.randn(shape), torch.randn(shape)
    want = _norm_grads(copy.deepcopy(ref), x, grad)
    whole = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform", rounding="nearest")
    g_whole = _norm_grads(whole, x, grad)
    monkeypatch.setattr(_saving, "PRODUCE_CHUNK_BYTES", 1 << 14)
    calls = []
    orig = _saving.quantize
    monkeypatch.setattr(_saving, "quantize", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    chunked = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform", rounding="nearest")
    g_chunked = _norm_grads(chunked, x, grad)
    assert len(calls) >= 2
    for a, b, c in zip(g_whole, g_chunked, want):
        assert torch.equal(a, b)
        assert F.cosine_similarity(b.flatten(), c.flatten(), dim=0) >= 0.9999


def test_chunks_and_tiles_are_larger_off_the_cpu():
    """Off the CPU a chunk's host work outweighs a 1 MiB chunk's kernels (docs/results.md, GPU):
    chunks are DEVICE_CHUNK_SCALE times larger there, attention tiles DEVICE_BLOCK_SCALE times.
    At the H200 run's shapes: ResNet-50's first batch norm at batch 64 (64 x 64 x 112 x 112,
    205 MB) was made in 64 chunks (one per sample), now 4; GPT-2 small's attention at batch 4,
    sequence 1024 (48 x 1024 x 1024 scores) was 48 tiles, now 6."""
    from actnn_zoo.functional import attention as fattn

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    bn = torch.Size((64, 64, 112, 112))
    assert len(_saving.produce_bounds(bn, cpu)) - 1 == 64
    assert _saving.produce_bounds(bn) == _saving.produce_bounds(bn, cpu)  # None: the CPU
    after = _saving.produce_bounds(bn, cuda)
    assert len(after) - 1 == 4 and after[0] == 0 and after[-1] == 64
    # a tensor below one device chunk is made whole there, in chunks on the CPU
    ln = torch.Size((4, 1024, 768))
    assert _saving.produce_bounds(ln, cuda) is None and len(_saving.produce_bounds(ln, cpu)) == 5

    def tiles(device):
        nb, nr = fattn._tiles(48, 1024, 1024, fattn.tile_budget(device))
        return -(-48 // nb) * -(-1024 // nr)

    assert tiles(cpu) == 48 and tiles(cuda) == 6
    assert fattn.tile_budget(cpu) == fattn.BLOCK_ELEMENTS
