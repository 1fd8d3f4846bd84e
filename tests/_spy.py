"""CompressionSpy: every tensor the Q-layers' Functions compress, for tests of bit budgets.
OwnSavesSpy: which of a compiled node's saves reach the capture store's pack hook."""
from __future__ import annotations

from typing import List, Tuple

import torch

from actnn_zoo.capture import store
from actnn_zoo.functional import _saving
from actnn_zoo.functional import norm as fnorm
from actnn_zoo.quant import QuantizedTensor


class CompressionSpy:
    """Records (values, bits the widths give them, payload) of every tensor compressed through
    ``_saving.quantize`` and ``_saving.quantize_saved`` (the layers' own entry),
    ``_saving.quantize_normalized`` (batch norm's normalized input on the CPU), the norms'
    fused CPU forwards (``functional.norm._BN_FORWARD``, ``_LN_FORWARD``, ``_GN_FORWARD``) and,
    with ``sparse=True``, the capture store's sparse codes (a ReLU output shared with its
    consumer: codes for the nonzeros only, at the same row widths, so every value counts at its
    row's width)."""

    def __init__(self, monkeypatch, sparse: bool = False) -> None:
        self.calls: List[Tuple[int, float, object]] = []

        def spying(real):
            def spy(*args, **kwargs):
                q = real(*args, **kwargs)
                rows = max(q.shape[0], 1) if len(q.shape) > 1 else 1
                per_row = q.numel() // rows if q.numel() else 0
                used = (float(q.row_bits.double().sum()) * per_row if q.mixed
                        else float(q.bits) * q.numel())
                self.calls.append((q.numel(), used, q))
                return q
            return spy

        monkeypatch.setattr(_saving, "quantize", spying(_saving.quantize))
        monkeypatch.setattr(_saving, "quantize_saved", spying(_saving.quantize_saved))
        monkeypatch.setattr(_saving, "quantize_normalized", spying(_saving.quantize_normalized))
        if sparse:
            monkeypatch.setattr(store, "quantize_sparse", spying(store.quantize_sparse))

        def spying_norm(real, bits_at: int):
            # the norms' fused CPU forward (functional/norm.py): one width, codes of x's shape
            def spy(*args):
                result = real(*args)
                x, bits = args[0], args[bits_at]
                q = QuantizedTensor(*result[3:6], x.shape, torch.float32, bits, args[bits_at + 1])
                self.calls.append((x.numel(), float(bits) * x.numel(), q))
                return result
            return spy

        for name, bits_at in (("_BN_FORWARD", 7), ("_LN_FORWARD", 5), ("_GN_FORWARD", 5)):
            real = getattr(fnorm, name)
            if real is not None:
                monkeypatch.setattr(fnorm, name, spying_norm(real, bits_at))

    def take(self) -> List[Tuple[int, float, object]]:
        """The calls recorded since the last take."""
        out, self.calls = self.calls, []
        return out

    def take_average(self) -> float:
        """Bits per value over the calls since the last take."""
        calls = self.take()
        return sum(c[1] for c in calls) / sum(c[0] for c in calls)


class OwnSavesSpy:
    """The tensors compiled nodes hand to ``CompressedStore.keep_own`` (:attr:`own`) and every
    tensor the store's pack hook receives (:attr:`packed`). :meth:`take` sets the path:
    ``"skipped"`` (keep_own as it is: the nodes skip the store's hooks where they may) or
    ``"hooks"`` (keep_own answering None, so every save goes through the hooks)."""

    def __init__(self, monkeypatch) -> None:
        self.own: List[torch.Tensor] = []
        self.packed: List[torch.Tensor] = []
        self._monkeypatch = monkeypatch
        Store = store.CompressedStore
        real_keep_own, real_pack = Store.keep_own, Store.pack

        def keep_own(s, *tensors, counted=True):
            self.own += tensors
            return real_keep_own(s, *tensors, counted=counted)

        def hooks_path(s, *tensors, counted=True):
            self.own += tensors
            s.keep(*tensors, counted=counted)
            return None

        def pack(s, t):
            self.packed.append(t)
            return real_pack(s, t)

        self._paths = {"skipped": keep_own, "hooks": hooks_path}
        monkeypatch.setattr(Store, "pack", pack)

    def take(self, path: str) -> None:
        self._monkeypatch.setattr(store.CompressedStore, "keep_own", self._paths[path])

    def reset(self) -> None:
        self.own, self.packed = [], []

    def own_packed(self) -> int:
        """How many of :attr:`own` the pack hook received."""
        packed = {id(t) for t in self.packed}
        return sum(id(t) in packed for t in self.own)
