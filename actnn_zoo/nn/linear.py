"""QLinear: nn.Linear that saves its input compressed for backward.

Saves: compress(x) (only when the weight needs a gradient) + the weight Parameter (free).
Backward: grad_x = grad_y @ W (exact), grad_W = grad_y^T @ dequant(x) (unbiased),
grad_b = sum(grad_y). Eval / no_grad / qconfig.enabled=False: plain nn.Linear. In the common
case the autograd node is compiled (``_C.qlinear``, no Python in backward), else
``LinearFunction``: the same codes and gradients (``functional.linear.linear``).
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor, nn

from ..config import LayerQConfig
from .._compile import inline_compiling
from ..functional.linear import check_compressible, linear, traced_linear
from ._base import QModule


def use_function(module: QModule, x: Tensor, *params: Optional[Tensor]) -> bool:
    """True when this forward should save compressed tensors: training, enabled, grad mode on,
    and something (input or a parameter) needs a gradient. Raises NotImplementedError for an
    input the quantizer cannot hold rather than silently keeping it in full precision."""
    if not module.quantizing():
        return False
    if not (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return False
    check_compressible(x, module)
    return True


def traced_width(module: QModule, x: Tensor, *params: Optional[Tensor]
                 ) -> Optional[Tuple[int, int]]:
    """(bits, group size) when torch.compile traces a training forward of a conv or linear
    layer that autograd records (:meth:`QModule.graph_saves`), else None. None as well under
    :func:`actnn_zoo.compile`: there the graph's hooks keep the input, once for every op that
    saves it."""
    width = module.graph_saves()
    if width is None or inline_compiling(module):
        return None
    if not (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return None
    check_compressible(x, module)
    return width


class QLinear(QModule, nn.Linear):
    """nn.Linear that saves its input compressed (2 bits per value by default, not 32).

    Transformers' and MLPs' largest saved tensors are Linear inputs; only the weight gradient
    ``grad_y^T @ x`` reads them and an unbiased estimate is enough for SGD, so the input is
    kept as stochastically rounded codes; the output and the input gradient are exact."""

    _FLOAT_MODULE = nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, qconfig: Optional[LayerQConfig] = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_q(qconfig)

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias  # (each read is an nn.Module.__getattr__ call)
        if not use_function(self, input, weight, bias):
            width = traced_width(self, input, weight, bias)
            if width is None:
                return super().forward(input)
            return traced_linear(input, weight, bias, *width)
        return linear(input, weight, bias, self.qconfig, self.bits_for(input))
