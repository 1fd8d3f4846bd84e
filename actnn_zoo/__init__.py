"""actnn_zoo: train PyTorch models with compressed activations (2 bits per value on average)."""
from .quant import QuantizedTensor, backend_name, dequantize, quantize

__all__ = ["QuantizedTensor", "quantize", "dequantize", "backend_name"]
__version__ = "0.1.0"
