"""Quantized collectives over torch.distributed (qwZ, hpZ, qgZ) and the topology."""
from . import stats
from .all_gather import AllGatherResult, all_gather_int8, all_gather_quantized
from .all_reduce import all_reduce_quantized
from .error_feedback import ErrorFeedback
from .errors import RankMismatchError
from .reduce_scatter import reduce_scatter_quantized
from .replica import SecondaryShard, replica_gather
from .topology import Topology

__all__ = ["Topology", "all_gather_quantized", "all_gather_int8", "AllGatherResult", "replica_gather", "SecondaryShard",
           "reduce_scatter_quantized", "all_reduce_quantized", "stats", "RankMismatchError",
           "ErrorFeedback"]
