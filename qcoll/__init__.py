"""qcoll: quantized collectives for sharded data-parallel training (ZeRO++).

qwZ :func:`all_gather_int8` / :func:`all_gather_quantized`, hpZ :func:`replica_gather`,
qgZ :func:`reduce_scatter_quantized`, HSDP's :func:`all_reduce_quantized`, the codec :func:`quantize` / :func:`dequantize`.
"""
from .comm import (AllGatherResult, ErrorFeedback, RankMismatchError, SecondaryShard, Topology, all_gather_int8,
                   all_gather_quantized, all_reduce_quantized, reduce_scatter_quantized, replica_gather, stats)
from .quant import Packed, dequantize, quantize
from . import zero  # noqa: E402  (after comm and quant: zero builds on them)

__version__ = "0.1.0"
__all__ = ["all_gather_int8", "all_gather_quantized", "AllGatherResult", "replica_gather", "SecondaryShard",
           "reduce_scatter_quantized", "all_reduce_quantized", "ErrorFeedback", "RankMismatchError", "Topology", "quantize", "dequantize", "Packed", "stats",
           "zero"]
