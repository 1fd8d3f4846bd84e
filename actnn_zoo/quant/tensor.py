"""QuantizedTensor: the compressed form of one activation tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .backend import extension
from .reference import uniform_offsets  # reference imports only the leaf hash32


class CompressedPayload:
    """What every compressed form answers from its fields ``data``, ``shape``, ``row_bits`` and
    its :meth:`tensors` (shared by :class:`QuantizedTensor` and DIVISION's tensor)."""

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def mixed(self) -> bool:
        """True when each sample has its own width (``row_bits`` is set)."""
        return self.row_bits is not None

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Every byte this object keeps alive: codes, metadata, per-sample widths/offsets."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_value(self) -> float:
        """Average storage cost per original value, metadata included."""
        n = self.numel()
        return 8.0 * self.nbytes / n if n else 0.0


@dataclass(frozen=True)
class QuantizedTensor(CompressedPayload):
    """Packed codes plus the per-group metadata needed to reconstruct a tensor.

    ``data`` holds the codes of every row, row ``n`` starting at byte ``offsets[n]``; ``lo`` and
    ``step`` are bfloat16 ``(N, G)``. With uniform ``bits`` the offsets are implied
    (``n * ceil(D * bits / 8)``) and not stored; with per-sample bits ``row_bits`` (uint8, N) and
    ``offsets`` (int64, N + 1) are kept and counted in :attr:`nbytes`.
    ``transform`` is 'none' or 'hadamard': the codes then hold the randomized Walsh-Hadamard
    transform of each full group (signs from ``transform_seed``), which dequantize inverts
    (:mod:`actnn_zoo.quant.hadamard`).
    """

    data: Tensor
    lo: Tensor
    step: Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: Optional[int]
    group_size: int
    row_bits: Optional[Tensor] = None
    offsets: Optional[Tensor] = None
    transform: str = "none"
    transform_seed: int = 0

    @classmethod
    def made(cls, data: Tensor, lo: Tensor, step: Tensor, shape: torch.Size, dtype: torch.dtype,
             bits: Optional[int], group_size: int, row_bits: Optional[Tensor] = None,
             offsets: Optional[Tensor] = None, transform: str = "none",
             transform_seed: int = 0) -> "QuantizedTensor":
        """One the library's quantizer made itself (its fields checked there), without the
        generated ``__init__``: a frozen dataclass sets each of its eleven fields through
        ``object.__setattr__``, ~1 us of every compressed save; here one dict update. The
        same object, field for field."""
        new = object.__new__(cls)
        new.__dict__.update(data=data, lo=lo, step=step, shape=shape, dtype=dtype, bits=bits,
                            group_size=group_size, row_bits=row_bits, offsets=offsets,
                            transform=transform, transform_seed=transform_seed)
        return new

    # -- autograd integration: everything saved goes through ctx.save_for_backward ----------
    def tensors(self) -> Tuple[Tensor, ...]:
        """The tensors to hand to ``ctx.save_for_backward``."""
        if self.mixed:
            return (self.data, self.lo, self.step, self.row_bits, self.offsets)
        return (self.data, self.lo, self.step)

    def spec(self) -> tuple:
        """The non-tensor part, to keep on ``ctx``; :meth:`rebuild` joins the two again."""
        return (self.shape, self.dtype, self.bits, self.group_size, self.mixed, self.transform,
                self.transform_seed)

    @classmethod
    def rebuild(cls, spec: tuple, tensors: Tuple[Tensor, ...]) -> "QuantizedTensor":
        shape, dtype, bits, group_size, mixed, transform, transform_seed = spec
        if mixed:
            data, lo, step, row_bits, offsets = tensors
        else:
            (data, lo, step), row_bits, offsets = tensors, None, None
        return cls(data, lo, step, shape, dtype, bits, group_size, row_bits, offsets, transform,
                   transform_seed)

    def row_layout(self) -> Tuple[Tensor, Tensor]:
        """(row widths uint8 (N,), row byte offsets int64 (N + 1,)) as the general kernels take
        them: the stored ones with per-sample widths, else made for the one width (rows are
        dim 0, a 0-d or 1-d tensor one row)."""
        if self.mixed:
            return self.row_bits, self.offsets
        n = self.shape[0] if len(self.shape) >= 2 else 1
        d = self.shape.numel() // n if n else 0
        layout = getattr(extension(), "uniform_layout", None) if self.data.is_cpu else None
        if layout is not None:  # one compiled call, not three operators
            return layout(n, d, self.bits)
        return (torch.full((n,), self.bits, dtype=torch.uint8, device=self.device),
                uniform_offsets(n, d, self.bits, self.device))

    def __repr__(self) -> str:
        width = "mixed" if self.mixed else f"{self.bits}"
        return (f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={width}, "
                f"group_size={self.group_size}, transform={self.transform}, "
                f"nbytes={self.nbytes})")


@dataclass(frozen=True)
class SparseQuantizedTensor(CompressedPayload):
    """A tensor with many exact zeros: a 1-bit mask of its nonzeros plus codes of the nonzeros
    only (:func:`actnn_zoo.quant.quantize_sparse`).

    Why: a ReLU output is half zeros. Plain codes spend ``bits`` on every zero and ReLU needs a
    mask besides; here the mask *is* ReLU's backward mask and the codes cover only the nonzero
    half, so at 2 bits the whole costs what plain codes cost alone (1 + 2 / 2 bits per value),
    and each group's range spans only its nonzero values (a finer step than a plain group's).
    ``mask``: ``pack_mask(x != 0)`` in row-major order; ``lo`` / ``step`` bfloat16 ``(N, G)``
    over each group's nonzeros; row ``n``'s codes, ``row_bits[n]`` each, start at byte
    ``offsets[n]`` of ``data`` (offsets depend on the data, so they are always kept).
    """

    data: Tensor
    lo: Tensor
    step: Tensor
    mask: Tensor
    row_bits: Tensor
    offsets: Tensor
    shape: torch.Size
    dtype: torch.dtype
    group_size: int

    def tensors(self) -> Tuple[Tensor, ...]:
        return (self.data, self.lo, self.step, self.mask, self.row_bits, self.offsets)

    def spec(self) -> tuple:
        return (self.shape, self.dtype, self.group_size)

    @classmethod
    def rebuild(cls, spec: tuple, tensors: Tuple[Tensor, ...]) -> "SparseQuantizedTensor":
        shape, dtype, group_size = spec
        data, lo, step, mask, row_bits, offsets = tensors
        return cls(data, lo, step, mask, row_bits, offsets, shape, dtype, group_size)

    def __repr__(self) -> str:
        return (f"SparseQuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"group_size={self.group_size}, nbytes={self.nbytes})")


@dataclass(frozen=True)
class MaskedPayload(CompressedPayload):
    """A dropout's output kept as its input's payload times the dropout's keep-mask and scale.

    Why: attention written as softmax -> dropout -> matmul saves the probabilities twice, once
    for the softmax's backward and once, dropped out, for the matmul's; the second is the first
    times a mask the dropout keeps anyway (1 bit a value). Rebuilt as ``source_hat * mask *
    scale`` it costs no byte of its own, and it is unbiased because the mask and scale are
    exact: ``E[source_hat] * mask * scale`` is the dropout's output (``capture/store.py``).
    ``mask``: packed keep bits of ``source.shape`` in row-major order; ``scale``: ``1 / (1 - p)``
    rounded to the output's dtype, as torch's dropout rounds it; ``view_shape``: the shape the
    save asked for (a matmul saves a reshaped view of its operand).
    """

    source: QuantizedTensor
    mask: Tensor
    scale: float
    view_shape: torch.Size

    @property
    def data(self) -> Tensor:
        return self.source.data

    @property
    def shape(self) -> torch.Size:
        return self.view_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def bits(self) -> Optional[int]:
        return self.source.bits

    @property
    def row_bits(self) -> Optional[Tensor]:
        return None

    def tensors(self) -> Tuple[Tensor, ...]:
        return self.source.tensors() + (self.mask,)

    def spec(self) -> tuple:
        return (self.source.spec(), self.scale, self.view_shape)

    @classmethod
    def rebuild(cls, spec: tuple, tensors: Tuple[Tensor, ...]) -> "MaskedPayload":
        source_spec, scale, view_shape = spec
        return cls(QuantizedTensor.rebuild(source_spec, tensors[:-1]), tensors[-1], scale,
                   view_shape)

    def as_view(self, shape: torch.Size) -> "MaskedPayload":
        """The same payload read back in ``shape`` (same number of values, row-major)."""
        return MaskedPayload(self.source, self.mask, self.scale, torch.Size(shape))
