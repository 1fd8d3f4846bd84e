"""One compressed store per training forward, and the saved-tensor hooks of tier 3.

Two jobs, one object:

* **Compress each tensor once.** The zoo's Functions (through ``functional/_saving.compress``)
  and the tier-3 hooks ask the store for the compressed copy of a tensor. A tensor saved by
  several ops or layers (LayerNorm's output feeding q, k and v; ``x * x``; a block input read by
  two convolutions) is quantized once and every backward reads the same payload. The key is the
  memory the tensor views -- storage address, offset, shape, strides, dtype -- plus its version
  counter (so a tensor changed in place after saving is compressed anew, never read back
  wrongly) and the quantization settings. An entry is valid only while the tensor object that
  owns the memory (the view's base, else the tensor) is alive (a weak reference): while it
  lives its storage cannot be freed and its address reused, so the key cannot name other data.
  Nothing in the store keeps a tensor alive, so the forward's peak memory is unchanged.
* **Tier 3.** ``pack``/``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``: every
  floating tensor an op saves is kept compressed (bool tensors as 1-bit masks), except
  parameters and buffers, tensors the zoo's Functions saved on purpose (their payloads and exact
  statistics), small tensors, integer tensors, float64, and layouts that are not dense.
  ``unpack`` only reads the payload, so ``retain_graph`` backward can unpack again.

The store lives for one forward (a :class:`~actnn_zoo.capture.CaptureSession`); afterwards only
the payloads autograd holds remain.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._torch_private import tensor_base, tensor_version
from ..config import LayerQConfig
from ..quant import Bits, QuantizedTensor, pack_mask, quantize, unpack_mask
from ..quant.division import Payload, decompress, uses_division
from .session import current_observer

__all__ = ["CompressedStore", "CaptureStats", "dense_order"]

COMPRESSIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _eager(fn: Callable) -> Callable:
    """Run ``fn`` eagerly under ``torch.compile``: the store's bookkeeping (storage addresses,
    weak references, the extension's kernels) is host code that dynamo would otherwise try to
    trace and recompile for every dtype and shape it meets. Costs ~0.5 us per call in eager."""
    return torch.compiler.disable(fn)


@dataclass
class CaptureStats:
    """What one captured forward did (kept on the model for :func:`capture_report`).

    ``routed``: functional calls tier 2 sent to the zoo's Functions, by name. ``compressed`` /
    ``compressed_bytes``: tensors tier 3 compressed and their original size; ``shared``: saves
    answered from the store (a tensor compressed once and saved again); ``passed``: tensors left
    as they are, by reason, with their bytes.
    """

    routed: Dict[str, int] = field(default_factory=dict)
    compressed: int = 0
    compressed_bytes: int = 0
    shared: int = 0
    passed: Dict[str, List[int]] = field(default_factory=dict)  # reason -> [count, bytes]

    def _pass(self, reason: str, t: Tensor) -> None:
        entry = self.passed.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()

    def route(self, name: str) -> None:
        self.routed[name] = self.routed.get(name, 0) + 1

    def __str__(self) -> str:
        lines = [f"tier 2 routed: " + (", ".join(f"{k} x{v}" for k, v in
                                                  sorted(self.routed.items())) or "nothing"),
                 f"tier 3 compressed: {self.compressed} tensors "
                 f"({self.compressed_bytes / 2 ** 20:.2f} MiB before compression); "
                 f"saves answered from the store: {self.shared}"]
        for reason, (count, nbytes) in sorted(self.passed.items()):
            lines.append(f"left as saved ({reason}): {count} tensors, "
                         f"{nbytes / 2 ** 20:.2f} MiB")
        return "\n".join(lines)


def dense_order(t: Tensor) -> Optional[Tuple[int, ...]]:
    """A permutation ``p`` with ``t.permute(p)`` contiguous (identity for a contiguous tensor),
    or None when ``t`` has gaps or overlaps (expanded, sliced): such a tensor is not copied."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    p = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return p if t.permute(p).is_contiguous() else None


def _inverse(p: Sequence[int]) -> Tuple[int, ...]:
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Compressed:
    """What autograd keeps for a tier-3 float tensor: the payload and how to lay it out."""

    __slots__ = ("q", "perm")

    def __init__(self, q: Payload, perm: Tuple[int, ...]) -> None:
        self.q, self.perm = q, perm

    def tensors(self) -> Tuple[Tensor, ...]:
        return self.q.tensors()

    def restore(self) -> Tensor:
        return decompress(self.q).permute(_inverse(self.perm))


class _Mask:
    """A bool tensor kept at 1 bit per value (in memory order)."""

    __slots__ = ("packed", "shape", "perm")

    def __init__(self, packed: Tensor, shape: torch.Size, perm: Tuple[int, ...]) -> None:
        self.packed, self.shape, self.perm = packed, shape, perm

    def tensors(self) -> Tuple[Tensor, ...]:
        return (self.packed,)

    def restore(self) -> Tensor:
        return unpack_mask(self.packed, self.shape).permute(_inverse(self.perm))


class _Observed:
    """Measurement only: the saved object plus what the observer returned for its tensors,
    kept alive exactly as long as autograd keeps the saved object."""

    __slots__ = ("inner", "seen")

    def __init__(self, inner: Any, seen: List[Any]) -> None:
        self.inner, self.seen = inner, seen


