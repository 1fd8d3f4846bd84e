"""Bit-allocation strategies behind one interface (:class:`PrecisionStrategy`).

``strategy:`` in a QuantConfig names one of :data:`STRATEGY_CLASSES`; ``convert_model`` builds
it with :func:`build_strategy`, attaches it to the converted model (``model.actnn_zoo_precision``)
and ``restore_model`` detaches it. A strategy only sets ``module.sample_bits`` on Q-layers and
reads what it observed on them (``module.precision_stats``).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Type

from .acgc import ACGCStrategy
from .actnn import ActNNStrategy
from .gact import GACTStrategy, greedy_widths
from .base import PRECISION_ATTR, PrecisionStrategy, TrackedLayer, UniformStrategy
from .solver import allocate_samples, allocate_weighted, quantization_cost
from .stats import LayerStats, layer_kind, range_statistic

if TYPE_CHECKING:
    from ..config import QuantConfig

__all__ = ["PrecisionStrategy", "UniformStrategy", "ActNNStrategy", "GACTStrategy",
           "ACGCStrategy", "greedy_widths", "TrackedLayer",
           "LayerStats", "STRATEGY_CLASSES", "PRECISION_ATTR", "build_strategy",
           "allocate_samples", "allocate_weighted", "quantization_cost", "layer_kind",
           "range_statistic"]

# name in a config -> class. Read-only; config.STRATEGIES lists the same names.
STRATEGY_CLASSES: Mapping[str, Type[PrecisionStrategy]] = MappingProxyType({
    UniformStrategy.name: UniformStrategy,
    ActNNStrategy.name: ActNNStrategy,
    GACTStrategy.name: GACTStrategy,
    ACGCStrategy.name: ACGCStrategy,
})


def build_strategy(config: "QuantConfig") -> PrecisionStrategy:
    """A new, unattached strategy for ``config.strategy``."""
    try:
        cls = STRATEGY_CLASSES[config.strategy]
    except KeyError:
        raise ValueError(f"no precision strategy named {config.strategy!r}; known: "
                         f"{', '.join(STRATEGY_CLASSES)}") from None
    return cls(config)
