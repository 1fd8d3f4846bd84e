"""actnn_zoo: train PyTorch models with compressed activations (2 bits per value on average)."""
from . import nn
from .capture import capture_report, capturing
from .compiled import compile
from .config import LayerQConfig, QuantConfig
from .convert import (conversion_report, convert_model, precision_strategy, register_mapping,
                      restore_model)
from .nn import *  # noqa: F401,F403  (every Q-layer is importable from actnn_zoo)
from .nn import __all__ as _layers
from .quant import QuantizedTensor, backend_name, dequantize, quantize

__all__ = ["convert_model", "compile", "restore_model", "register_mapping", "conversion_report",
           "precision_strategy", "capturing", "capture_report", "QuantConfig", "LayerQConfig", "QuantizedTensor",
           "quantize", "dequantize", "backend_name", *_layers]
__version__ = "0.1.0"
