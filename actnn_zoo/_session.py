"""The capture session as the zoo's Functions see it: how to find it, and the ReLU claim/offer.

This module sits below :mod:`actnn_zoo.functional` and above :mod:`actnn_zoo.quant`, so that
the layers point one way (``tests/test_layering.py``): the Functions look the open session up
here, and :mod:`actnn_zoo.capture` implements it (the store, the hooks, opening and closing)
and imports only downward. Nothing here compresses or routes anything.

**Finding the session.** A converted root module opens one
:class:`~actnn_zoo.capture.CaptureSession` when its training forward starts and closes it when
the forward ends (also when it raises). While it is open, a :class:`contextvars.ContextVar`
points at it: that is how the zoo's autograd Functions reach the one store
(``functional/_saving.compress``) and how a converted model nested inside another converted
model knows not to open a second session. Like torch's own autocast and mode stacks the
variable is scoped (set on entry, reset on exit, per thread / task), so no setting outlives the
forward and two models never share anything; what survives is only what autograd keeps.

**The claim/offer interface.** A ReLU whose consumer compresses its output anyway reads its
backward from the consumer's sparse codes instead of saving a mask (docs/design.md, "ReLU reads
its consumer's codes"). The ReLU side -- :class:`ZeroCodeSlot`, :class:`ZeroCodeClaim`,
:func:`save_probe` -- lives here; the store side (:class:`ClaimStore`: ``claim``, ``offer``, the
probe) is :class:`actnn_zoo.capture.store.CompressedStore`.
"""
from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from ._torch_private import tensor_version
from .quant import pack_mask
from .quant.backend import extension
from .quant.tensor import SparseQuantizedTensor

__all__ = ["active_session", "current_observer", "observing", "ClaimStore", "ZeroCodeSlot",
           "ZeroCodeClaim", "hooks_top_is", "save_probe", "dense_order", "storage_ptr"]

_ACTIVE: "contextvars.ContextVar[Optional[Any]]" = contextvars.ContextVar(
    "actnn_zoo_capture_session", default=None)
# A callable that saved_activation_bytes installs while it measures: the capture hooks hand it
# every tensor they keep (payloads and pass-throughs), because saved-tensor hooks do not chain
# and the capture hooks, being innermost, would otherwise hide everything from the measurement.
_OBSERVER: "contextvars.ContextVar[Optional[Callable[[Any], Any]]]" = contextvars.ContextVar(
    "actnn_zoo_capture_observer", default=None)


# The two lookups below run for every Q-layer call and every save a Q-layer makes: bound
# ContextVar.get methods, so each is one builtin call, not a Python frame and then the call.
active_session: Callable[[], Optional[Any]] = _ACTIVE.get
"""The open :class:`~actnn_zoo.capture.CaptureSession` of this thread, or None."""

current_observer: Callable[[], Optional[Callable[[Any], Any]]] = _OBSERVER.get
"""The callable :class:`observing` installed in this context, or None."""


