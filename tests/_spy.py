"""CompressionSpy: every tensor the Q-layers' Functions compress, for tests of bit budgets."""
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
