"""Per-group stochastic quantization of activation tensors, and 1-bit mask packing."""
from .api import (SUPPORTED_BITS, Bits, SampleBits, check_bits, check_group_size, dequantize,
                  dequantize_rows, pack_compare, pack_mask, quantize, quantize_normalized, unpack_mask)
from .backend import backend_name
from .sparse import dequantize_sparse, quantize_sparse
from .tensor import QuantizedTensor, SparseQuantizedTensor

__all__ = ["QuantizedTensor", "SparseQuantizedTensor", "quantize_sparse", "dequantize_sparse", "SampleBits", "Bits", "quantize", "quantize_normalized", "dequantize", "dequantize_rows",
           "pack_compare", "pack_mask",
           "unpack_mask", "backend_name", "SUPPORTED_BITS", "check_bits", "check_group_size"]
