"""QConv1d/2d/3d and QConvTranspose1d/2d/3d: convolutions that save their input compressed.

Saves: compress(x) (2 bits per value by default, only when the weight needs a gradient) + the
weight Parameter (free). Forward computes the real torch op on the uncompressed input, so the
output is torch's. Backward: dequantize x, then the public ``aten::convolution_backward``
(grad_x exact, grad_W unbiased, grad_b = sum of grad_y); an input of 1 MiB or more is decoded
``backward_chunks`` samples-chunks at a time, the weight gradient summed over chunks. padding_mode != 'zeros' applies the
same F.pad as torch inside the Function: the unpadded input is compressed and re-padded in
backward (a pad outside would save the full input). Unbatched inputs get a batch dim of one.
Eval / no_grad / qconfig.enabled=False: plain torch forward. A plain convolution runs as a
compiled autograd node (``_C.qconv``, no Python in backward) in the common case, else as
``ConvFunction``: the same codes and gradients (``functional.conv.conv``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.conv import ConvSpec, TracedConvFunction, conv
from ._base import QModule
from .linear import traced_width, use_function

_size = Union[int, Tuple[int, ...]]


def _run(module: QModule, x: Tensor, spec: ConvSpec,
         width: Optional[Tuple[int, int]] = None) -> Tensor:
    """Call the Function on a batched input (quantization rows are samples): the traced form
    at ``width`` (bits, group size) when torch.compile traces the layer."""
    unbatched = x.dim() == spec.dims + 1
    if unbatched:
        x = x.unsqueeze(0)
    if width is not None:
        out = TracedConvFunction.apply(x, module.weight, module.bias, spec, *width)
    else:
        out = conv(x, module.weight, module.bias, spec, module.qconfig, module.bits_for(x))
    return out.squeeze(0) if unbatched else out


def pad_widths(padding: Union[str, Tuple[int, ...]], kernel_size: Tuple[int, ...],
               dilation: Tuple[int, ...]) -> Tuple[int, ...]:
    """``F.pad`` widths (last dimension first, left then right) of a convolution whose
    ``padding_mode`` is not 'zeros', from its public attributes: what nn.ConvNd keeps in a
    private attribute. 'same' puts the odd extra value on the right, as torch does."""
    if padding == "valid":
        return (0,) * (2 * len(kernel_size))
    if padding == "same":
        out: List[int] = []
        for d, k in zip(reversed(dilation), reversed(kernel_size)):
            total = d * (k - 1)
            out += [total // 2, total - total // 2]
        return tuple(out)
    return tuple(p for p in reversed(tuple(padding)) for _ in range(2))


class _QConvNd(QModule):
    """forward for QConv1d/2d/3d (mirrors nn.ConvNd._conv_forward)."""

    _DIMS: int

    def forward(self, input: Tensor) -> Tensor:
        width = None  # eager training: the Function; traced by torch.compile: its traced form
        if not use_function(self, input, self.weight, self.bias):
            width = traced_width(self, input, self.weight, self.bias)
            if width is None:
                return super().forward(input)
        if self.padding_mode != "zeros":  # torch: F.pad(x, ..., mode) then padding 0
            spec = ConvSpec(self._DIMS, tuple(self.stride), (0,) * self._DIMS,
                            tuple(self.dilation), self.groups, pad_mode=self.padding_mode,
                            pad_nd=pad_widths(self.padding, self.kernel_size, self.dilation))
        else:
            padding = self.padding if isinstance(self.padding, str) else tuple(self.padding)
            spec = ConvSpec(self._DIMS, tuple(self.stride), padding, tuple(self.dilation),
                            self.groups)
        return _run(self, input, spec, width)


class _QConvTransposeNd(QModule):
    """forward for QConvTranspose1d/2d/3d (mirrors nn.ConvTransposeNd.forward)."""

    _DIMS: int

    def output_padding_for(self, input: Tensor,
                           output_size: Optional[Sequence[int]]) -> Tuple[int, ...]:
        """The output padding that makes the output ``output_size`` (torch's own helper is
        private): ``output_size`` lists the spatial sizes, optionally after the batch and
        channel sizes; each must lie in [min, min + stride - 1] with the documented
        ``min = (in - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1``."""
        if output_size is None:
            return tuple(self.output_padding)
        dims = self._DIMS
        leading = 2 if input.dim() == dims + 2 else 1  # batch and channel, or channel
        size = [int(s) for s in output_size]
        if len(size) == leading + dims:
            size = size[leading:]
        if len(size) != dims:
            raise ValueError(f"{type(self).__name__}: output_size must have {dims} or "
                             f"{leading + dims} elements (got {len(output_size)})")
        padding = []
        for d in range(dims):
            low = ((input.size(d - dims) - 1) * self.stride[d] - 2 * self.padding[d]
                   + self.dilation[d] * (self.kernel_size[d] - 1) + 1)
            high = low + self.stride[d] - 1
            if not low <= size[d] <= high:
                raise ValueError(f"{type(self).__name__}: requested an output size of "
                                 f"{size}, but valid sizes range from {low} to {high} (for "
                                 f"an input of {list(input.size())[-dims:]})")
            padding.append(size[d] - low)
        return tuple(padding)

    def forward(self, input: Tensor, output_size: Optional[List[int]] = None) -> Tensor:
        width = None
        if not use_function(self, input, self.weight, self.bias):
            width = traced_width(self, input, self.weight, self.bias)
            if width is None:
                return super().forward(input, output_size)
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for "
                             f"{self._FLOAT_MODULE.__name__}")
        output_padding = self.output_padding_for(input, output_size)
        spec = ConvSpec(self._DIMS, tuple(self.stride), tuple(self.padding),
                        tuple(self.dilation), self.groups, True, tuple(output_padding))
        return _run(self, input, spec, width)


class QConv1d(_QConvNd, nn.Conv1d):
    """nn.Conv1d that saves its input compressed (2 bits per value by default, not 32).

    Only the weight gradient needs the input, and an unbiased one is enough for SGD, so the
    input is kept as stochastically rounded codes; the output and the input gradient are
    exact. Made by :func:`actnn_zoo.convert_model`, or directly with the same arguments as
    ``nn.Conv1d`` plus ``qconfig`` (a :class:`actnn_zoo.LayerQConfig`)."""

    _FLOAT_MODULE = nn.Conv1d
    _DIMS = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: Union[str, _size] = 0, dilation: _size = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None,
                 dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)
        self._init_q(qconfig)


class QConv2d(_QConvNd, nn.Conv2d):
    """nn.Conv2d that saves its input compressed (2 bits per value by default, not 32): the
    largest saved tensors of a CNN. Only the weight gradient needs the input, and an unbiased
    one is enough for SGD; the output and the input gradient are exact."""

    _FLOAT_MODULE = nn.Conv2d
    _DIMS = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: Union[str, _size] = 0, dilation: _size = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None,
                 dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)
        self._init_q(qconfig)


class QConv3d(_QConvNd, nn.Conv3d):
    """nn.Conv3d that saves its input compressed, as :class:`QConv2d` does (only the weight
    gradient reads it; output and input gradient exact)."""

    _FLOAT_MODULE = nn.Conv3d
    _DIMS = 3

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: Union[str, _size] = 0, dilation: _size = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None,
                 dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)
        self._init_q(qconfig)


class QConvTranspose1d(_QConvTransposeNd, nn.ConvTranspose1d):
    """nn.ConvTranspose1d that saves its input compressed: only the weight gradient reads it
    (decoder and upsampling stacks save as much as the encoders)."""

    _FLOAT_MODULE = nn.ConvTranspose1d
    _DIMS = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: _size = 0, output_padding: _size = 0,
                 groups: int = 1, bias: bool = True, dilation: _size = 1,
                 padding_mode: str = "zeros", device=None, dtype=None, *,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding,
                         output_padding, groups, bias, dilation, padding_mode, device, dtype)
        self._init_q(qconfig)


class QConvTranspose2d(_QConvTransposeNd, nn.ConvTranspose2d):
    """nn.ConvTranspose2d that saves its input compressed: only the weight gradient reads it
    (U-Net decoders, GAN generators)."""

    _FLOAT_MODULE = nn.ConvTranspose2d
    _DIMS = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: _size = 0, output_padding: _size = 0,
                 groups: int = 1, bias: bool = True, dilation: _size = 1,
                 padding_mode: str = "zeros", device=None, dtype=None, *,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding,
                         output_padding, groups, bias, dilation, padding_mode, device, dtype)
        self._init_q(qconfig)


class QConvTranspose3d(_QConvTransposeNd, nn.ConvTranspose3d):
    """nn.ConvTranspose3d that saves its input compressed: only the weight gradient reads
    it."""

    _FLOAT_MODULE = nn.ConvTranspose3d
    _DIMS = 3

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _size,
                 stride: _size = 1, padding: _size = 0, output_padding: _size = 0,
                 groups: int = 1, bias: bool = True, dilation: _size = 1,
                 padding_mode: str = "zeros", device=None, dtype=None, *,
                 qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding,
                         output_padding, groups, bias, dilation, padding_mode, device, dtype)
        self._init_q(qconfig)
