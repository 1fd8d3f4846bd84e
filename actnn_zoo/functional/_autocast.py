"""Turning autocast off inside an autograd Function, one copy for every layer.

Why: a Function picks its compute dtypes in forward (as torch's autocast would have) and its
backward must run in exactly those, so forward's explicit math and every backward run with
autocast disabled. Entering ``torch.autocast(..., enabled=False)`` is not free (it costs more
than the rest of a small layer's backward glue together), so it is entered only where autocast
is on. Device types that autocast does not know (``meta``, custom backends) have nothing to
turn off.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Union

import torch
from torch import Tensor

__all__ = ["autocast_enabled", "autocast_on", "no_autocast"]

Where = Union[str, torch.device, Tensor]


def _device_type(where: Where) -> str:
    if isinstance(where, Tensor):
        return where.device.type
    if isinstance(where, torch.device):
        return where.type
    return where


def autocast_enabled(where: Where) -> bool:
    """Whether autocast is on for the device type of ``where`` (a device type such as
    ``"cuda"``, a ``torch.device`` or a tensor); False for device types autocast does not know.

    >>> autocast_enabled("cpu")
    False
    """
    try:
        return torch.is_autocast_enabled(_device_type(where))
    except RuntimeError:  # "unknown device type for autocast" (meta, custom backends)
        return False


def autocast_on(x: Tensor) -> bool:
    """:func:`autocast_enabled` for a tensor, for the per-call checks of the layers: on the CPU
    ``x.is_cpu`` and a literal device type cost ~0.7 us where ``x.device.type`` and the query
    cost ~1.6 (``x.device`` makes a new object every time).

    >>> autocast_on(torch.zeros(1))
    False
    """
    return torch.is_autocast_enabled("cpu") if x.is_cpu else autocast_enabled(x.device.type)


def no_autocast(where: Where) -> ContextManager[None]:
    """``torch.autocast(device_type, enabled=False)`` where autocast is on for the device type
    of ``where``, else a no-op context.

    >>> with no_autocast("cpu"):
    ...     pass
    """
    if autocast_enabled(where):
        return torch.autocast(_device_type(where), enabled=False)
    return contextlib.nullcontext()
