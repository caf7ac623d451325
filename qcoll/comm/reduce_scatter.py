"""qgZ: hierarchical quantized reduce-scatter (2-hop all-to-all) and its baseline."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import reduce_scatter_flat
from ..quant import format as fmt
from ..quant import rows
from ..quant.rng import rank_seed
from . import validate
from .handle import finish
from .stats import stats
from .topology import Topology, current_topology

OPS = ("sum", "avg")


def _chunk_bounds(slice_len: int, block_size: int, num_chunks: int) -> list[tuple[int, int]]:
    """Cut ``[0, slice_len)`` into at most ``num_chunks`` pieces at multiples of ``block_size``."""
    nb = fmt.num_blocks(slice_len, block_size)
    k = max(1, min(num_chunks, nb))
    edges = [min(slice_len, (nb * i // k) * block_size) for i in range(k + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _all_to_all(buf: torch.Tensor, group, peers: int):
    """Equal-split all-to-all of ``buf`` ``[peers, ...]``; returns (recv, work)."""
    recv = torch.empty_like(buf)
    nbytes = buf.numel() * buf.element_size()
    stats.add("all_to_all", group, nbytes * (peers - 1) // peers)
    work = dist.all_to_all_single(recv.view(-1), buf.reshape(-1), group=group, async_op=True)
    return recv, work


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    bits: int | None = 4,
    block_size: int = fmt.DEFAULT_GRAD_BLOCK,
    topology: Topology | None = None,
    op: str = "sum",
    stochastic: bool = False,
    seed: int = 0,
    num_chunks: int = 1,
    async_op: bool = False,
):
    """Reduce-scatter ``input`` over the world with quantized 2-hop all-to-all (qgZ).

    Output layout identical to ``dist.reduce_scatter_tensor``: rank ``r`` gets the
    reduction of slice ``r`` of every rank's ``input`` (``world * output.numel()``
    elements). Hop 1 all-to-all inside the node on ``bits``-bit codes of the
    reordered slices, a fp32 dequantize-reduce-requantize, hop 2 all-to-all
    between nodes among ranks of equal local index, then a final fp32 reduction.
    ``op="avg"`` divides by the world size. ``num_chunks > 1`` pipelines hop 2 of
    chunk ``k`` with hop 1 of chunk ``k+1`` (bit-identical results). ``bits=None``
    is the unquantized ``reduce_scatter_tensor`` baseline over the world.
    ``stochastic`` rounds stochastically with ``seed`` mixed with the rank.
    """
    topology = topology if topology is not None else current_topology()
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a qcoll Topology (none was constructed yet), got {topology!r}")
    validate.check_tensor(output, "output")
    validate.check_tensor(input, "input", contiguous=False)
    validate.check_same(output, input, "output and input")
    validate.check_quant_args(bits, block_size)
    validate.check_async(async_op)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be a bool, got {stochastic!r}")
    fmt.check_seed(seed)
    W, N, L = topology.world_size, topology.num_nodes, topology.ranks_per_node
    S = output.numel()
    if input.numel() != W * S:
        raise ValueError(f"input must have world x output numel = {W} x {S} = {W * S} elements, got {input.numel()}")
    validate.debug_check("reduce_scatter", None, S, bits, block_size, input.dtype, input.device)
    if bits is None:
        return _baseline(output, input, W, op, async_op)
    my_seed = rank_seed(seed, topology.rank) if stochastic else 0
    x3 = input.reshape(N, L, S)
    out_flat = output.view(-1)
    chunks = _chunk_bounds(S, block_size, num_chunks)

    def hop1(a, b):
        w = b - a
        q1 = rows.swizzle_quantize(x3[:, :, a:b].contiguous(), N, L, bits, block_size, stochastic, my_seed, a)
        q1 = q1.view(L, N, -1)
        if L == 1:
            return q1, None
        return _all_to_all(q1, topology.intra_group, L)

    def hop2(k):
        a, b = chunks[k]
        recv1, work1 = pending[k]
        if work1 is not None:
            work1.wait()
        if N == 1:
            return recv1, None
        if L == 1:
            q2 = recv1[0]
        else:
            q2 = rows.reduce_requantize(recv1, b - a, bits, block_size, bits, block_size, stochastic, my_seed, a)
        return _all_to_all(q2.view(N, 1, -1), topology.inter_group, N)

    pending = {0: hop1(*chunks[0])} if chunks else {}
    second = {}
    for k in range(len(chunks)):
        if k + 1 < len(chunks):
            pending[k + 1] = hop1(*chunks[k + 1])
        second[k] = hop2(k)

    def complete():
        for k, (a, b) in enumerate(chunks):
            recv, work = second[k]
            if work is not None:
                work.wait()
            total = rows.dequantize_reduce(recv, b - a, bits, block_size)[0]
            if op == "avg":
                total = total / W
            out_flat[a:b].copy_(total)
        return output

    return finish(complete, async_op)


def _baseline(output, input, world, op, async_op):
    src = input.contiguous().view(-1)
    stats.add("reduce_scatter", None, src.numel() * src.element_size() * (world - 1) // world)
    work = reduce_scatter_flat(output, src, group=None, async_op=True)

    def complete():
        work.wait()
        if op == "avg":
            output.div_(world)
        return output

    return finish(complete, async_op)
