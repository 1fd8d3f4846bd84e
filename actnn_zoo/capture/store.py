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
* **Composing with the user's hooks.** Saved-tensor hooks do not chain: torch calls only the
  innermost pair. When the session opens inside other hooks (``save_on_cpu``, an offloading
  or counting pair the user entered around the model; :func:`outer_hooks_present` asks), each
  pack hands what it keeps -- the payload tensors (codes, ranges, masks) and the tensors it
  passes through -- to those hooks: it steps out of its own hooks for the moment, saves them
  through a one-node identity Function (:class:`_Box`) whose ``save_for_backward`` the outer
  hooks pack, and keeps its output (which owns the node); ``unpack`` reads them back through
  the node's ``saved_tensors``. So ``save_on_cpu`` offloads compressed activations.

The store lives for one forward (a :class:`~actnn_zoo.capture.CaptureSession`); afterwards only
the payloads autograd holds remain.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._compile import eager as _eager
from .._compile import _is_compiling
from .. import _session
from .._session import (ZeroCodeClaim, ZeroCodeSlot, current_observer, dense_order,
                        inverse_order, save_probe, storage_ptr as _storage_ptr)
from .._torch_private import (inside_checkpoint, saved_by_checkpoint, tensor_base,
                              tensor_version)
from ..config import LayerQConfig
from ..functional._saving import quantizer_for
from ..quant import Bits, QuantizedTensor, pack_mask, quantize, unpack_mask
from ..quant.api import dropout_scale
from ..quant.backend import extension
from ..quant.sparse import quantize_sparse
from ..quant.tensor import MaskedPayload, SparseQuantizedTensor
from ..quant.division import Payload, decompress, uses_division

__all__ = ["CompressedStore", "CaptureStats"]

COMPRESSIBLE = (torch.float32, torch.float16, torch.bfloat16)
# The files of the pack hook's own frames (pack, _pack_hook and _pack, all in this module),
# which saved_by_checkpoint looks above
_HOOK_FILES = (__file__,)


_STRIDED, _BOOL = torch.strided, torch.bool
_KEPT_REASON = "saved by a zoo Function"  # CaptureStats.passed's reason for keep()'s tensors
# keep_own's _saving: empty and read-only (pack tests it is empty; a write would raise)
_NOTHING: Mapping[int, Tensor] = MappingProxyType({})
_HOOKS_ACTIVE: Optional[Callable[[], bool]] = getattr(extension(), "saved_hooks_active", None)


def count_saves(tensors: Tuple[Tensor, ...], min_numel: int, kept: Dict[int, Any]
                ) -> Tuple[int, int, int, int]:
    """(tensors, bytes) below ``min_numel`` elements and (tensors, bytes) of the others; each
    of the others that is strided and floating or bool is entered in ``kept`` as {storage
    address: weak reference}: only what tier 3 would otherwise compress needs marking (small
    and integer tensors, the codes, pass through there anyway). The twin of the extension's
    ``count_saves``, for builds without it."""
    n_small = b_small = n_big = b_big = 0
    for t in tensors:
        if t.numel() < min_numel:
            n_small += 1
            b_small += t.nbytes
            continue
        n_big += 1
        b_big += t.nbytes
        if t.layout == _STRIDED and (t.is_floating_point() or t.dtype == _BOOL):
            kept[_storage_ptr(t)] = weakref.ref(t)
    return n_small, b_small, n_big, b_big


# count_saves in one compiled call (cpp_ext/stacks.cpp): ~12 Python calls less per zoo
# Function call; the Python twin above without the extension
_COUNT_SAVES: Callable[[Tuple[Tensor, ...], int, Dict[int, Any]], Tuple[int, int, int, int]] = (
    getattr(extension(), "count_saves", None) or count_saves)


