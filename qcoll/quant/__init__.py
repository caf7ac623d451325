"""The qcoll codec: block quantization in the wire format of docs/FORMAT.md."""
from .api import Packed, dequantize, packed_nbytes, quantize
from .format import DEFAULT_GRAD_BLOCK, DEFAULT_WEIGHT_BLOCK, VALID_BITS

__all__ = ["Packed", "quantize", "dequantize", "packed_nbytes", "VALID_BITS",
           "DEFAULT_WEIGHT_BLOCK", "DEFAULT_GRAD_BLOCK"]
