"""Where the seeds of stochastic rounding come from.

Every compressed tensor needs a seed. Read from torch's CPU generator, each costs a tensor op and
a read (~2-3 us of host time; no device wait, since the generator lives on the host). Inside a
capture session (one training forward) the seeds come from a :class:`SeedStream` instead: one
generator read when the session opens, then a counter mixed by murmur3's finalizer, as torch's
own dropout advances a Philox offset rather than drawing a seed per call. ``torch.manual_seed``
still makes runs reproducible: the stream's key is the one draw.
"""
from __future__ import annotations

import contextvars
from typing import Optional

import torch

from .hash32 import fmix32_int

__all__ = ["SeedStream", "draw_seed", "seed_stream"]

_STREAM: "contextvars.ContextVar[Optional[SeedStream]]" = contextvars.ContextVar(
    "actnn_zoo_seed_stream", default=None)


class SeedStream:
    """Distinct 31-bit seeds from one generator draw: ``fmix32(key ^ fmix32(k))`` for the k-th
    seed (fmix32 is a bijection of 32-bit values, so the seeds of one stream differ before the
    top bit is dropped)."""

    __slots__ = ("key", "count")

    def __init__(self) -> None:
        self.key = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
        self.count = 0

    def next(self) -> int:
        self.count += 1
        return fmix32_int(self.key ^ fmix32_int(self.count)) & 0x7FFFFFFF


def draw_seed() -> int:
    """A 31-bit seed: the open :class:`SeedStream`'s next, else a draw from torch's default
    (CPU) generator. Neither synchronises a device."""
    stream = _STREAM.get()
    if stream is not None:
        return stream.next()
    return int(torch.randint(0, 2 ** 31 - 1, (1,)).item())


class seed_stream:
    """``with seed_stream():`` -- :func:`draw_seed` answers from one new stream (scoped like the
    capture session that opens it: per thread, reset on exit)."""

    __slots__ = ("_token",)

    def __enter__(self) -> SeedStream:
        stream = SeedStream()
        self._token = _STREAM.set(stream)
        return stream

    def __exit__(self, *exc: object) -> None:
        _STREAM.reset(self._token)
