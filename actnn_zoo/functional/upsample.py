"""Upsampling (``F.interpolate``) saving nothing but shapes.

Every interpolation mode (nearest, nearest-exact, linear, bilinear, bicubic, trilinear, area)
is linear in the input, and its backward reads only sizes and scales. The output is
computed by ``F.interpolate`` itself; backward is the vector-Jacobian product of the same call
at a zero input (see :class:`~actnn_zoo.functional.pool.ShapeOnlyFunction`).
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence, Union

import torch.nn.functional as F
from torch import Tensor

from .pool import ShapeOnlyFunction

__all__ = ["interpolate"]


def interpolate(x: Tensor, size: Union[int, Sequence[int], None] = None,
                scale_factor: Union[float, Sequence[float], None] = None,
                mode: str = "nearest", align_corners: Optional[bool] = None,
                recompute_scale_factor: Optional[bool] = None,
                antialias: bool = False) -> Tensor:
    """``F.interpolate`` with the same arguments; saves no tensor for backward."""
    op = partial(F.interpolate, size=size, scale_factor=scale_factor, mode=mode,
                 align_corners=align_corners, recompute_scale_factor=recompute_scale_factor,
                 antialias=antialias)
    return ShapeOnlyFunction.apply(x, op)