@dataclass
class CaptureStats:
    """What one captured forward did (kept on the model for :func:`capture_report`).

    ``routed``: functional calls tier 2 sent to the zoo's Functions, by name. ``compressed`` /
    ``compressed_bytes``: tensors tier 3 compressed and their original size; ``shared``: saves
    answered from the store (a tensor compressed once and saved again); ``derived`` /
    ``derived_bytes``: dropout outputs tier 3 kept as their input's payload and the dropout's
    mask (:meth:`CompressedStore.derive`, no byte of their own) and their original size;
    ``passed``: tensors left as they are, by reason, with their bytes.
    """

    routed: Dict[str, int] = field(default_factory=dict)
    compressed: int = 0
    compressed_bytes: int = 0
    shared: int = 0
    derived: int = 0
    derived_bytes: int = 0
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
                 f"saves answered from the store: {self.shared}; dropout outputs kept as "
                 f"their input's payload: {self.derived}"]
        for reason, (count, nbytes) in sorted(self.passed.items()):
            lines.append(f"left as saved ({reason}): {count} tensors, "
                         f"{nbytes / 2 ** 20:.2f} MiB")
        return "\n".join(lines)


def memory_key(x: Tensor) -> tuple:
    """The memory ``x`` views, at its current version (see :class:`CompressedStore`). The twin
    of the extension's ``memory_key``, for builds without it."""
    return (_storage_ptr(x), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype,
            tensor_version(x))


# memory_key in one compiled call (cpp_ext/stacks.cpp): three Python frames and five calls
# less on every compressed save and claim; the Python twin above without the extension
_memory_key: Callable[[Tensor], tuple] = getattr(extension(), "memory_key", None) or memory_key


def _flat_key(x: Tensor) -> Optional[tuple]:
    """The memory a contiguous ``x`` covers, whatever its shape (a matmul saves a reshaped view
    of its operand), at its current version; None when ``x`` is not contiguous."""
    if not x.is_contiguous():
        return None
    return (_storage_ptr(x), x.storage_offset(), x.numel(), x.dtype, tensor_version(x))


def _sparse(x: Tensor, bits: Bits, group_size: int, rounding: str,
            mask_out: Optional[Tensor] = None) -> SparseQuantizedTensor:
    """``quantize_sparse`` (float64 through a float32 copy, as the layers do); ``mask_out``:
    the claiming ReLU node's buffer for the mask (``ZeroCodeClaim.mask_buffer``)."""
    if x.dtype == torch.float64:
        x = x.float()
    return quantize_sparse(x, bits, group_size, rounding=rounding, mask_out=mask_out)


class _Compressed:
    """What autograd keeps for a tier-3 float tensor: the payload and how to lay it out."""

    __slots__ = ("q", "perm")

    def __init__(self, q: Payload, perm: Tuple[int, ...]) -> None:
        self.q, self.perm = q, perm

    def tensors(self) -> Tuple[Tensor, ...]:
        return self.q.tensors()

    def restore(self) -> Tensor:
        return decompress(self.q).permute(inverse_order(self.perm))


class _Mask:
    """A bool tensor kept at 1 bit per value (in memory order)."""

    __slots__ = ("packed", "shape", "perm")

    def __init__(self, packed: Tensor, shape: torch.Size, perm: Tuple[int, ...]) -> None:
        self.packed, self.shape, self.perm = packed, shape, perm

    def tensors(self) -> Tuple[Tensor, ...]:
        return (self.packed,)

    def restore(self) -> Tensor:
        return unpack_mask(self.packed, self.shape).permute(inverse_order(self.perm))


class _Observed:
    """Measurement only: the saved object plus what the observer returned for its tensors,
    kept alive exactly as long as autograd keeps the saved object."""

    __slots__ = ("inner", "seen")

    def __init__(self, inner: Any, seen: List[Any]) -> None:
        self.inner, self.seen = inner, seen


