"""The interface every bit-allocation strategy implements, and the uniform strategy.

A strategy is attached to one converted model by :func:`actnn_zoo.convert_model` (kept as
``model.actnn_zoo_precision``) and detached by ``restore_model`` or a re-conversion. It may
register hooks on the model and its Q-layers, keeps all its state on itself and on the layers
(``module.precision_stats``), and acts only by setting ``module.sample_bits`` (the per-sample
widths the layer's next training forward passes to its Function) or, for one width per layer
(gact), the layer's ``qconfig.bits``, which it restores when detached. Layers and Functions do not
know which strategy runs, so new strategies (GACT, AC-GC, DIVISION) plug in here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, List, Optional, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ..config import QuantConfig
    from ..nn._base import QModule

__all__ = ["TrackedLayer", "PrecisionStrategy", "UniformStrategy", "PRECISION_ATTR"]

PRECISION_ATTR = "actnn_zoo_precision"


@dataclass(frozen=True)
class TrackedLayer:
    """One converted Q-layer as the converter hands it to a strategy.

    ``pinned_bits`` is the width a config rule fixed for this layer (the strategy must leave
    it alone), None when the strategy may choose.
    """

    name: str
    module: "QModule"
    pinned_bits: Optional[int] = None


class PrecisionStrategy:
    """Base class: chooses the widths of a model's Q-layers.

    Subclasses set ``name`` (the ``strategy:`` value in a config) and override
    :meth:`attach`; hooks they register go through :meth:`_keep` so :meth:`detach` removes
    them. ``config.bits`` is a width for 'uniform' and an average budget for the others.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: "QuantConfig") -> None:
        self.config = config
        self.layers: List[TrackedLayer] = []
        self._handles: List[RemovableHandle] = []

    def attach(self, model: nn.Module, layers: Sequence[TrackedLayer]) -> None:
        """Start managing ``layers`` of ``model`` (the root the converter returns)."""
        self.layers = list(layers)

    def detach(self) -> None:
        """Remove every hook and forget per-sample widths and statistics on the layers."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for tl in self.layers:
            tl.module.sample_bits = None
            tl.module.precision_stats = None
        self.layers = []

    def _keep(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(bits={self.config.bits}, "
                f"layers={len(self.layers)})")


class UniformStrategy(PrecisionStrategy):
    """Every layer at its configured width (``qconfig.bits``): no hooks, nothing per step."""

    name = "uniform"
