"""Saving compressed tensors through ctx.save_for_backward and getting them back."""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .._session import active_session
from ..config import LayerQConfig
from ..quant import Bits, QuantizedTensor, SampleBits, quantize, quantize_normalized
from ..quant import dequantize_rows as _dequantize_rows
from ..quant import ops
from ..quant.api import normalizes_in_kernel, quantize_saved
from ..quant.sparse import dequantize_sparse_rows, rows_decodable
from ..quant.tensor import CompressedPayload, SparseQuantizedTensor
from ..quant.division import (DivisionTensor, Payload, decompress, division_quantize,
                              uses_division)

Saved = Union[Tensor, CompressedPayload, None]


def compress(x: Tensor, qconfig: LayerQConfig, bits: Optional[Bits] = None, *,
             maps: Optional[bool] = None) -> Payload:
    """Quantize ``x`` as ``qconfig`` says (``bits`` overrides its width, e.g. per-sample).

    With ``qconfig.compressor == 'division'`` a tensor laid out as feature maps (N, C,
    *spatial) is stored as DIVISION's bf16 block means plus the residual at ``bits`` (a
    :class:`~actnn_zoo.quant.division.DivisionTensor`); any other tensor is quantized as usual.
    ``maps``: whether the calling layer knows ``x`` to be channels-first maps (True), features
    last (False), or does not know (None); ``quant.division.uses_division`` says which qualify.

    Inside a converted model's training forward the capture session's store answers, so a
    tensor that several layers save is compressed once (``actnn_zoo.capture.store``, reached
    through ``actnn_zoo._session.active_session``).

    float64 is quantized through a float32 copy (the result dequantizes to float32; callers
    cast to their compute dtype): quantization itself takes float32 at most, and its step is
    far coarser than float32's rounding (``functional.linear.check_compressible`` says why
    float64 is compressed at all). The store keys on the float64 tensor, so sharing still works.
    """
    session = active_session()
    if session is None:
        return compress_fresh(x, qconfig, bits, maps=maps)
    if qconfig.compressor == "quant" and qconfig.transform == "none":
        fn, kind = _quantize_any_float, "quant"  # quantizer_for's answer, two frames less
    else:
        fn, kind = quantizer_for(x, qconfig, maps)
    return session.store.compress(x, qconfig.bits if bits is None else bits,
                                  qconfig.group_size, qconfig.rounding, quantize_fn=fn,
                                  kind=kind)


def compress_fresh(x: Tensor, qconfig: LayerQConfig, bits: Optional[Bits] = None, *,
                   maps: Optional[bool] = None) -> Payload:
    """:func:`compress` without the capture store: what it does outside a session, and inside
    one for a tensor the caller has just made and that nothing else holds (an activation's
    f'(x)), which the store's compress-once lookup could never answer; skipping its key, cache
    entry and eviction saves ~10 us a call. The seed comes from the session's stream in the
    same order, so the codes are those :func:`compress` would make."""
    fn, _ = quantizer_for(x, qconfig, maps)
    return fn(x, qconfig.bits if bits is None else bits, qconfig.group_size,
              rounding=qconfig.rounding)


def compress_normalized(x: Tensor, mean: Tensor, invstd: Tensor, qconfig: LayerQConfig,
                        bits: Optional[Bits] = None) -> Optional[QuantizedTensor]:
    """``compress((x - mean) * invstd)`` for a norm's statistics (shaped to broadcast against
    ``x``: per channel, per row or per (sample, channel); ``quant.quantize_normalized``) without
    making the normalized copy, where the CPU kernel does that (plain quantizer, no rotation,
    contiguous float32/16 input); else None, and the caller makes the copy. Why: norms save
    their normalized input, and making it took two passes over the map before the quantizer's
    (docs/design.md, "The step's time")."""
    if not (qconfig.compressor == "quant" and qconfig.transform == "none"
            and normalizes_in_kernel(x, mean, invstd)):
        return None
    return quantize_normalized(x, mean, invstd, qconfig.bits if bits is None else bits,
                               qconfig.group_size, rounding=qconfig.rounding)