class observing:
    """``with observing(fn):`` -- capture hooks pass each kept tensor to ``fn`` and keep what it
    returns alive with their own saved object (used by :mod:`actnn_zoo.memory`)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self._token: Optional[contextvars.Token] = None

    def __enter__(self) -> "observing":
        self._token = _OBSERVER.set(self.fn)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _OBSERVER.reset(self._token)
        self._token = None


def _enter(session: Any) -> contextvars.Token:
    return _ACTIVE.set(session)


def _leave(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


# -- the ReLU claim/offer interface ---------------------------------------------------------
class ClaimStore(Protocol):
    """What a ReLU's :class:`ZeroCodeSlot` and :func:`save_probe` need of the capture store
    (implemented by :class:`actnn_zoo.capture.store.CompressedStore`): stated here so that this
    module names no class of the layer above it."""

    def probe_leaf(self) -> Tensor:
        """The leaf :func:`save_probe` saves for this store (one per store), which its pack
        hook knows while the probe runs."""

    def claim(self, out: Tensor, claim: "ZeroCodeClaim", slot: "ZeroCodeSlot") -> None:
        """The first plain compression of ``out`` in this forward answers ``claim``."""

    def offer(self, x: Tensor, slot: "ZeroCodeSlot") -> None:
        """A later plain compression of ``x`` in this forward enables ``slot``."""


class ZeroCodeSlot:
    """What a ReLU module learned about the consumer of its output: whether it compresses it.

    ReLU's mask (1 bit per value) is redundant when the next layer compresses the same output
    anyway (a conv, a linear): stored as sparse codes (``quantize_sparse``: the mask plus codes
    of the nonzeros), the consumer's payload holds exactly ReLU's mask, so ReLU reads its
    backward from it and saves nothing of its own (docs/design.md, "ReLU reads its consumer's
    codes"). CPU only: sparse codes have no CUDA kernels yet, so ReLUs elsewhere keep masks.
    A forward in which the output was compressed plainly by a later save turns this on
    for the next forwards; one in which nothing compressed it (the consumer is a max-pool, or
    compresses with DIVISION or a rotation) turns it off.
    """

    __slots__ = ("enabled", "probed", "_local")

    def __init__(self) -> None:
        self.enabled = False
        self.probed = False  # ran in a capture session (see CompressedStore.hooks_innermost)
        # ``waiting`` is per thread: two threads running one model (a replica sharing this
        # slot) must not register each other's claims
        self._local = threading.local()

    @property
    def waiting(self) -> Optional[Tuple[str, Optional["ZeroCodeClaim"]]]:
        """Set by the ReLU Function, registered with the store by its caller once the output
        is final (an in-place ReLU's output gets its version bump when the Function returns);
        this thread's only."""
        return getattr(self._local, "waiting", None)

    @waiting.setter
    def waiting(self, value: Optional[Tuple[str, Optional["ZeroCodeClaim"]]]) -> None:
        self._local.waiting = value

    def __getstate__(self) -> Tuple[bool, bool]:  # deepcopy / pickle: what was learned
        return self.enabled, self.probed

    def __setstate__(self, state: Tuple[bool, bool]) -> None:
        self.enabled, self.probed = state
        self._local = threading.local()

    def register(self, out: Tensor, store: ClaimStore) -> None:
        waiting, self.waiting = self.waiting, None
        if waiting is None:
            return
        kind, claim = waiting
        if kind == "claim" and claim is not None:
            store.claim(out, claim, self)
        else:
            store.offer(out, self)


class ZeroCodeClaim:
    """A ReLU's claim on the compressed copy of its output, kept on its autograd ctx.

    The first save that compresses the output plainly in this forward quantizes it as sparse
    codes at its own widths and hands the payload here. If none does by the end of the
    forward, the output (kept alive meanwhile) is packed into ReLU's 1-bit mask instead, in
    memory order.
    """

    __slots__ = ("out", "version", "sparse_mask", "mask")

    def __init__(self, out: Tensor) -> None:
        self.out: Optional[Tensor] = out
        self.version = -1  # set when the store registers it
        # the sparse codes' packed mask, in logical order: ReLU's backward reads only that.
        # Not the payload: a claim lives on the autograd ctx until the graph is freed (in a
        # training loop, after the next step's forward), and the codes would live with it
        # after the consumer's backward (1.6 MiB per step on ResNet-50 at batch 8, 64x64).
        self.sparse_mask: Optional[Tensor] = None
        self.mask: Optional[Tuple[Tensor, torch.Size, Tuple[int, ...]]] = None

    def mask_buffer(self) -> Optional[Tensor]:
        """Where the consumer's sparse codes must write their mask (None: anywhere; a compiled
        ReLU node's claim answers its saved buffer)."""
        return None

    def fulfil(self, q: SparseQuantizedTensor) -> None:
        self.sparse_mask, self.out = q.mask, None

    def fall_back(self) -> None:
        """The mask from the output (threshold_backward's predicate: not ``<= 0``); an output
        changed in place since ReLU leaves neither, and backward then raises."""
        out, self.out = self.out, None
        if out is None or tensor_version(out) != self.version:
            return
        perm = dense_order(out)
        if perm is None:
            out, perm = out.contiguous(), tuple(range(out.dim()))
        m = ~(out.detach().permute(perm) <= 0)
        self.mask = (pack_mask(m), m.shape, perm)


# Whether a given pack hook is this thread's innermost saved-tensor hook, read from autograd's
# hook stack by the extension (cpp_ext/stacks.cpp), nothing saved; None without the extension.
# Only then does CompressedStore.hooks_innermost save a probe (save_probe), and a probed ReLU
# outside a session (a checkpoint's recomputation) save one too, so that both count alike.
hooks_top_is: Optional[Callable[[Any], bool]] = getattr(extension(), "saved_hooks_top_is",
                                                        None)


def save_probe(store: Optional[ClaimStore] = None) -> None:
    """One tiny op that saves one tensor (``sin`` saves its 2-element input); ``store``: the
    store's own probe leaf, so that its pack hook can tell whether it saw it. Used where
    :data:`hooks_top_is` is None."""
    probe = torch.zeros(2, requires_grad=True) if store is None else store.probe_leaf()
    if torch.is_grad_enabled():
        probe.sin()
    else:
        with torch.enable_grad():
            probe.sin()


def dense_order(t: Tensor) -> Optional[Tuple[int, ...]]:
    """A permutation ``p`` with ``t.permute(p)`` contiguous (identity for a contiguous tensor),
    or None when ``t`` has gaps or overlaps (expanded, sliced): such a tensor is not copied."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    p = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return p if t.permute(p).is_contiguous() else None


def inverse_order(p: Sequence[int]) -> Tuple[int, ...]:
    """The permutation that undoes ``p`` (``t.permute(p).permute(inverse_order(p))`` is ``t``),
    to lay out again what was stored in :func:`dense_order`."""
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


def storage_ptr(t: Tensor) -> int:
    """The address of the storage ``t`` views (the store's keys and the probe's mark)."""
    return t.untyped_storage().data_ptr()
