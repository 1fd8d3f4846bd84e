"""Opening and closing the capture session around a converted model's training forward.

``convert_model`` attaches a :class:`Capture` to the root it returns. Its forward pre-hook
opens a :class:`CaptureSession` (the tier-2 mode, the tier-3 saved-tensor hooks and the one
store) when the root runs a training forward with grad enabled and no session is open yet in
this thread; its forward hook (``always_call=True``) closes it, also when forward raises. A
converted model inside another converted model therefore does not stack a second session, and
nothing stays active after the forward.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from typing import Any, Callable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from .. import _session as S
from .._session import ZeroCodeSlot
from ..config import LayerQConfig, QuantConfig
from ..quant.seeds import seed_stream
from .handlers import HANDLERS
from .mode import CaptureMode, in_routed_segment, routed_segment
from .._torch_private import inside_checkpoint
from .store import CaptureStats, CompressedStore, outer_hooks_present
from .tail import TailRouting, plain_inputs, wrap_outputs

__all__ = ["Capture", "CaptureSession", "attach_capture", "detach_capture", "capture_report",
           "capturing", "checkpoint_context", "CAPTURE_ATTR", "MIN_NUMEL"]

CAPTURE_ATTR = "actnn_zoo_capture"
# Saved tensors with fewer values stay as they are: their bytes are negligible next to the
# activations, and per-row statistics of norms must stay exact.
MIN_NUMEL = 4096


def parameter_storages(root: nn.Module) -> Tuple[Set[int], bool]:
    """The storage addresses of ``root``'s parameters and buffers (tier 3 never compresses
    them), and whether some are wrapper tensor subclasses without storage of their own (the
    DTensor shards of ``torch.distributed.fsdp.fully_shard``)."""
    ptrs: Set[int] = set()
    wrapped = False
    for t in itertools.chain(root.parameters(), root.buffers()):
        if type(t) not in (torch.Tensor, nn.Parameter):  # nn.Parameter(DTensor) is a DTensor
            wrapped = True  # its untyped_storage() raises "invalid python storage"
        elif t.layout == torch.strided:
            ptrs.add(t.untyped_storage().data_ptr())
    return ptrs, wrapped


class CaptureSession:
    """Tier 2 and tier 3 for one forward: entered by :class:`Capture`'s pre-hook."""

    def __init__(self, root: nn.Module, qconfig: LayerQConfig, min_numel: int,
                 relu_slots: Optional[List[ZeroCodeSlot]] = None) -> None:
        self.qconfig = qconfig
        self._relu_slots = relu_slots
        self._relu_calls = 0
        self.stats = CaptureStats()
        # listed when first needed; under FSDP2 (sharded DTensor parameters) the plain,
        # unsharded parameters the layers use exist only while each layer runs, so the store
        # lists them again when a save misses (parameter_storages says when)
        self.store = CompressedStore(qconfig, lambda: parameter_storages(root), min_numel,
                                     self.stats)
        self._mode = CaptureMode(self, HANDLERS)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.store.pack,
                                                                self.store.unpack)
        self.store.hooks = self._hooks
        self._seeds = seed_stream()
        self._token: Optional[contextvars.Token] = None

    def relu_slot(self, x: torch.Tensor) -> Optional[ZeroCodeSlot]:
        """The slot of this forward's next routed ``relu`` call (the k-th call of a forward
        gets the k-th slot of the model, what a QReLU module keeps for itself), or None where
        ReLU codes do not apply: ``relu_codes`` off, not on the CPU, inside a checkpointed
        segment (its recomputation would not have the slot; the mode routes there only under
        ``checkpoint_context``). A model whose calls change order between forwards only loses
        sharing: an unanswered claim falls back to the mask."""
        if self._relu_slots is None or not self.qconfig.relu_codes or not x.is_cpu \
                or in_routed_segment():
            return None
        k, self._relu_calls = self._relu_calls, self._relu_calls + 1
        while len(self._relu_slots) <= k:
            self._relu_slots.append(ZeroCodeSlot())
        return self._relu_slots[k]

    def open(self) -> None:
        # The user's saved-tensor hooks around the model (save_on_cpu, offloading, counting)
        # receive what the store keeps. Not a checkpoint's: inside a segment run whole (the
        # converted root checkpointed from outside) the capture hooks keep the saves, as before.
        self.store.boxing = not inside_checkpoint() and outer_hooks_present()
        self._token = S._enter(self)
        try:
            self._seeds.__enter__()  # the forward's seeds: one generator read, then a counter
            try:
                self._mode.__enter__()
                try:
                    self._hooks.__enter__()
                except BaseException:
                    self._mode.__exit__(None, None, None)
                    raise
            except BaseException:
                self._seeds.__exit__(None, None, None)
                raise
        except BaseException:
            S._leave(self._token)
            raise

    def close(self) -> None:
        self.store.finish()
        try:
            self._hooks.__exit__(None, None, None)
        finally:
            try:
                self._mode.__exit__(None, None, None)
            finally:
                try:
                    self._seeds.__exit__(None, None, None)
                finally:
                    S._leave(self._token)
                    self._drop_cycles()

    def _drop_cycles(self) -> None:
        """Drop the references the forward needed that make cycles (session <-> mode, store
        <-> its hooks' bound methods): the backward's unpacks keep only the store, and the
        session and store are freed by reference counting when autograd drops them, not left
        to the cyclic collector (~65 objects a GPT-2 step, and a collection about every step).
        A session is opened once."""
        self.store.hooks = None
        self._mode.session = None