def quantizer_for(x: Tensor, qconfig: LayerQConfig, maps: Optional[bool] = None):
    """(the function that compresses ``x`` under ``qconfig``, a key naming it for the store);
    ``maps`` as in :func:`compress`."""
    if uses_division(x, qconfig.compressor, maps):
        block = qconfig.division_block
        return functools.partial(_divide_any_float, block=block), ("division", block)
    if qconfig.transform != "none":
        return (functools.partial(_quantize_any_float, transform=qconfig.transform),
                ("quant", qconfig.transform))
    return _quantize_any_float, "quant"


def _quantize_any_float(x: Tensor, bits: Bits, group_size: int, rounding: str,
                        transform: str = "none") -> QuantizedTensor:
    """``quantize``, with float64 cast to float32 first; without a rotation the layers' own
    entry (``quant.api.quantize_saved``: the settings were checked with the qconfig)."""
    if x.dtype == torch.float64:
        x = x.float()
    if transform == "none":
        return quantize_saved(x, bits, group_size, rounding == "stochastic")
    return quantize(x, bits, group_size, rounding=rounding, transform=transform)


def _divide_any_float(x: Tensor, bits: Bits, group_size: int, rounding: str, block: int
                      ) -> DivisionTensor:
    """``division_quantize`` (float64 through float32, as above); ``group_size`` is unused:
    DIVISION's residual has one range per (sample, channel) map."""
    if x.dtype == torch.float64:
        x = x.float()
    return division_quantize(x, bits, block, rounding=rounding)


def save(ctx, *items: Saved) -> None:
    """Save plain tensors, QuantizedTensors and Nones, all through ``ctx.save_for_backward``."""
    tensors: List[Tensor] = []
    layout = []
    for item in items:
        if isinstance(item, CompressedPayload):
            ts = item.tensors()
            layout.append(("q", len(ts), (type(item), item.spec())))
            tensors.extend(ts)
        elif item is None:
            layout.append(("none", 0, None))
        else:
            layout.append(("t", 1, None))
            tensors.append(item)
    ctx._az_layout = layout
    session = active_session()
    if session is not None:  # what a zoo Function saves is final: tier 3 must not touch it
        session.store.keep(*tensors)
    ctx.save_for_backward(*tensors)


def keep_saved(*tensors: Tensor, counted: bool = True) -> object:
    """A compiled node's ``own_saves`` argument (``cpp_ext/qlayers.cpp``) for the tensors it is
    about to save: inside a capture session the store is told that they are saved on purpose
    (tier 3 passes them through, as for :func:`save`), and answers with its pack hook where
    the node may skip its hooks for them (:meth:`~actnn_zoo.capture.store.CompressedStore.
    keep_own`); None outside a session or where the hooks must run."""
    session = active_session()
    return None if session is None else session.store.keep_own(*tensors, counted=counted)


def load(ctx) -> List[Saved]:
    """The items given to :func:`save`, in order (QuantizedTensors rebuilt, not decompressed)."""
    tensors = ctx.saved_tensors
    out: List[Saved] = []
    i = 0
    for kind, count, spec in ctx._az_layout:
        if kind == "q":
            cls, inner = spec
            out.append(cls.rebuild(inner, tuple(tensors[i:i + count])))
        elif kind == "t":
            out.append(tensors[i])
        else:
            out.append(None)
        i += count
    return out


def memory_perm(t: Tensor) -> Optional[Tuple[int, ...]]:
    """A permutation ``p`` with ``t.permute(p)`` contiguous and ``p[0] == 0`` (so rows are still
    samples), for channels_last(_3d) tensors; None when logical order is already right."""
    if t.is_contiguous():
        return None
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return (0, 2, 3, 1)
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return (0, 2, 3, 4, 1)
    return None


def to_memory_order(t: Tensor, perm: Optional[Tuple[int, ...]]) -> Tensor:
    return t if perm is None else t.permute(perm)


def from_memory_order(t: Tensor, perm: Optional[Tuple[int, ...]]) -> Tensor:
    if perm is None:
        return t
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return t.permute(inverse)


