"""The kernels as ``torch.library`` custom operators, for graphs that ``torch.compile`` traces.

Eager code calls the extension directly (:mod:`actnn_zoo.quant.api`), which skips the
dispatcher. A traced graph cannot call an opaque pybind function, so the compiled path
(:mod:`actnn_zoo.compiled`) calls these instead: each has a schema, a fake (meta) kernel that
gives the output shapes without running anything, and an implementation per device.
``tests/test_custom_ops.py`` checks them with ``torch.library.opcheck``.

Where they are defined: the compiled extension defines the schemas and its CPU (and CUDA)
kernels in C++ when it loads (``cpp_ext/bindings.cpp``): a quantize call then costs ~7 us on a
tiny tensor (the bare kernel ~3 us), where an implementation in Python cost ~15 us (the
dispatcher's trip back into the interpreter). This module adds the fake kernels and, for a
device the extension has no kernel for (or no extension at all), an implementation through
:func:`~actnn_zoo.quant.backend.kernels`, i.e. the pure-torch reference: same results.

The seed is an optional tensor, not an int: given, the operator is a function of its inputs
(what opcheck and the tests use); None, it draws one from torch's default CPU generator, so each
step of a compiled graph rounds with new random numbers at no extra graph node.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .backend import extension, kernels
from .reference import contract_rows

__all__ = ["quantize_uniform", "dequantize_uniform", "pack_mask", "unpack_mask", "rows_of"]

_NS = "actnn_zoo"
# Loading the extension defines the schemas with its C++ kernels (a fragment of the namespace:
# this module adds to it, see the module docstring).
_EXT = extension()


def _defined(name: str) -> bool:
    """Whether ``actnn_zoo::<name>`` exists already (the extension defined it on loading,
    also when something imported it under the reference backend)."""
    try:
        getattr(getattr(torch.ops, _NS), name)
    except (AttributeError, RuntimeError):
        return False
    return True


_DEFINED_IN_CPP = bool(getattr(_EXT, "has_torch_ops", False)) or _defined("quantize_uniform")
_LIB = torch.library.Library(_NS, "FRAGMENT")


# (N, D) of the quantization contract's row view: dim 0 is the sample, the rest one row;
# 0-d and 1-d tensors are one row (works on symbolic sizes too)
rows_of = contract_rows


def _check(bits: int, group_size: int) -> None:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"actnn_zoo::quantize_uniform: bits must be 1, 2, 4 or 8, got {bits}")
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"actnn_zoo::quantize_uniform: group_size must be a positive "
                         f"multiple of 8, got {group_size}")


def _register(schema: str, impl: Callable, fake: Callable, tags: Tuple = ()) -> Any:
    """``actnn_zoo::<name>`` with ``schema`` (unless the extension defined it), ``impl`` for
    devices without a compiled kernel, and a fake kernel; returns the operator. The low-level
    ``torch.library.Library`` API: ``torch.library.custom_op`` measured 25-27 us per call."""
    name = schema.split("(", 1)[0]
    if not _DEFINED_IN_CPP:
        _LIB.define(schema, tags=tags)
    # CompositeExplicitAutograd: every device; a C++ kernel registered for CPU/CUDA wins there.
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_NS}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, _NS), name).default


def _quantize_uniform(x: Tensor, seed: Optional[Tensor], bits: int, group_size: int,
                      stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    _check(bits, group_size)
    if not x.is_contiguous():
        raise ValueError("actnn_zoo::quantize_uniform needs a contiguous tensor")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"actnn_zoo::quantize_uniform: float32/16 or bfloat16, got {x.dtype}")
    n, d = rows_of(x.shape)
    if n * d == 0:
        lo = torch.empty(n, -(-d // group_size), dtype=torch.bfloat16, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), lo, torch.empty_like(lo)
    s = (int(seed.reshape(-1)[0]) & 0xFFFFFFFF if seed is not None
         else int(torch.randint(0, 2 ** 31 - 1, (1,)).item()))
    return kernels(x.device).quantize_uniform(x, bits, group_size, s, stochastic)


def _quantize_uniform_fake(x: Tensor, seed: Optional[Tensor], bits: int, group_size: int,
                           stochastic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    _check(bits, group_size)
    n, d = rows_of(x.shape)
    lo = x.new_empty((n, (d + group_size - 1) // group_size), dtype=torch.bfloat16)
    data = x.new_empty((n * ((d * bits + 7) // 8),), dtype=torch.uint8)
    return data, lo, torch.empty_like(lo)


quantize_uniform = _register(
    "quantize_uniform(Tensor x, Tensor? seed, int bits, int group_size, bool stochastic) "
    "-> (Tensor, Tensor, Tensor)", _quantize_uniform, _quantize_uniform_fake,
    (torch.Tag.nondeterministic_seeded,))
quantize_uniform.__doc__ = """(codes, lo, step) of a contiguous float tensor at one width for
every row: the codes are ``N * ceil(D * bits / 8)`` bytes, ``lo``/``step`` bfloat16
``(N, ceil(D / group))``. ``seed``: a one-element integer tensor (its low 32 bits seed the
rounding), or None to draw one from torch's default CPU generator inside the call (what a
compiled graph passes: no ``torch.randint`` node per saved tensor; the operator is tagged
``nondeterministic_seeded`` so that compilers neither merge nor replay it). A CUDA graph
would replay it with the seed drawn at capture, so on CUDA stochastic rounding raises while
the stream is being captured (``mode="reduce-overhead"``)."""


def _dequantize_uniform(data: Tensor, lo: Tensor, step: Tensor, shape: List[int], bits: int,
                        group_size: int, dtype: torch.dtype) -> Tensor:
    _check(bits, group_size)
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if out.numel():
        kernels(data.device).dequantize_uniform(data, lo, step, bits, group_size, 0, out)
    return out


def _dequantize_uniform_fake(data: Tensor, lo: Tensor, step: Tensor, shape: List[int],
                             bits: int, group_size: int, dtype: torch.dtype) -> Tensor:
    return data.new_empty(shape, dtype=dtype)


dequantize_uniform = _register(
    "dequantize_uniform(Tensor data, Tensor lo, Tensor step, SymInt[] shape, int bits, "
    "int group_size, ScalarType dtype) -> Tensor", _dequantize_uniform,
    _dequantize_uniform_fake)


def _pack_mask(mask: Tensor) -> Tensor:
    flat = mask.reshape(-1).contiguous()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=mask.device)
    return kernels(mask.device).pack_mask(flat)


def _pack_mask_fake(mask: Tensor) -> Tensor:
    return mask.new_empty(((mask.numel() + 7) // 8,), dtype=torch.uint8)


pack_mask = _register("pack_mask(Tensor mask) -> Tensor", _pack_mask, _pack_mask_fake)


def _unpack_mask(packed: Tensor, shape: List[int]) -> Tensor:
    numel = 1
    for s in shape:
        numel *= s
    if packed.numel() != (numel + 7) // 8:
        raise ValueError(f"actnn_zoo::unpack_mask: {packed.numel()} bytes do not hold "
                         f"{numel} values")
    if numel == 0:
        return torch.empty(shape, dtype=torch.bool, device=packed.device)
    return kernels(packed.device).unpack_mask(packed.contiguous(), numel).view(shape)


def _unpack_mask_fake(packed: Tensor, shape: List[int]) -> Tensor:
    return packed.new_empty(shape, dtype=torch.bool)


unpack_mask = _register("unpack_mask(Tensor packed, SymInt[] shape) -> Tensor", _unpack_mask,
                        _unpack_mask_fake)
