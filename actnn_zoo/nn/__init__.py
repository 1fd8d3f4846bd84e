"""Quantized drop-in replacements for torch.nn layers (one file per layer family)."""
from ._base import QModule

__all__ = ["QModule"]
# Each layer file adds its import and names below, and Q_MODULES collects every Q class.