def save_codes(ctx, x: Optional[Tensor], bits: int, group_size: int, *tensors: Tensor) -> None:
    """For a traced Function (the form ``torch.compile`` traces): ``x`` as
    ``actnn_zoo::quantize_uniform`` codes at one width, in its memory order, then ``tensors``
    as they are, through ``ctx.save_for_backward``. The graph keeps a custom operator's
    outputs as it is given them, so what it saves is the codes. ``x`` None saves nothing of it
    (the weight needs no gradient). float64 goes through a float32 copy, as in
    :func:`compress`."""
    if x is None:
        ctx.codes = None
        ctx.save_for_backward(*tensors)
        return
    # the memory order of channels-last maps (no sort over strides: under dynamic shapes
    # they are symbolic); any other layout is copied
    perm = memory_perm(x)
    xp = x.contiguous() if perm is None else to_memory_order(x, perm)
    q = xp.float() if xp.dtype == torch.float64 else xp
    data, lo, step = ops.quantize_uniform(q, None, bits, group_size, True)
    ctx.codes = ([int(s) for s in xp.shape], q.dtype, bits, group_size, perm)
    ctx.save_for_backward(data, lo, step, *tensors)


def load_codes(ctx) -> Tuple[Optional[Tensor], Tuple[Tensor, ...]]:
    """(the decoded ``x`` laid out as it was, or None; the other tensors) of
    :func:`save_codes`."""
    saved = ctx.saved_tensors
    if ctx.codes is None:
        return None, tuple(saved)
    shape, dtype, bits, group_size, perm = ctx.codes
    x = ops.dequantize_uniform(saved[0], saved[1], saved[2], shape, bits, group_size, dtype)
    return from_memory_order(x, perm), tuple(saved[3:])


def restore(item: Saved) -> Optional[Tensor]:
    """Decompress a saved item (identity for plain tensors and None)."""
    if isinstance(item, CompressedPayload):
        return decompress(item)
    return item


# Below this many decoded bytes a saved input is decoded whole: splitting it only adds calls.
CHUNK_MIN_BYTES = 1 << 20


def large_input(item: Saved) -> bool:
    """Whether a saved input holds ``CHUNK_MIN_BYTES`` or more as float32: then a backward
    computes the weight gradient first and frees the decoded input before the input gradient
    exists (one full map less at the peak); below it one call doing both is cheaper, and a
    small map does not set the step's peak."""
    shape = getattr(item, "shape", None)
    return shape is not None and shape.numel() * 4 >= CHUNK_MIN_BYTES


def sample_chunks(item: Saved, chunks: int) -> List[Tuple[int, int]]:
    """Sample ranges in which a backward decodes ``item`` (a saved input), or [] to decode it
    whole: whole when ``chunks`` <= 1, when it is not a QuantizedTensor (or sparse codes whose
    samples fill whole bytes of their mask) of at least 2 samples and ``CHUNK_MIN_BYTES``
    decoded, and when backward is itself differentiated (``create_graph=True``, the graph would
    keep every chunk alive anyway).

    Why: the backward of a layer that reads its input only through a sum over samples (conv and
    linear weight gradients) then holds ``1/chunks`` of the decoded input at a time instead of a
    whole map, which is what set the step's peak (docs/design.md, "The step's peak").
    """
    if chunks <= 1 or len(getattr(item, "shape", ())) < 2 or torch.is_grad_enabled():
        return []
    if not (isinstance(item, QuantizedTensor)
            or (isinstance(item, SparseQuantizedTensor) and rows_decodable(item))):
        return []
    n = item.shape[0]
    if n < 2 or item.numel() * item.dtype.itemsize < CHUNK_MIN_BYTES:
        return []
    k = min(chunks, n)
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def dequantize_rows(item: Union[QuantizedTensor, SparseQuantizedTensor], start: int,
                    stop: int) -> Tensor:
    """Samples ``start:stop`` of a payload :func:`sample_chunks` accepted, decoded: plain codes
    (``quant.dequantize_rows``) or a ReLU output's sparse codes (``dequantize_sparse_rows``)."""
    if isinstance(item, SparseQuantizedTensor):
        return dequantize_sparse_rows(item, start, stop)
    return _dequantize_rows(item, start, stop)


