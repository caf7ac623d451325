"""The weight-quantized model as a product: per-parameter codes and scales
(:class:`QuantizedWeight`), their safetensors file, and loading it into a plain module."""
from .file import load_quantized, read, state_dict
from .record import QuantizedWeight

__all__ = ["QuantizedWeight", "load_quantized", "read", "state_dict"]
