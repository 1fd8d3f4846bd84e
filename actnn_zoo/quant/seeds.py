"""Where the seeds of stochastic rounding come from.

Every compressed tensor needs a seed. Inside a capture session (one training forward) the seeds
come from a :class:`SeedStream`: one read of torch's CPU generator when the session opens, then a
counter mixed by murmur3's finalizer, as torch's own dropout advances a Philox offset rather than
drawing a seed per call. Elsewhere (``capture: false``, a Q-layer used without conversion) each
seed is one read. A read is ``int(torch.randint(0, 2**31 - 1, (1,)).item())``'s value, taken by
the extension without a tensor (``_C.draw_seed``: ~0.5 us against ~5-15 for the tensor op and
its read; no device wait either way, the generator lives on the host). ``torch.manual_seed``
makes runs reproducible: the stream's key is the one draw.
"""
from __future__ import annotations

import contextvars
import itertools
from typing import Optional

import torch

from .backend import extension
from .hash32 import fmix32_int

__all__ = ["SeedStream", "draw_seed", "seed_stream"]

_STREAM: "contextvars.ContextVar[Optional[SeedStream]]" = contextvars.ContextVar(
    "actnn_zoo_seed_stream", default=None)


# torch.randint(0, 2**31 - 1, (1,))'s value and generator step without the tensor
# (cpp_ext/variance_cpu.cpp); None without the extension or in an older build
_DRAW = getattr(extension(), "draw_seed", None)
# SeedStream.next's mix in one call (cpp_ext/variance_cpu.cpp), None without the extension
_MIX = getattr(extension(), "stream_seed", None)


def _read_generator() -> int:
    """One read of torch's default CPU generator: a 31-bit seed."""
    if _DRAW is not None:
        return _DRAW()
    return int(torch.randint(0, 2 ** 31 - 1, (1,), device="cpu").item())


class SeedStream:
    """Distinct 31-bit seeds from one generator draw: ``fmix32(key ^ fmix32(k))`` for the k-th
    seed (fmix32 is a bijection of 32-bit values, so the seeds of one stream differ before the
    top bit is dropped)."""

    __slots__ = ("key", "counts")

    def __init__(self) -> None:
        self.key = _read_generator()
        self.counts = itertools.count(1)  # k of the next seed (a C iterator: no frame)

    def next(self) -> int:
        k = next(self.counts)
        if _MIX is not None:
            return _MIX(self.key, k)
        return fmix32_int(self.key ^ fmix32_int(k)) & 0x7FFFFFFF


def draw_seed() -> int:
    """A 31-bit seed: the open :class:`SeedStream`'s next, else a draw from torch's default
    (CPU) generator. Neither synchronises a device."""
    stream = _STREAM.get()
    if stream is not None:
        if _MIX is not None:  # stream.next() without its frame: every compressed save draws
            return _MIX(stream.key, next(stream.counts))
        return stream.next()
    return _read_generator()


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
