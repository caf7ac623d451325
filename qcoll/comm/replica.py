"""hpZ: the node-local secondary shard and the backward ``replica_gather``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .c10d import all_gather_flat
from . import framing, validate
from .all_gather import AllGatherResult, decode_into
from .handle import finish, labelled, wait_work
from .stats import stats
from .topology import Topology


@dataclass(frozen=True, eq=False)
class SecondaryShard:
    """The secondary partition of one rank (hpZ): bytes it received, and what they are.

    Local rank ``l`` of ``L`` (``N`` nodes) keeps the gathered rows of global ranks
    ``l*N .. (l+1)*N - 1``, exactly as received in the forward all-gather: packed frames
    when quantized (no extra communication, ``bits/8`` bytes per element plus the 16-byte
    frame header per shard, docs/FORMAT.md "Frames", so that :func:`replica_gather`'s
    receivers check them again), the raw shards when ``bits=None``. Build one with
    :meth:`keep` from an :class:`~qcoll.comm.AllGatherResult`; it is an immutable record
    (the caller holds it and drops it to free the bytes), and :func:`replica_gather`
    all-gathers its rows inside the node, in global rank order.

    ``rows``: uint8 ``[N, 16 + packed_nbytes(numel)]`` (or ``[N, numel]`` in ``dtype`` when
    ``bits`` is None). ``numel``: elements per shard.
    """

    topology: Topology
    rows: torch.Tensor
    numel: int
    bits: int | None
    block_size: int
    dtype: torch.dtype
    outliers: int = 0

    @classmethod
    def keep(cls, gathered: AllGatherResult, topology: Topology) -> "SecondaryShard":
        """This rank's secondary shard from a completed world all-gather (copies ``N`` rows)."""
        if not isinstance(gathered, AllGatherResult):
            raise TypeError(f"gathered must be the AllGatherResult of all_gather_quantized, got "
                            f"{type(gathered).__name__}")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a qcoll Topology, got {type(topology).__name__}")
        topology.check_live()
        if gathered.rows.shape[0] != topology.world_size:
            raise ValueError(f"a SecondaryShard can only be kept from an all-gather over the world group "
                             f"({topology.world_size} ranks), got one over {gathered.rows.shape[0]}")
        lo = topology.local_rank * topology.num_nodes
        return cls(topology, gathered.rows[lo: lo + topology.num_nodes].clone(), gathered.numel, gathered.bits,
                   gathered.block_size, gathered.dtype, gathered.outliers)

    def header(self) -> framing.Header | None:
        """The frame header every kept quantized shard carries (None when unquantized)."""
        return None if self.bits is None else framing.Header(self.bits, self.block_size, self.numel,
                                                             outliers=self.outliers)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for it."""
        return self.rows.numel() * self.rows.element_size()


@labelled("qcoll::hpZ")
def replica_gather(output: torch.Tensor, secondary: SecondaryShard, async_op: bool = False):
    """Rebuild the full tensor from the node's secondary shards (intra-node only).

    ``output`` holds ``world * numel`` elements, as in the forward all-gather that
    ``secondary`` was kept from (:meth:`SecondaryShard.keep`); the result is bit-identical to
    that gather's output. Returns None, or with ``async_op`` a handle whose ``wait()``
    returns ``output``.

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
    mine = secondary.rows.reshape(-1)
    header = secondary.header()
    L, W = t.ranks_per_node, t.world_size
    recv = output.view(-1) if header is None else framing.receive_buffer(W, mine.numel() // t.num_nodes, mine.device)
    hb = 0 if header is None else framing.header_bytes()
    stats.add("replica_gather", t.intra_group, (L - 1) * mine.numel() * mine.element_size(), (L - 1) * t.num_nodes * hb)
    work = all_gather_flat(recv.view(-1), mine, group=t.intra_group, async_op=True)

    def complete():
        wait_work(work, "replica_gather", lambda: f"{t.num_nodes} kept shards of {mine.numel() // t.num_nodes} bytes "
                  f"each ({header.describe() if header else 'unquantized'})", t.intra_group)
        if header is None:
            framing.check_unframed(output.view(torch.uint8).view(W, -1), lambda: _receipt(t))
        else:
            payload = framing.unframe(recv.view(W, -1), header, lambda: _receipt(t))
            decode_into(payload, header, output.view(W, n))
        return output

    return finish(complete, async_op, "qcoll::hpZ")


def _receipt(t: Topology) -> framing.Receipt:
    """Row ``g`` of the gathered secondaries is rank ``g``'s shard, sent by the node peer that keeps it."""
    first = t.node * t.ranks_per_node
    return framing.Receipt("replica_gather", t.rank, lambda g: first + g // t.num_nodes,
                           lambda g: f"its hpZ copy of rank {g}'s shard")
