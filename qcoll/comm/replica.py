"""hpZ: the node-local secondary shard and the backward ``replica_gather``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import rows
from . import framing, validate
from .handle import finish, wait_work
from .stats import stats
from .topology import Topology


class SecondaryShard:
    """The secondary partition of one rank (hpZ).

    Local rank ``l`` of ``L`` (``N`` nodes) keeps the gathered buffers of global
    ranks ``l*N .. (l+1)*N - 1``, exactly as received in the forward all-gather:
    packed bytes when quantized (no extra communication, ``bits/8`` bytes per
    element), frame headers included (docs/FORMAT.md "Frames", 16 bytes per shard),
    so that :func:`replica_gather`'s receivers check them again; the raw shards
    when ``bits=None``. :func:`replica_gather` then all-gathers them inside the node
    only, in global rank order.
    """

    def __init__(self, topology: Topology):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a qcoll Topology, got {type(topology).__name__}")
        topology.check_live()
        self.topology = topology
        self.data: torch.Tensor | None = None
        self.numel = self.bits = self.block_size = self.dtype = None

    def check_gather(self, group, numel, bits, block_size, dtype) -> None:
        self.topology.check_live()
        if group is not None and dist.get_world_size(group) != self.topology.world_size:
            raise ValueError("a SecondaryShard can only be filled by an all-gather over the world group")
        self.numel, self.bits, self.block_size, self.dtype = numel, bits, block_size, dtype

    def header(self) -> framing.Header | None:
        """The frame header every kept quantized shard carries (None when unquantized)."""
        return None if self.bits is None else framing.Header(self.bits, self.block_size, self.numel)

    def keep(self, shards: torch.Tensor) -> None:
        """Keep this rank's rows of the gathered ``[world, nbytes]`` buffers (frames as received)."""
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

    Ranks that disagree: every rank checks the frame headers of all received shards
    (kept from the forward gather) against its own secondary's ``bits``,
    ``block_size`` and numel before decoding, so a node peer that passes a secondary
    shard of another gather makes every rank that received it raise
    :class:`qcoll.comm.RankMismatchError` (in ``wait()`` for async calls). Where the
    buffers' sizes differ gloo aborts the rank that receives more bytes than it
    expects, and its peer gets the transport's error. With ``bits=None`` (raw shards,
    straight into ``output``) only a peer holding quantized frames is detected, on CPU.
    """
    if not isinstance(secondary, SecondaryShard):
        raise TypeError(f"secondary must be a SecondaryShard, got {type(secondary).__name__}")
    if secondary.data is None:
        raise ValueError("secondary is empty: fill it with all_gather_quantized(..., secondary=...) first")
    validate.check_tensor(output, "output")
    validate.check_async(async_op)
    t = validate.check_topology(secondary.topology, "secondary.topology")
    n = secondary.numel
    if output.numel() != t.world_size * n:
        raise ValueError(f"output must have world x shard numel = {t.world_size * n} elements, got {output.numel()}")
    if output.dtype != secondary.dtype and secondary.bits is None:
        raise TypeError(f"output dtype {output.dtype} differs from the gathered dtype {secondary.dtype}")
    validate.debug_check("replica_gather", t.intra_group, n, secondary.bits, secondary.block_size,
                         output.dtype, output.device)
    mine = secondary.data.reshape(-1)
    header = secondary.header()
    L, W = t.ranks_per_node, t.world_size
    recv = output.view(-1) if header is None else framing.receive_buffer(W, mine.numel() // t.num_nodes, mine.device)
    hb = 0 if header is None else framing.header_bytes()
    stats.add("replica_gather", t.intra_group, (L - 1) * mine.numel() * mine.element_size(), (L - 1) * t.num_nodes * hb)
    work = all_gather_flat(recv.view(-1), mine, group=t.intra_group, async_op=True)

    def complete():
        wait_work(work, "replica_gather", lambda: f"{t.num_nodes} kept shards of {mine.numel() // t.num_nodes} "
                                                  f"bytes each ({header.describe() if header else 'unquantized'})")
        if header is None:
            framing.check_unframed(output.view(torch.uint8).view(W, -1), lambda: _receipt(t))
        else:
            payload = framing.unframe(recv.view(W, -1), header, lambda: _receipt(t))
            rows.dequantize_rows_into(payload, n, header.bits, header.block_size, output.view(W, n))
        return output

    return finish(complete, async_op)


def _receipt(t: Topology) -> framing.Receipt:
    """Row ``g`` of the gathered secondaries is rank ``g``'s shard, sent by the node peer that keeps it."""
    first = t.node * t.ranks_per_node
    return framing.Receipt("replica_gather", t.rank, lambda g: first + g // t.num_nodes,
                           lambda g: f"its hpZ copy of rank {g}'s shard")
