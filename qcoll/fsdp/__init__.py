"""qcoll inside FSDP2: ZeRO++'s quantized collectives for ``torch.distributed.fsdp.fully_shard``.

``quantize_comm(model, topology)`` after ``fully_shard`` puts qwZ into FSDP2's parameter
all-gather, qgZ into its gradient reduce-scatter and, on an HSDP mesh, a quantized
all-reduce across nodes; FSDP2 keeps doing everything else (sharding, prefetch, mixed
precision, state dicts). This layer builds on ``qcoll.comm`` and imports nothing from
``qcoll.zero``.
"""
from .comms import QuantizedAllGather, QuantizedReduceScatter
from .hybrid import QuantizedAllReduceHook
from .install import quantize_comm
from .reconfigure import comm_settings, reconfigure_comm

__all__ = ["quantize_comm", "reconfigure_comm", "comm_settings", "QuantizedAllGather", "QuantizedReduceScatter",
           "QuantizedAllReduceHook"]