# A tensor made only to be compressed (an activation's derivative) is made and quantized this
# many bytes at a time when it is larger: the whole float32 map never exists.
PRODUCE_CHUNK_BYTES = 1 << 20
# Off the CPU, chunks are this many times larger (attention's score tiles: DEVICE_BLOCK_SCALE).
# A chunk costs a fixed amount of host work (14-27 us of Python on the CPU, then its kernel
# launches), which on a GPU buys a 1 MiB chunk about a microsecond of kernels: a converted
# ResNet-50 at batch 64 made 1,868 batch-norm chunks a step and ran 8.4x fp32's step on an
# H200 (docs/results.md, GPU; scripts/bench_chunk_cost.py); 74 at this size. 64 MiB keeps the
# transient a small part of a GPU step's peak.
DEVICE_CHUNK_SCALE = 64


def chunk_scale(device: Optional[torch.device]) -> int:
    """How many times the CPU's chunk size (``PRODUCE_CHUNK_BYTES``) the chunks on ``device``
    are (None: the CPU)."""
    return 1 if device is None or device.type == "cpu" else DEVICE_CHUNK_SCALE


def produce_bounds(shape: torch.Size, device: Optional[torch.device] = None
                   ) -> Optional[List[int]]:
    """The sample bounds ``[0, ..., n]`` of the chunks in which :func:`compress_produced` makes
    a float32 tensor of ``shape`` on ``device`` (each at most about ``PRODUCE_CHUNK_BYTES``
    times :func:`chunk_scale`), or None when it is made whole (less than two chunks' worth,
    or one sample)."""
    n = shape[0] if len(shape) >= 2 else 1
    total = shape.numel() * 4  # produced in float32
    k = min(n, -(-total // (PRODUCE_CHUNK_BYTES * chunk_scale(device))))
    if k < 2:
        return None
    return [n * i // k for i in range(k + 1)]


def compress_produced(produce: Callable[[int, int], Tensor], shape: torch.Size,
                      qconfig: LayerQConfig, bits: Optional[Bits] = None,
                      device: Optional[torch.device] = None) -> Optional[QuantizedTensor]:
    """``compress(t)`` of a float tensor ``t`` of ``shape`` on ``device`` (None: the CPU) that
    exists only to be compressed, made by ``produce(start, stop)`` (its samples
    ``start:stop``, contiguous, rows of dim 0) a chunk of samples at a time, so that at most
    a chunk (:func:`produce_bounds`) of it exists at once.

    Why: a smooth activation computes its float32 derivative f'(x) in forward only to quantize
    it; whole, that map sat next to the layer's input and output and set the forward's peak
    (the transformer's MLP). Returns None when chunking does not apply -- fewer than 2 chunks'
    worth, a compressor other than the plain quantizer (DIVISION, a rotation), or per-sample
    widths off the CPU (their per-chunk bound would need a device read) -- and the caller then
    makes the tensor whole and calls :func:`compress`. The codes are those of quantizing each
    chunk with its own seed (the same contract: unbiased, per-group metadata).
    """
    b = qconfig.bits if bits is None else bits
    bounds = produce_bounds(shape, device)
    if bounds is None or qconfig.compressor != "quant" or qconfig.transform != "none":
        return None
    if isinstance(b, SampleBits) and not b.bits.is_cpu:
        return None
    parts = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if isinstance(b, SampleBits):
            rows = b.bits[start:stop]
            cb: Bits = SampleBits(rows, int(rows.long().sum()))
        elif isinstance(b, Tensor):
            cb = b[start:stop]
        else:
            cb = b
        parts.append(quantize(produce(start, stop), cb, qconfig.group_size,
                              rounding=qconfig.rounding))
    first = parts[0]
    data = torch.cat([p.data for p in parts])
    lo, step = torch.cat([p.lo for p in parts]), torch.cat([p.step for p in parts])
    if not first.mixed:
        return QuantizedTensor(data, lo, step, shape, first.dtype, first.bits, first.group_size)
    offsets, base = [], 0
    for p in parts:
        offsets.append(p.offsets[:-1] + base)
        base += p.data.numel()
    offsets.append(torch.tensor([base], dtype=torch.int64, device=data.device))
    return QuantizedTensor(data, lo, step, shape, first.dtype, None, first.group_size,
                           torch.cat([p.row_bits for p in parts]), torch.cat(offsets))