class Capture:
    """What ``convert_model`` attaches to the converted root (``root.actnn_zoo_capture``).

    ``last_stats`` describes the last captured forward (see :func:`capture_report`).
    """

    def __init__(self, qconfig: LayerQConfig, min_numel: int = MIN_NUMEL) -> None:
        self.qconfig = qconfig
        self.min_numel = min_numel
        self.last_stats: Optional[CaptureStats] = None
        self.relu_slots: List[ZeroCodeSlot] = []  # routed relu calls, by order in a forward
        # the sessions this root opened, per thread: threads running one model (or replicas
        # sharing this object, as nn.DataParallel's do) each pair their own pre and post hooks
        self._local = threading.local()
        self._handles: List[Any] = []

    def _stack(self) -> List[Optional[CaptureSession]]:
        stack = getattr(self._local, "open", None)
        if stack is None:
            stack = self._local.open = []
        return stack

    def _pre(self, module: nn.Module, args: Any) -> Any:
        plain = plain_inputs(args)  # another converted model's output: an ordinary tensor here
        self._open(module)
        return plain

    def _open(self, module: nn.Module) -> None:
        if torch.compiler.is_compiling():
            # Traced by torch.compile: the layers save through their traced forms (and under
            # actnn_zoo.compile the graph compresses the other saves); a session is host work
            # that would break the graph.
            return
        if not (module.training and torch.is_grad_enabled()) or S.active_session() is not None:
            self._stack().append(None)  # nothing to open: eval, no_grad, or an outer session
            return
        session = CaptureSession(module, self.qconfig, self.min_numel, self.relu_slots)
        session.open()
        self._stack().append(session)

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        if not stack:
            return  # the pre-hook did not run (a hook of another library raised before it)
        session = stack.pop()
        if session is not None:
            session.close()
            self.last_stats = session.stats
            if output is not None:
                # the loss written after forward is routed too (capture/tail.py)
                return wrap_outputs(output, TailRouting(self.qconfig, session.stats))
        return None

    def attach(self, root: nn.Module) -> None:
        self._handles = [root.register_forward_pre_hook(self._pre),
                         root.register_forward_hook(self._post, always_call=True)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __getstate__(self) -> dict:  # copy.deepcopy / pickle: no open sessions travel
        state = dict(self.__dict__)
        del state["_local"]
        state["relu_slots"] = []  # learned again by the copy
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


class _Routing:
    """What a handler reads of a session (its settings and counters): a checkpoint's
    recomputation routes with it, outside any session, so it has no store of its own."""

    def __init__(self, qconfig: LayerQConfig) -> None:
        self.qconfig = qconfig
        self.stats = CaptureStats()

    def relu_slot(self, x: torch.Tensor) -> None:
        """No ReLU codes in a recomputation: the forward's slots belong to its session."""
        return None


def checkpoint_context(model: nn.Module) -> Callable[[], Tuple[Any, Any]]:
    """``context_fn`` for ``torch.utils.checkpoint(fn, ..., use_reentrant=False,
    context_fn=checkpoint_context(model))`` inside a converted model's forward: tier 2 routes
    the segment's functional calls in its forward and in its recomputation alike.

    Not needed for correctness: without it tier 2 leaves a checkpointed segment's calls alone
    (a segment keeps nothing of its forward, and its recomputation runs after the session
    closed). With it the tensors the recomputation saves during backward are compressed too.
    """
    capture = vars(model).get(CAPTURE_ATTR)
    if not isinstance(capture, Capture):
        raise ValueError(f"checkpoint_context: {type(model).__name__} was not converted with "
                         "capture on (convert_model(..., capture=True) on the root)")
    qconfig = capture.qconfig

    def context_fn() -> Tuple[Any, Any]:
        return routed_segment(), CaptureMode(_Routing(qconfig), HANDLERS, in_segments=True)
    return context_fn


def attach_capture(root: nn.Module, cfg: QuantConfig) -> None:
    """Attach tiers 2 and 3 to a converted root (any earlier capture is detached first)."""
    detach_capture(root)
    if not cfg.capture or not cfg.enabled:
        return
    bits = cfg.layer_bits() if cfg.capture_bits is None else cfg.capture_bits
    qconfig = LayerQConfig(bits=bits, group_size=cfg.group_size, rounding=cfg.rounding,
                           backward_chunks=cfg.backward_chunks, compressor=cfg.compressor,
                           division_block=cfg.division_block, relu_codes=cfg.relu_codes)
    capture = Capture(qconfig)
    capture.attach(root)
    setattr(root, CAPTURE_ATTR, capture)


def detach_capture(root: nn.Module) -> None:
    capture = vars(root).get(CAPTURE_ATTR)
    if isinstance(capture, Capture):
        capture.detach()
    if CAPTURE_ATTR in vars(root):
        delattr(root, CAPTURE_ATTR)


def capture_report(model: nn.Module) -> Optional[CaptureStats]:
    """What tiers 2 and 3 did in ``model``'s last training forward (None before the first, or
    when the model was converted with ``capture: false``).

    Shows which functional calls were routed to compressed Functions, how many saved tensors
    were compressed, and which stayed full precision and why: where to look when a model
    with functional layers or a custom attention saves more than expected."""
    capture = vars(model).get(CAPTURE_ATTR)
    return capture.last_stats if isinstance(capture, Capture) else None


@contextlib.contextmanager
def capturing(model: nn.Module) -> Iterator[Optional[CaptureStats]]:
    """Keep ``model``'s capture session open over a whole block, e.g. forward plus loss::

        with az.capturing(model):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()

    The automatic session covers only ``model.forward``. Of what runs after it, the loss
    family (``cross_entropy``, ``softmax``, ``log_softmax``) called on the model's output is
    routed without this block (the output is a ``CapturedOutput``, :mod:`.tail`); anything
    else (another loss formula, products with the output) is captured only inside it.
    Yields the session's statistics (None when nothing is captured: eval mode, ``no_grad``, or
    a session already open in this thread, which then covers the block).
    """
    capture = vars(model).get(CAPTURE_ATTR)
    if not isinstance(capture, Capture):
        raise ValueError("capturing(model): the model was not converted by "
                         "actnn_zoo.convert_model with capture enabled")
    if S.active_session() is not None or not (model.training and torch.is_grad_enabled()):
        yield None
        return
    session = CaptureSession(model, capture.qconfig, capture.min_numel, capture.relu_slots)
    session.open()
    try:
        yield session.stats
    finally:
        session.close()
        capture.last_stats = session.stats