class _Box(torch.autograd.Function):
    """Saves its extra arguments for backward and nothing else: the hooks below the capture
    hooks pack them (see the module docstring). Its backward never runs (the node is kept only
    for ``saved_tensors``); it exists because ``save_for_backward`` is the public way to hand
    tensors to the current saved-tensor hooks."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # pragma: no cover - never reached
        return (None,) * (1 + len(ctx.saved_tensors))


def _box(anchor: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """The output of one :class:`_Box` call saving ``tensors`` (detached: an op's output saved
    with its graph would close a reference cycle through the node); :func:`_box_saved` reads
    them back.

    The output, not its ``grad_fn``, is what owns the node: before torch 2.13 the Python
    object ``grad_fn`` returns for a custom Function (its ``ctx``) holds only a weak reference
    to the node, which autograd destroys, freeing the saves, as soon as the output dies; the
    first read then raises "saved tensors ... already freed" (seen with torch 2.11 under
    ``save_on_cpu``)."""
    with torch.enable_grad():
        return _Box.apply(anchor, *[t.detach() for t in tensors])


def _box_saved(box: Tensor) -> Tuple[Tensor, ...]:
    """The tensors a :func:`_box` call saved, as the outer unpack hooks give them back."""
    return box.grad_fn.saved_tensors


def outer_hooks_present() -> bool:
    """Whether saved-tensor hooks are active in this thread (to call before the capture hooks
    are entered: then they are the user's, which the capture hooks would otherwise hide).

    The extension reads autograd's hook stack (``_C.saved_hooks_active``, the C++ API's
    ``at::SavedTensorDefaultHooks``; torch's Python API has no query for it). Without it, this
    asks autograd itself: a tensor saved with no hooks is kept as it is, and reading it back
    after an in-place change raises (autograd's version check); a tensor saved through hooks
    is what their pack returned, and torch skips the check (it cannot follow versions through
    hooks). One tiny save and one read, ~10 us, once per forward; the read calls the outer
    unpack hook once."""
    if _HOOKS_ACTIVE is not None:
        return _HOOKS_ACTIVE()
    probe = torch.zeros(1)
    box = _box(torch.empty(0, requires_grad=True), (probe,))
    probe.add_(1.0)
    try:
        _box_saved(box)
    except RuntimeError:
        return False
    return True


class _Group:
    """One :class:`_Box` node for all the tensors a zoo Function saves at once (one box per
    ``save_for_backward`` instead of one per tensor). Its backward reads them all in a row:
    the tensors read back are held until each of the ``uses`` saves has taken its own, so the
    outer unpack runs once per round, not once per tensor."""

    __slots__ = ("box", "index", "uses", "_read", "_left")

    def __init__(self, box: Tensor, index: Dict[int, int]) -> None:
        self.box, self.index, self.uses = box, index, 0
        self._read: Optional[Tuple[Tensor, ...]] = None
        self._left = 0

    def take(self, i: int) -> Tensor:
        if self._read is None:
            self._read, self._left = _box_saved(self.box), self.uses
        t = self._read[i]
        self._left -= 1
        if self._left <= 0:
            self._read = None
        return t


class _Boxed:
    """What autograd keeps for a save while outer hooks exist: the :func:`_box` output whose
    node holds the kept tensors (as the outer hooks packed them) and how to rebuild the saved
    value. ``kind``: 't' a tensor as it was, 'q' a payload (``meta`` = class, spec,
    permutation), 'm' a 1-bit mask (``meta`` = shape, permutation), 'g' one tensor of a
    :class:`_Group` (``box`` = the group, ``meta`` = its position)."""

    __slots__ = ("box", "kind", "meta")

    def __init__(self, box: Any, kind: str, meta: Any) -> None:
        self.box, self.kind, self.meta = box, kind, meta

    def restore(self) -> Tensor:
        if self.kind == "g":
            return self.box.take(self.meta)
        tensors = _box_saved(self.box)
        if self.kind == "t":
            return tensors[0]
        if self.kind == "q":
            cls, spec, perm = self.meta
            return decompress(cls.rebuild(spec, tuple(tensors))).permute(inverse_order(perm))
        shape, perm = self.meta
        return unpack_mask(tensors[0], shape).permute(inverse_order(perm))


class CompressedStore:
    """The compress-once cache and the tier-3 hooks of one forward.

    ``qconfig``: the settings tier 3 compresses with. ``storages``: returns the storage
    addresses never to compress (the model's parameters and buffers) and whether some of them
    only appear during the forward; called when a large tensor that no zoo Function saved first
    needs the answer, so a model whose every large save is a zoo Function's never lists its
    parameters (the listing cost ~0.2 ms per forward on a 30-parameter CNN). ``min_numel``:
    smaller tensors are kept as they are (the bytes are negligible and per-row statistics such
    as a norm's rstd must stay exact). When some parameters only appear during the forward
    (FSDP2 all-gathers each layer's weights just before it runs), ``storages`` is called again
    before a tensor is treated as an activation.
    """

    def __init__(self, qconfig: LayerQConfig, storages: Callable[[], Tuple[Set[int], bool]],
                 min_numel: int, stats: Optional[CaptureStats] = None) -> None:
        self.qconfig = qconfig
        self.min_numel = min_numel
        self.stats = stats if stats is not None else CaptureStats()
        self._storages = storages
        self._skip: Optional[Set[int]] = None  # listed at the first need
        self._refresh = False
        self._kept: Dict[int, "weakref.ref[Tensor]"] = {}
        self._saving: Dict[int, Tensor] = {}  # the tensors keep() was just given, by id
        self._cache: Dict[tuple, Tuple["weakref.ref[Tensor]", Payload]] = {}
        # the cache key of the last plain payload made of each memory (any settings), for
        # derive(); and the dropout outputs derive() answers, by flat key
        self._latest: Dict[tuple, tuple] = {}
        self._derived: Dict[tuple, Tuple["weakref.ref[Tensor]", MaskedPayload]] = {}
        # ReLU-code sharing: ReLU outputs offered (mask saved, learning) and claimed (codes
        # wanted), by memory key; the probe of hooks_innermost
        self._offers: Dict[tuple, Tuple["weakref.ref[Tensor]", ZeroCodeSlot]] = {}
        self._claims: Dict[tuple, Tuple[ZeroCodeClaim, ZeroCodeSlot]] = {}
        self._probe_leaf: Optional[Tensor] = None  # what hooks_innermost's probe saves
        self._probing = False  # while it runs
        self._probe_seen = False
        # Outer hooks (set by the session before it enters its hooks): ``hooks`` is the
        # session's own saved_tensors_hooks context, left and re-entered around each box
        self.boxing = False
        self._plain = False  # set by keep(): its saves pass pack's first test (see there)
        self.hooks: Optional[Any] = None
        self._anchor: Optional[Tensor] = None
        self._boxes: Dict[int, Tuple["weakref.ref[Any]", Tensor]] = {}  # payload id -> box
        self._group: Optional[_Group] = None  # the box of keep()'s tensors, once one is packed
        self.after_no_grad = False  # set by the tier-2 mode (CaptureMode.__torch_function__)

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
        so a tensor compressed two ways is never answered with the other way's payload.
        A ReLU output claimed by :meth:`claim` is quantized as sparse codes (its mask plus the
        codes of its nonzeros, :func:`~actnn_zoo.quant.quantize_sparse`) and handed to the
        claim as well."""
        quantize_fn = quantize if quantize_fn is None else quantize_fn
        kw = {"rounding": rounding}
        if x.layout != torch.strided:
            return quantize_fn(x, bits, group_size, **kw)
        memory = _memory_key(x) if (self._claims or self._offers) and kind == "quant" else None
        claim = offer = None
        if memory is not None:
            claim = self._claims.pop(memory, None)
            offer = self._offers.pop(memory, None) if claim is None else None
            if (claim is not None or offer is not None) and inside_checkpoint():
                # a consumer inside a checkpointed segment: its recomputation saves plain
                # codes, so it must save them here too; the claim is left to a later save
                # (else finish() packs the mask) and the offer is declined
                if claim is not None:
                    self._claims[memory] = claim
                claim = offer = None
        if claim is not None:
            buffer = claim[0].mask_buffer()
            quantize_fn = _sparse if buffer is None else functools.partial(_sparse,
                                                                           mask_out=buffer)
        elif offer is not None and offer[0]() is not None:
            offer[1].enabled = True  # the next forwards share this output's codes
        if not isinstance(bits, int):
            q = quantize_fn(x, bits, group_size, **kw)  # per-sample: not shared
            if claim is not None:
                claim[0].fulfil(q)
            return q
        key = (memory if memory is not None else _memory_key(x)) + (bits, group_size, rounding,
                                                                     kind)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            self.stats.shared += 1
            return hit[1]
        q = quantize_fn(x, bits, group_size, **kw)
        if claim is not None:
            claim[0].fulfil(q)
        if owner is None:
            base = tensor_base(x)
            owner = base if base is not None else x
        # The entry goes when the owner does: the payload then lives exactly as long as the
        # saved objects autograd keeps, so nothing outlives its backward, also when one
        # store spans several micro-batches (``capturing`` around gradient accumulation).
        self._cache[key] = (weakref.ref(owner, functools.partial(_evict_cached, self._cache,
                                                                 self._latest, key)), q)
        if kind == "quant":
            self._latest[key[:6]] = key
        return q

    @_eager
    def derive(self, out: Tensor, x: Tensor, mask: Tensor, p: float) -> None:
        """A dropout made ``out = x * mask / (1 - p)`` (``mask``: its packed keep bits of
        ``x``, row-major; the scale rounded to ``out``'s dtype). When ``x`` was compressed
        in this forward with one width and no transform (a softmax's probabilities), a later
        tier-3 save of ``out`` is answered with that payload and the mask
        (:class:`~actnn_zoo.quant.tensor.MaskedPayload`): no bytes of its own, unbiased. Only
        for contiguous ``x`` and ``out`` of one dtype, unchanged since."""
        if not (x.is_contiguous() and out.is_contiguous() and x.dtype == out.dtype):
            return
        hit = self._cache.get(self._latest.get(_memory_key(x)))  # type: ignore[arg-type]
        q = hit[1] if hit is not None and hit[0]() is not None else None
        if not (isinstance(q, QuantizedTensor) and q.bits is not None
                and q.transform == "none" and q.shape == x.shape):
            return
        key = _flat_key(out)
        owner = tensor_base(out) if tensor_base(out) is not None else out
        self._derived[key] = (weakref.ref(owner, functools.partial(_evict, self._derived, key)),
                              MaskedPayload(q, mask, dropout_scale(out.dtype, p), out.shape))

    @_eager
    def offer(self, x: Tensor, slot: ZeroCodeSlot) -> None:
        """A ReLU saved a mask for ``x`` (its output): if a later save compresses ``x`` plainly
        in this forward, ``slot`` is enabled for the next ones."""
        if x.layout == torch.strided:
            owner = tensor_base(x) if tensor_base(x) is not None else x
            self._offers[_memory_key(x)] = (weakref.ref(owner), slot)

    @_eager
    def claim(self, out: Tensor, claim: ZeroCodeClaim, slot: ZeroCodeSlot) -> None:
        """A ReLU saved nothing for ``out``: the first plain compression of it answers
        ``claim`` (else :meth:`finish` packs the mask)."""
        claim.version = tensor_version(out)
        self._claims[_memory_key(out)] = (claim, slot)

    @_eager
    def hooks_innermost(self) -> bool:
        """Whether a tensor an op saves now reaches this store's hooks. Inside a non-reentrant
        ``torch.utils.checkpoint`` it does not (the checkpoint's hooks are innermost, and its
        recomputation in backward runs outside the session): a ReLU there keeps its mask, so
        the forward and its recomputation save alike. Read from autograd's hook stack
        (:data:`~actnn_zoo._session.hooks_top_is`: nothing saved, ~0.3 us); without the
        extension by saving :func:`save_probe` (whose caller runs it also outside sessions, so
        that a checkpoint counts the same saves in the forward and in its recomputation)."""
        top_is = _session.hooks_top_is
        if top_is is not None:
            return self.hooks is not None and top_is(self.hooks.pack_hook)
        self._probe_seen = False
        self._probing = True
        try:
            save_probe(self)
        finally:
            self._probing = False
        return self._probe_seen

    def probe_leaf(self) -> Tensor:
        """The 2-element leaf :func:`save_probe` saves (made once per store: a new leaf per
        ReLU call cost an allocation); :meth:`pack` knows it by identity."""
        if self._probe_leaf is None:
            self._probe_leaf = torch.zeros(2, requires_grad=True)
        return self._probe_leaf

    def finish(self) -> None:
        """End of the forward: claims no save answered fall back to masks and turn their
        slot off (the output went to something that does not compress it, e.g. a max-pool)."""
        for c, slot in self._claims.values():
            c.fall_back()
            slot.enabled = False
        self._claims.clear()
        self._offers.clear()

    @_eager
    def keep(self, *tensors: Tensor, counted: bool = True) -> None:
        """Mark tensors a zoo Function saves on purpose (a payload, exact statistics): tier 3
        passes them through. Counted here (``CaptureStats.passed``), so that their pack is one
        dict lookup (:meth:`pack`): a converted ResNet-50 saves ~800 of them per step.
        ``counted=False``: bytes counted elsewhere (a claiming ReLU's mask buffer, which the
        consumer's sparse codes hold and count)."""
        if counted:
            self._count_kept(tensors)
        # the saves that follow at once (ctx.save_for_backward): known by identity, so their
        # pack is one dict lookup (see pack). Held until the next keep(), so that an id freed
        # meanwhile (a Function that built no graph packs nothing) cannot be reused and match.
        self._saving = {id(t): t for t in tensors}
        # whether pack may pass them through at its first test (neither outer hooks nor an
        # observer changes between here and the saves that follow)
        self._plain = self.saves_pass_through()
        self._group = None

    @_eager
    def keep_own(self, *tensors: Tensor, counted: bool = True) -> Any:
        """:meth:`keep` for a compiled node's saves (``cpp_ext/qlayers.cpp``): the node's
        ``own_saves`` argument. Where :meth:`pack` would pass them through at its first test
        (no outer hooks, no observer), that is this store's pack hook, which the node then
        skips while it is innermost, saving them as plain saved variables (no pack or unpack
        call: ~1 us each); else None, and the saves take :meth:`keep`'s path."""
        if not self.boxing and current_observer() is None:  # saves_pass_through(), inlined
            if counted:
                self._count_kept(tensors)
            self._saving = _NOTHING  # type: ignore[assignment]  # pack never sees these
            # (a save of one of them elsewhere finds it in _kept)
            self._plain = True
            self._group = None
            return self.hooks.pack_hook if self.hooks is not None else None
        self.keep(*tensors, counted=counted)
        return None

    def _count_kept(self, tensors: Tuple[Tensor, ...]) -> None:
        """Count :meth:`keep`'s tensors in ``CaptureStats.passed``, and list the large float
        and bool ones among the tensors tier 3 passes through (``_kept``)."""
        n_small, b_small, n_big, b_big = _COUNT_SAVES(tensors, self.min_numel, self._kept)
        passed = self.stats.passed
        if n_small:
            entry = passed.get("small")
            if entry is None:
                entry = passed["small"] = [0, 0]
            entry[0] += n_small
            entry[1] += b_small
        if n_big:
            entry = passed.get(_KEPT_REASON)
            if entry is None:
                entry = passed[_KEPT_REASON] = [0, 0]
            entry[0] += n_big
            entry[1] += b_big

    def saves_pass_through(self) -> bool:
        """Whether a save :meth:`keep` was told of reaches autograd as the tensor itself: no
        outer hooks to box it for, no observer. A compiled node whose saved buffer is filled
        after the forward (a claiming ReLU's) needs that: a box or an observer may copy it."""
        return not self.boxing and current_observer() is None

    def _is_kept(self, ptr: int) -> bool:
        ref = self._kept.get(ptr)
        return ref is not None and ref() is not None

    # -- tier 3: saved-tensor hooks ----------------------------------------------------------
    def pack(self, t: Tensor) -> Any:
        # A zoo Function's save (keep() was just given it, and counted it) is kept as it is:
        # one lookup, no further call (every Q-layer call saves 3-8 tensors through here).
        saving = self._saving
        if saving and self._plain and not _is_compiling():  # (compiling: dynamo sees no id)
            key = id(t)
            if saving.get(key) is t:
                del saving[key]
                return t
        if self._probing and t is self._probe_leaf:  # hooks_innermost's probe
            self._probe_seen = True
            return t
        if _is_compiling():
            # traced by torch.compile: a compiled region inside this store's session (a
            # compiled submodule). Its saves stay as the graph makes them, as when the whole
            # model is compiled and no session opens (its Q-layers save their traced forms'
            # codes); at run time the compiled node's own saves come here eagerly. Traced, the
            # hook's host work broke the graph at every save.
            return t
        return self._pack_hook(t)

    def _pack_hook(self, t: Tensor) -> Any:
        # read before anything: the tier-2 mode sees this hook's own calls (under no_grad)
        # when the save is a custom Function's, and must not count them
        after_no_grad = self.after_no_grad
        try:
            if self.boxing:  # the outer hooks see everything: no observer needed
                saving = self._saving
                if saving and saving.get(id(t)) is t:
                    return self._boxed_kept(t)
                return self._boxed(self._pack(t, after_no_grad))
            saved = self._pack(t, after_no_grad)
        finally:
            self.after_no_grad = after_no_grad
        observer = current_observer()
        if observer is None:
            return saved
        kept = saved.tensors() if isinstance(saved, (_Compressed, _Mask)) else (saved,)
        return _Observed(saved, [observer(k) for k in kept])

    @staticmethod
    def unpack(saved: Any) -> Tensor:
        if isinstance(saved, Tensor):  # kept as it was saved
            return saved
        return _unpack(saved)

    def _boxed(self, saved: Any) -> _Boxed:
        """``saved`` handed to the outer hooks (see the module docstring). A payload several
        ops save is boxed once: every save of it reads the same box."""
        if isinstance(saved, _Compressed):
            q = saved.q
            hit = self._boxes.get(id(q))
            box = hit[1] if hit is not None and hit[0]() is q else None
            if box is None:
                box = self._box_now(q.tensors())
                key = id(q)
                self._boxes[key] = (weakref.ref(q, functools.partial(_evict, self._boxes, key)),
                                    box)
            return _Boxed(box, "q", (type(q), q.spec(), saved.perm))
        if isinstance(saved, _Mask):
            return _Boxed(self._box_now((saved.packed,)), "m", (saved.shape, saved.perm))
        return _Boxed(self._box_now((saved,)), "t", None)

    def _boxed_kept(self, t: Tensor) -> _Boxed:
        """A tensor the zoo Function that called :meth:`keep` saves: its whole save is boxed
        at its first tensor (see :class:`_Group`)."""
        group = self._group
        if group is None:
            members = list(self._saving.values())
            group = self._group = _Group(self._box_now(members),
                                         {id(m): i for i, m in enumerate(members)})
        del self._saving[id(t)]  # (counted by keep)
        group.uses += 1
        return _Boxed(group, "g", group.index[id(t)])

    def _box_now(self, tensors: Sequence[Tensor]) -> Tensor:
        """One :class:`_Box` call with the session's hooks off the stack (they are its top
        while this pack runs), so that the hooks below pack ``tensors``."""
        if self._anchor is None:
            self._anchor = torch.empty(0, requires_grad=True)
        hooks = self.hooks
        assert hooks is not None
        hooks.__exit__(None, None, None)
        try:
            return _box(self._anchor, tensors)
        finally:
            hooks.__enter__()

    def _pack(self, t: Tensor, after_no_grad: bool = False) -> Any:
        """What autograd keeps for ``t``. ``after_no_grad``: the tier-2 mode's last call ran
        under no_grad, i.e. ``t`` is saved by a custom autograd Function (see
        :class:`~actnn_zoo.capture.mode.CaptureMode`)."""
        saving = self._saving
        if saving and saving.get(id(t)) is t:  # saved by the zoo Function that called keep()
            del saving[id(t)]  # (counted by keep)
            return t
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
        if self._is_kept(ptr):
            stats._pass("saved by a zoo Function", t)
            return t
        if is_weight(t):
            stats._pass("parameter or buffer", t)
            return t
        if self._skip is None or (self._refresh and ptr not in self._skip):
            self._skip, self._refresh = self._storages()
        if ptr in self._skip:
            stats._pass("parameter or buffer", t)
            return t
        if t.dtype != torch.bool and t.dtype not in COMPRESSIBLE:
            stats._pass("float64" if t.dtype == torch.float64 else "integer", t)
            return t
        if after_no_grad or saved_by_checkpoint(_HOOK_FILES):
            # A custom Function's save (a re-entrant checkpoint's segment inputs, from which
            # its recomputation runs: compressed, the recomputation would run from other values
            # than the forward did), or the inputs torch's non-reentrant checkpoint saves
            stats._pass("checkpoint input", t)
            return t
        perm = dense_order(t)
        if perm is None:
            stats._pass("not dense (expanded or sliced)", t)
            return t
        if self._derived and t.dtype != torch.bool:
            derived = self._derived_for(t)
            if derived is not None:
                stats.derived += 1
                stats.derived_bytes += t.numel() * t.element_size()
                return _Compressed(derived, tuple(range(t.dim())))
        x = t.detach().permute(perm)
        if t.dtype == torch.bool:
            stats.compressed += 1
            stats.compressed_bytes += t.numel()
            return _Mask(pack_mask(x), x.shape, perm)
        before = stats.shared
        # DIVISION reads dims as (N, C, *spatial): only a tensor stored in that order qualifies
        fn, kind = _plain, "quant"
        if perm == tuple(range(t.dim())) and uses_division(x, self.qconfig.compressor):
            fn, kind = quantizer_for(x, self.qconfig)
        q = self.compress(x, self.qconfig.bits, self.qconfig.group_size, self.qconfig.rounding,
                          owner=tensor_base(t) if tensor_base(t) is not None else t, quantize_fn=fn,
                          kind=kind)
        if stats.shared == before:
            stats.compressed += 1
            stats.compressed_bytes += t.numel() * t.element_size()
        return _Compressed(q, perm)

    def _derived_for(self, t: Tensor) -> Optional[MaskedPayload]:
        """:meth:`derive`'s payload for ``t`` (a view of a dropout's output, unchanged since),
        when its source is at least as wide as tier 3's width; else None."""
        key = _flat_key(t)
        hit = self._derived.get(key) if key is not None else None
        if hit is None or hit[0]() is None:
            return None
        q = hit[1]
        bits = self.qconfig.bits
        if not isinstance(bits, int) or q.bits < bits:
            return None
        return q.as_view(t.shape)


@_eager
def _unpack(saved: Any) -> Tensor:
    """:meth:`CompressedStore.unpack` of what :meth:`~CompressedStore.pack` wrapped."""
    if isinstance(saved, _Observed):
        saved = saved.inner
    if isinstance(saved, (_Compressed, _Mask, _Boxed)):
        return saved.restore()
    return saved


def _evict(cache: Dict[tuple, Any], key: tuple, _ref: Any) -> None:
    """Weak-reference callback: the owner of a cached payload's memory is gone."""
    cache.pop(key, None)


def _evict_cached(cache: Dict[tuple, Any], latest: Dict[tuple, tuple], key: tuple,
                  _ref: Any) -> None:
    """:func:`_evict` for the compress-once cache, which also forgets ``key`` as its memory's
    latest payload."""
    cache.pop(key, None)
    if latest.get(key[:6]) == key:
        del latest[key[:6]]


# Autograd nodes that pass a tensor's values through unchanged or only cast or re-view them:
# a saved tensor reached from a Parameter through these alone is that weight.
_WEIGHT_PATH = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "TransposeBackward1",
    "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
    "ExpandBackward0", "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward2", "SliceBackward0", "SelectBackward0",
    "NarrowBackward0", "UnbindBackward0", "SplitBackward0", "SplitWithSizesBackward0"})


def is_weight(t: Tensor, depth: int = 8) -> bool:
    """Whether ``t`` is a weight rather than an activation: an ``nn.Parameter``, a view of one,
    or reached from one through casts and views alone (autocast's lower-precision copy of a
    weight: ``ToCopyBackward0`` -> ``AccumulateGrad`` of the Parameter). Decided by what the
    tensor is, not whose storage it shares, so a weight outside the converted model (a head
    used inside ``capturing``) and a weight cast by autocast are kept exact like the model's
    own. Not recognised: a cast of a frozen Parameter (no autograd history; stated in
    docs/design.md)."""
    if isinstance(t, torch.nn.Parameter):
        return True
    base = tensor_base(t)
    if base is not None and isinstance(base, torch.nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(depth):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return isinstance(fn.variable, torch.nn.Parameter)
        if name not in _WEIGHT_PATH or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


def _plain(x: Tensor, bits: Bits, group_size: int, rounding: str) -> QuantizedTensor:
    return quantize(x, bits, group_size, rounding=rounding)
