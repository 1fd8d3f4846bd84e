"""The one place a precision strategy moves numbers from the device to the host.

Per-layer budgets must be host numbers: they size the compressed buffers (see
:class:`actnn_zoo.quant.SampleBits`). They are computed on the device at a re-allocation step
and used from the next training step on, so the copy never has to be waited for: it is queued
behind the solver on the current stream, and a whole forward and backward later it is done.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["DeferredRead"]


class DeferredRead:
    """The values of a small tensor, copied to the host now and read later.

    On CUDA: a pinned host buffer, a non-blocking copy and an event; :meth:`read` waits on that
    event only, not on the device. On CPU the values are already on the host. Other devices get
    a plain copy (which may wait).
    """

    def __init__(self, values: Tensor) -> None:
        v = values.detach()
        self._event: Optional[torch.cuda.Event] = None
        if v.device.type == "cuda":
            self._host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            self._host.copy_(v, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(v.device))
        else:
            try:
                self._host = v.to("cpu", copy=True)
            except NotImplementedError as e:  # the meta device: no values to read
                raise RuntimeError(
                    f"actnn_zoo: a precision strategy re-allocates from a step's values, which "
                    f"tensors on {v.device} do not have; convert with strategy='uniform' for a "
                    f"run without values") from e

    def read(self) -> List[float]:
        """The values as Python floats (waits for the copy, not for later device work)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
