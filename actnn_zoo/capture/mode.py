"""Tier 2's ``TorchFunctionMode``: routes functional calls of a training forward to handlers.

Public API only (``torch.overrides.TorchFunctionMode``). While the mode runs a handler, torch
takes the mode off the stack, so the torch calls a handler (or a Function's forward) makes are
not routed again; inside any autograd Function's forward grad mode is off and the mode passes
every call through, so the zoo's Q-layers and other custom Functions are never routed twice.
Unlisted calls cost one dict lookup.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .handlers import Handler

__all__ = ["CaptureMode"]


class CaptureMode(TorchFunctionMode):
    def __init__(self, session: Any, table: Mapping[Callable, Handler]) -> None:
        super().__init__()
        self.session = session
        self.table = table

    def __torch_function__(self, func: Callable, types: Tuple, args: Tuple = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        handler = self.table.get(func)
        if handler is None or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        return handler(self.session, func, args, kwargs)
