"""Shared helpers for the activation / dropout / pooling / softmax layer tests."""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor, nn

from actnn_zoo.config import LayerQConfig


def saved_bytes(fn: Callable[[], object]) -> Tuple[int, object]:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (docs/design.md, Measuring)."""
    storages: Dict[Tuple[int, str], int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[(s.data_ptr(), str(t.device))] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def run(module: nn.Module, x: Tensor, grad: Tensor = None, inplace_safe: bool = True):
    """Forward + backward of ``module`` on a fresh leaf copy of ``x``.

    The module receives ``leaf * 1`` (a non-leaf), so in-place modules are legal. Returns
    (output, input grad, grad used). Tuple outputs (return_indices) keep their indices.
    """
    leaf = x.detach().clone().requires_grad_(True)
    inp = leaf * 1 if inplace_safe else leaf
    out = module(inp)
    y = out[0] if isinstance(out, tuple) else out
    if grad is None:
        gen = torch.Generator().manual_seed(1234)
        grad = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(grad)
    return out, leaf.grad, grad


def cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def assert_identical(a: Tensor, b: Tensor) -> None:
    """Same dtype, shape and values bit for bit (NaNs in the same places)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def quantized_bytes(n: int, d: int, bits: int, group_size: int = 256) -> int:
    """Codes plus two bf16 numbers per group, for an (n, d) tensor at ``bits``."""
    return n * math.ceil(d * bits / 8) + n * math.ceil(d / group_size) * 2 * 2


def unbiasedness(sample_grad: Callable[[], Tensor], exact: Tensor, k: int) -> Tuple[float, float]:
    """(|| mean of k stochastic grads - exact ||, single-pass RMS error).

    For an unbiased estimator with independent passes, E||mean - exact||^2 = RMS^2 / k, so the
    error of the mean is about RMS / sqrt(k); a bias b would instead leave ||b|| however large k.
    """
    total = torch.zeros_like(exact, dtype=torch.float64)
    sq = 0.0
    for _ in range(k):
        g = sample_grad().double()
        total += g
        sq += float(((g - exact.double()) ** 2).sum())
    mean_err = float((total / k - exact.double()).norm())
    return mean_err, math.sqrt(sq / k)


def q8() -> LayerQConfig:
    return LayerQConfig(bits=8)


def q2(**kw) -> LayerQConfig:
    return LayerQConfig(bits=2, **kw)
