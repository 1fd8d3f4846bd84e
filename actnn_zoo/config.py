"""Configuration: the per-layer settings a Q-module carries (``module.qconfig``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .quant.api import ROUNDING, check_bits, check_group_size


@dataclass(frozen=True)
class LayerQConfig:
    """What one Q-module does with the tensors it saves for backward.

    Immutable and owned by the module: two converted models never share mutable settings.
    ``bits`` is the width used when no per-sample widths were set by a precision strategy.
    """

    bits: int = 2
    group_size: int = 256
    rounding: str = "stochastic"
    enabled: bool = True

    def __post_init__(self) -> None:
        check_bits(self.bits, "bits")
        check_group_size(self.group_size, "group_size")
        if self.rounding not in ROUNDING:
            raise ValueError(f"rounding must be one of {ROUNDING}, got {self.rounding!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")

    def replace(self, **changes) -> "LayerQConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
