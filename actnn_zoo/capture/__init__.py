"""Capture everything a converted model's training forward saves (tiers 2 and 3, one store).

Tier 1 is the Q-layers themselves (:mod:`actnn_zoo.nn`). ``convert_model`` attaches a
:class:`Capture` to the converted root: during each training forward it routes functional calls
to the zoo's autograd Functions (tier 2, :mod:`.handlers`) and compresses every other tensor an
op saves (tier 3, :mod:`.store`), compressing each tensor once however many ops save it. See
docs/design.md, "Capture everything a model saves".
"""
from .._session import active_session, observing
from .attach import (CAPTURE_ATTR, MIN_NUMEL, Capture, CaptureSession, attach_capture,
                     capture_report, capturing, checkpoint_context, detach_capture)
from .handlers import HANDLERS
from .store import CaptureStats, CompressedStore
from .tail import CapturedOutput

__all__ = ["Capture", "CaptureSession", "CaptureStats", "CapturedOutput", "CompressedStore",
           "HANDLERS",
           "attach_capture", "detach_capture", "capture_report", "capturing", "checkpoint_context",
           "active_session", "observing",
           "CAPTURE_ATTR", "MIN_NUMEL"]
