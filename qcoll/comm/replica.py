"""hpZ: the node-local secondary shard and the backward ``replica_gather``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import rows
from . import validate
from .handle import finish
from .stats import stats
from .topology import Topology


class SecondaryShard:
    """The secondary partition of one rank (hpZ).

    Local rank ``l`` of ``L`` (``N`` nodes) keeps the gathered buffers of global
    ranks ``l*N .. (l+1)*N - 1``, exactly as received in the forward all-gather:
    packed bytes when quantized (no extra communication, ``bits/8`` bytes per
    element), the raw shards when ``bits=None``. :func:`replica_gather` then
    all-gathers them inside the node only, in global rank order.
    """

    def __init__(self, topology: Topology):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a qcoll Topology, got {type(topology).__name__}")
        self.topology = topology
        self.data: torch.Tensor | None = None
        self.numel = self.bits = self.block_size = self.dtype = None

    def check_gather(self, group, numel, bits, block_size, dtype) -> None:
        if group is not None and dist.get_world_size(group) != self.topology.world_size:
            raise ValueError("a SecondaryShard can only be filled by an all-gather over the world group")
        self.numel, self.bits, self.block_size, self.dtype = numel, bits, block_size, dtype

    def keep(self, shards: torch.Tensor) -> None:
        """Keep this rank's rows of the gathered ``[world, nbytes]`` buffers."""
        t = self.topology
        lo = t.local_rank * t.num_nodes
        self.data = shards[lo: lo + t.num_nodes].clone()

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def release(self) -> None:
        self.data = None


def replica_gather(output: torch.Tensor, secondary: SecondaryShard, async_op: bool = False):
    """Rebuild the full tensor from the node's secondary shards (intra-node only).

    ``output`` holds ``world * numel`` elements, as in the forward all-gather that
    filled ``secondary``; the result is bit-identical to that gather's output.
    """
    if not isinstance(secondary, SecondaryShard):
        raise TypeError(f"secondary must be a SecondaryShard, got {type(secondary).__name__}")
    if secondary.data is None:
        raise ValueError("secondary is empty: fill it with all_gather_quantized(..., secondary=...) first")
    validate.check_tensor(output, "output")
    validate.check_async(async_op)
    t = secondary.topology
    n = secondary.numel
    if output.numel() != t.world_size * n:
        raise ValueError(f"output must have world x shard numel = {t.world_size * n} elements, got {output.numel()}")
    if output.dtype != secondary.dtype and secondary.bits is None:
        raise TypeError(f"output dtype {output.dtype} differs from the gathered dtype {secondary.dtype}")
    validate.debug_check("replica_gather", t.intra_group, n, secondary.bits, secondary.block_size,
                         output.dtype, output.device)
    mine = secondary.data.reshape(-1)
    L = t.ranks_per_node
    recv = output.view(-1) if secondary.bits is None else torch.empty(L * mine.numel(), dtype=mine.dtype,
                                                                       device=mine.device)
    stats.add("replica_gather", t.intra_group, (L - 1) * mine.numel() * mine.element_size())
    work = all_gather_flat(recv, mine, group=t.intra_group, async_op=True)

    def complete():
        work.wait()
        if secondary.bits is not None:
            shards = recv.view(t.world_size, -1)
            rows.dequantize_rows_into(shards, n, secondary.bits, secondary.block_size, output.view(t.world_size, n))
        return output

    return finish(complete, async_op)
