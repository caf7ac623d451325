"""qwZ: quantized weight all-gather."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import format as fmt
from ..quant import outliers as reserve
from ..quant import rows
from . import framing, validate
from .handle import finish_with_result, labelled, wait_work
from .stats import stats
from .topology import Topology


@dataclass(frozen=True, eq=False)
class AllGatherResult:
    """What a completed :func:`all_gather_quantized` gives back.

    ``output``: the caller's output tensor, now holding every rank's shard.
    ``rows``: what each rank of ``group`` sent, as received, one row per rank in group
    order: uint8 ``[group size, 16 + packed_nbytes(numel)]`` frames (header included,
    docs/FORMAT.md "Frames") when quantized, the ``[group size, numel]`` view of
    ``output`` when ``bits is None``. hpZ keeps its node's part of them
    (:meth:`qcoll.comm.SecondaryShard.keep`); drop the result to free them.
    ``numel``, ``bits``, ``block_size``, ``dtype``, ``group`` and ``outliers``: the gather's arguments.
    """

    output: torch.Tensor
    rows: torch.Tensor
    numel: int
    bits: int | None
    block_size: int
    dtype: torch.dtype
    group: object = None
    outliers: int = 0


@labelled("qcoll::qwZ")
def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    bits: int | None = 8,
    block_size: int = fmt.DEFAULT_WEIGHT_BLOCK,
    group=None,
    async_op: bool = False,
    outliers: int = 0,
    topology: Topology | None = None,
):
    """All-gather ``input`` into ``output`` with block quantization on the wire (qwZ).

    Argument shape as ``dist.all_gather_into_tensor``: ``output`` holds
    ``group_size * input.numel()`` elements, shard ``g`` at ``output.view(-1)[g*n:(g+1)*n]``.
    Each rank's shard is quantized to ``bits`` (8, 6, 4, 2; ``None`` is the plain,
    unquantized all-gather) with one fp32 scale per ``block_size`` elements, one
    uint8 buffer per rank is gathered, and every shard is dequantized into
    ``output`` in its dtype.

    ``outliers=k`` (1 to 8) keeps each block's ``k`` largest-magnitude values exactly
    beside the codes (docs/FORMAT.md "Outlier reserve"; ``6k`` more bytes per block).

    ``topology``: gather over the world in two stages that follow the nodes (instead of
    one all-gather over ``group``, which must then be None): first across nodes among the
    ranks of equal local index, then inside the node, each rank passing on the ``N``
    buffers it received. Every buffer crosses the node links once per other node:
    ``N - 1`` buffers per rank, where a ring over the world carries up to ``W - 1``
    through each link between nodes (1.5x for 2 nodes of 2 ranks, almost ``L``x for
    large nodes). Same output, same ``rows`` (in world order), bit for bit. The stage
    inside the node is launched by the handle's ``advance()`` or by ``wait()``, once the
    stage across nodes has arrived. With one node or one rank per node it is the plain gather.

    Returns an :class:`AllGatherResult` (``output`` and the gathered packed rows, from
    which hpZ keeps a :class:`qcoll.comm.SecondaryShard`), or with ``async_op`` a handle
    whose ``wait()`` returns it. The collective keeps no state of its own.

    Ranks that disagree: each quantized buffer travels behind a 16-byte frame header
    (``bits``, ``block_size``, shard numel; docs/FORMAT.md "Frames"), and every rank
    checks all received headers before decoding, so a rank that passed a different
    shard size, ``bits`` or ``block_size`` makes every rank that received its buffer
    (and the rank itself) raise :class:`qcoll.comm.RankMismatchError`, in ``wait()``
    for async calls. Where the buffers' sizes differ, gloo aborts a rank that receives
    more bytes than it expects ("Received data size doesn't match expected size"); its
    peers then get the transport's error (with a note from qcoll) within the group's
    timeout. With ``bits=None`` the data goes straight into ``output`` unframed: on CPU
    a peer that sent a quantized frame is detected, a different shard size or dtype is
    not (only ``QCOLL_DEBUG=1`` compares those before communicating).
    """
    validate.check_tensor(output, "output")
    validate.check_tensor(input, "input", contiguous=False)
    validate.check_same(output, input, "output and input")
    validate.check_quant_args(bits, block_size)
    validate.check_async(async_op)
    validate.check_group(group)
    outliers = reserve.check_outliers(outliers, block_size)
    if outliers and bits is None:
        raise ValueError(f"outliers={outliers} needs quantized weights (bits is None)")
    if topology is not None:
        validate.check_topology(topology)
        if group is not None:
            raise ValueError(f"pass either group= or topology= (the world, gathered node by node), got both: "
                             f"group={group!r}, {topology!r}")
    size = dist.get_world_size(group)
    n = input.numel()
    if output.numel() != size * n:
        raise ValueError(
            f"output must have group size x input numel = {size} x {n} = {size * n} elements, got {output.numel()}"
        )
    validate.debug_check("all_gather", group, n, bits, block_size, input.dtype, input.device)
    src = input.contiguous()
    header = None if bits is None else framing.Header(bits, block_size, n, outliers=outliers)
    if header is None:
        wire = src.reshape(-1)
    else:
        wire = framing.frame(reserve.quantize_rows(src.reshape(1, -1), bits, block_size, outliers), header).reshape(-1)
    staged = topology is not None and topology.num_nodes > 1 and topology.ranks_per_node > 1
    gather = (_NodeByNode(output, wire, header, topology) if staged else _Flat(output, wire, header, group, size))
    receipt = _receipt(group)

    def complete():
        shards = gather.complete()
        if header is None:
            framing.check_unframed(output.view(torch.uint8).view(size, -1), receipt)
        else:
            payload = framing.unframe(shards, header, receipt)
            decode_into(payload, header, output.view(size, n))
        return AllGatherResult(output, shards, n, bits, block_size, input.dtype, group, outliers)

    return finish_with_result(complete, async_op, "qcoll::qwZ", gather.advance)


class _Flat:
    """One all-gather of every rank's ``wire`` buffer over ``group``."""

    def __init__(self, output, wire, header, group, size):
        self.output, self.wire, self.header, self.size, self.group = output, wire, header, size, group
        self.nbytes = wire.numel() * wire.element_size()
        self.recv = (output.view(-1) if header is None else
                     framing.receive_buffer(size, wire.numel(), wire.device).view(-1))
        hb = 0 if header is None else framing.header_bytes()
        stats.add("all_gather", group, (size - 1) * self.nbytes, (size - 1) * hb)
        self.work = all_gather_flat(self.recv, wire, group=group, async_op=True)

    def advance(self) -> None:
        pass

    def complete(self) -> torch.Tensor:
        """Wait; the gathered rows ``[size, ...]`` in group order."""
        wait_work(self.work, "all_gather", lambda: _sent(self.header, self.output.numel() // self.size, self.nbytes),
                  self.group)
        return self.recv.view(self.size, -1)


class _NodeByNode:
    """The world all-gather as two all-gathers: across nodes among the ranks of equal local
    index (``N`` buffers), then inside the node (``L x N``, laid out ``[local rank, node]``)."""

    def __init__(self, output, wire, header, topology: Topology):
        self.t, self.output, self.wire, self.header = topology, output, wire, header
        N = topology.num_nodes
        self.nbytes = wire.numel() * wire.element_size()
        self.hb = 0 if header is None else framing.header_bytes()
        self.across = (torch.empty(N * wire.numel(), dtype=wire.dtype, device=wire.device) if header is None else
                       framing.receive_buffer(N, wire.numel(), wire.device).view(-1))
        stats.add("all_gather", topology.inter_group, (N - 1) * self.nbytes, (N - 1) * self.hb)
        self.work_across = all_gather_flat(self.across, wire, group=topology.inter_group, async_op=True)
        self.inside = self.work_inside = None

    def _sent(self, stage: str) -> str:
        n = self.output.numel() // self.t.world_size
        return f"{_sent(self.header, n, self.nbytes)} ({stage})"

    def advance(self) -> None:
        """Launch the stage inside the node (after waiting for the stage across nodes)."""
        if self.work_inside is None:
            self._inside()

    def _inside(self) -> None:
        t = self.t
        wait_work(self.work_across, "all_gather (across nodes)", lambda: self._sent("the stage across nodes"),
                  self.t.inter_group)
        self.inside = torch.empty(t.ranks_per_node * self.across.numel(), dtype=self.wire.dtype,
                                  device=self.wire.device)
        stats.add("all_gather", t.intra_group, (t.ranks_per_node - 1) * t.num_nodes * self.nbytes,
                  (t.ranks_per_node - 1) * t.num_nodes * self.hb)
        self.work_inside = all_gather_flat(self.inside, self.across, group=t.intra_group, async_op=True)

    def complete(self) -> torch.Tensor:
        """Wait for both stages; the gathered rows ``[world, ...]`` in world order (written into
        ``output`` when unquantized)."""
        if self.work_inside is None:
            self._inside()
        wait_work(self.work_inside, "all_gather (inside the node)", lambda: self._sent("the stage inside the node"),
                  self.t.intra_group)
        N, L = self.t.num_nodes, self.t.ranks_per_node
        # inside[l, n] was sent by rank n * L + l: world order is [n, l]
        by_rank = self.inside.view(L, N, -1).transpose(0, 1)
        if self.header is None:
            out = self.output.view(N, L, -1)
            out.copy_(by_rank)
            return out.view(N * L, -1)
        return by_rank.reshape(N * L, -1)


def decode_into(payload: torch.Tensor, header: framing.Header, out: torch.Tensor) -> None:
    """Dequantize checked ``payload`` rows ``[k, bytes]`` into ``out`` ``[k, numel]``."""
    if header.outliers:
        out.copy_(reserve.dequantize_rows_fp32(payload, header.numel, header.bits, header.block_size,
                                               header.outliers))
    else:
        rows.dequantize_rows_into(payload, header.numel, header.bits, header.block_size, out)


def _receipt(group):
    """Builds, on a mismatch only, who sent each gathered frame (rows are the group's ranks in order)."""
    def build():
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return framing.Receipt("all_gather", dist.get_rank(), lambda i: ranks[i])
    return build


def _sent(header, n: int, nbytes: int) -> str:
    what = "an unquantized shard" if header is None else f"a frame ({header.describe()})"
    return f"{what} of {nbytes} bytes for {n} elements"


def all_gather_int8(output, input, block_size: int = fmt.DEFAULT_WEIGHT_BLOCK, group=None, async_op=False):
    """:func:`all_gather_quantized` with ``bits=8``."""
    return all_gather_quantized(output, input, 8, block_size, group, async_op)