class CompressedStore:
    """The compress-once cache and the tier-3 hooks of one forward.

    ``qconfig``: the settings tier 3 compresses with. ``skip``: storage addresses never to
    compress (the model's parameters and buffers). ``min_numel``: smaller tensors are kept as
    they are (the bytes are negligible and per-row statistics such as a norm's rstd must stay
    exact). ``refresh``: when given, called for a fresh ``skip`` before a tensor is treated as
    an activation (parameters that appear only during the forward: FSDP2 all-gathers each
    layer's weights just before it runs).
    """

    def __init__(self, qconfig: LayerQConfig, skip: Set[int], min_numel: int,
                 stats: Optional[CaptureStats] = None,
                 refresh: Optional[Callable[[], Set[int]]] = None) -> None:
        self.qconfig = qconfig
        self.min_numel = min_numel
        self.stats = stats if stats is not None else CaptureStats()
        self._skip = skip
        self._refresh = refresh
        self._kept: Dict[int, "weakref.ref[Tensor]"] = {}
        self._cache: Dict[tuple, Tuple["weakref.ref[Tensor]", Payload]] = {}

    # -- the one store ---------------------------------------------------------------------
    @_eager
    def compress(self, x: Tensor, bits: Bits, group_size: int, rounding: str,
                 owner: Optional[Tensor] = None, quantize_fn: Any = None,
                 kind: Any = "quant") -> Payload:
        """``quantize(x, ...)``, answered from the store when the same memory at the same
        version was already compressed with the same settings in this forward. ``owner``: the
        tensor object whose life keeps ``x``'s memory valid (default: ``x``'s base, else
        ``x``). ``quantize_fn``: what quantizes (default :func:`actnn_zoo.quant.quantize`);
        ``kind`` names it in the key ('quant', ('quant', transform) or ('division', block)),
        so a tensor compressed two ways is never answered with the other way's payload."""
        quantize_fn = quantize if quantize_fn is None else quantize_fn
        kw = {"rounding": rounding}
        if not isinstance(bits, int) or x.layout != torch.strided:
            return quantize_fn(x, bits, group_size, **kw)  # per-sample: not shared
        key = (_storage_ptr(x), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype,
               tensor_version(x), bits, group_size, rounding, kind)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            self.stats.shared += 1
            return hit[1]
        q = quantize_fn(x, bits, group_size, **kw)
        if owner is None:
            owner = tensor_base(x) if tensor_base(x) is not None else x
        self._cache[key] = (weakref.ref(owner), q)
        return q

    @_eager
    def keep(self, t: Tensor) -> None:
        """Mark a tensor a zoo Function saves on purpose (a payload, exact statistics): tier 3
        passes it through."""
        if t.layout == torch.strided and t.numel():
            self._kept[_storage_ptr(t)] = weakref.ref(t)

    def _is_kept(self, ptr: int) -> bool:
        ref = self._kept.get(ptr)
        return ref is not None and ref() is not None

    # -- tier 3: saved-tensor hooks ----------------------------------------------------------
    @_eager
    def pack(self, t: Tensor) -> Any:
        saved = self._pack(t)
        observer = current_observer()
        if observer is None:
            return saved
        kept = saved.tensors() if isinstance(saved, (_Compressed, _Mask)) else (saved,)
        return _Observed(saved, [observer(k) for k in kept])

    @staticmethod
    @_eager
    def unpack(saved: Any) -> Tensor:
        if isinstance(saved, _Observed):
            saved = saved.inner
        if isinstance(saved, (_Compressed, _Mask)):
            return saved.restore()
        return saved

    def _pack(self, t: Tensor) -> Any:
        stats = self.stats
        if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
            stats._pass("tensor subclass", t)
            return t
        if t.layout != torch.strided or t.is_nested:
            stats._pass("not strided", t)
            return t
        if t.numel() < self.min_numel:
            stats._pass("small", t)
            return t
        ptr = _storage_ptr(t)
        if ptr not in self._skip and self._refresh is not None:
            self._skip = self._refresh()
        if ptr in self._skip:
            stats._pass("parameter or buffer", t)
            return t
        if self._is_kept(ptr):
            stats._pass("saved by a zoo Function", t)
            return t
        if t.dtype != torch.bool and t.dtype not in COMPRESSIBLE:
            stats._pass("float64" if t.dtype == torch.float64 else "integer", t)
            return t
        perm = dense_order(t)
        if perm is None:
            stats._pass("not dense (expanded or sliced)", t)
            return t
        x = t.detach().permute(perm)
        if t.dtype == torch.bool:
            stats.compressed += 1
            stats.compressed_bytes += t.numel()
            return _Mask(pack_mask(x), x.shape, perm)
        before = stats.shared
        # DIVISION reads dims as (N, C, *spatial): only a tensor stored in that order qualifies
        fn, kind = _plain, "quant"
        if perm == tuple(range(t.dim())) and uses_division(x, self.qconfig.compressor):
            fn, kind = _quantizer_for(x, self.qconfig)
        q = self.compress(x, self.qconfig.bits, self.qconfig.group_size, self.qconfig.rounding,
                          owner=tensor_base(t) if tensor_base(t) is not None else t, quantize_fn=fn,
                          kind=kind)
        if stats.shared == before:
            stats.compressed += 1
            stats.compressed_bytes += t.numel() * t.element_size()
        return _Compressed(q, perm)


def _plain(x: Tensor, bits: Bits, group_size: int, rounding: str) -> QuantizedTensor:
    return quantize(x, bits, group_size, rounding=rounding)


def _quantizer_for(x: Tensor, qconfig: LayerQConfig):
    from ..functional._saving import quantizer_for  # functional imports this module

    return quantizer_for(x, qconfig)
