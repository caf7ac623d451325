"""qgZ: hierarchical quantized reduce-scatter (2-hop all-to-all) and its baseline."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..checks import check_bool, check_int
from .c10d import reduce_scatter_flat
from ..quant import format as fmt
from ..quant import outliers as reserve
from ..quant import rows
from ..quant.rng import rank_seed
from . import framing, similarity as sim, validate
from .error_feedback import ErrorFeedback
from .errors import RankMismatchError
from .handle import finish, labelled, wait_work
from .stats import stats
from .topology import Topology, current_topology

OPS = ("sum", "avg")


def _chunk_bounds(slice_len: int, block_size: int, num_chunks: int) -> list[tuple[int, int]]:
    """Cut ``[0, slice_len)`` into at most ``num_chunks`` pieces at multiples of ``block_size``."""
    nb = fmt.num_blocks(slice_len, block_size)
    k = max(1, min(num_chunks, nb))
    edges = [min(slice_len, (nb * i // k) * block_size) for i in range(k + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def all_to_all_frames(frames: torch.Tensor, group, peers: int):
    """Equal-split all-to-all of uint8 ``frames`` ``[peers, nbytes]`` (row ``j`` to peer ``j``);
    returns (recv ``[peers, nbytes]``, work). The split sizes are explicit so that gloo runs
    the same algorithm (alltoallv) as :func:`_poison_all_to_all` and the two can meet."""
    nbytes = frames.shape[1]
    recv = framing.receive_buffer(peers, nbytes, frames.device)
    stats.add("all_to_all", group, (peers - 1) * nbytes, (peers - 1) * framing.header_bytes())
    splits = [nbytes] * peers
    work = dist.all_to_all_single(recv.view(-1), frames.reshape(-1), splits, splits, group=group, async_op=True)
    return recv, work


def _poison_all_to_all(header: framing.Header, capacity: int, group, peers: int, me: int, device):
    """The all-to-all of a rank that received mismatching data: each peer gets the poisoned
    ``header`` alone (a short message, which gloo accepts; a longer one aborts the receiver),
    and each peer's frame is received into ``capacity`` bytes. Returns (recv, work)."""
    H = framing.HEADER_BYTES
    head = framing.header_tensor(header.poison(), device)
    send_splits = [H] * peers
    send_splits[me] = capacity             # gloo copies a rank's own part: its send and receive lengths agree
    send = torch.zeros(sum(send_splits), dtype=torch.uint8, device=device)
    for start in itertools.accumulate([0] + send_splits[:-1]):
        send[start: start + H] = head
    recv = framing.receive_buffer(peers, capacity, device)
    stats.add("all_to_all", group, (peers - 1) * H, (peers - 1) * H)
    work = dist.all_to_all_single(recv.view(-1), send, [capacity] * peers, send_splits, group=group, async_op=True)
    return recv, work


def _hop_receipt(topology: Topology, hop: int):
    """Who sent each received frame: hop 1 the node's ranks, hop 2 the ranks of equal local index."""
    def build():
        t = topology
        if hop == 1:
            return framing.Receipt("reduce_scatter (intra-node hop)", t.rank, lambda j: t.node * t.ranks_per_node + j,
                                   rows=t.num_nodes)
        return framing.Receipt("reduce_scatter (inter-node hop)", t.rank, lambda j: j * t.ranks_per_node + t.local_rank)
    return build


@labelled("qcoll::qgZ")
def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    bits: int | tuple[int, int] | None = 4,
    block_size: int = fmt.DEFAULT_GRAD_BLOCK,
    topology: Topology | None = None,
    op: str = "sum",
    stochastic: bool = False,
    seed: int = 0,
    num_chunks: int = 1,
    async_op: bool = False,
    similarity: torch.Tensor | None = None,
    hadamard: bool = False,
    outliers: int = 0,
    error_feedback: ErrorFeedback | None = None,
):
    """Reduce-scatter ``input`` over the world with quantized 2-hop all-to-all (qgZ).

    Output layout identical to ``dist.reduce_scatter_tensor``: rank ``r`` gets the
    reduction of slice ``r`` of every rank's ``input`` (``world * output.numel()``
    elements). Hop 1 all-to-all inside the node on ``bits``-bit codes of the
    reordered slices, a fp32 dequantize-reduce-requantize, hop 2 all-to-all
    between nodes among ranks of equal local index, then a final fp32 reduction.
    ``bits=(intra, inter)`` sets each hop's width: hop 1 sends ``intra``-bit codes, the
    partial sums are requantized to ``inter`` bits for hop 2 (with one rank per node
    only hop 2 runs, at ``inter``; with one node only hop 1, at ``intra``). An int is both.
    ``op="avg"`` divides by the world size. ``hadamard=True`` rotates every full block of
    each destination slice with the orthonormal Walsh-Hadamard matrix before the first
    quantization and rotates the reduced slice back (docs/FORMAT.md "Rotation"): the
    blocks' outliers are spread, so their scales shrink; the frames say so (a rank that
    disagrees raises). Needs ``bits``. ``outliers=k`` (1 to 8) keeps each block's ``k``
    largest-magnitude values exactly beside the codes, in both hops (docs/FORMAT.md
    "Outlier reserve"): ``6k`` more bytes per block; not with ``similarity``. ``num_chunks > 1`` pipelines hop 2 of
    chunk ``k`` with hop 1 of chunk ``k+1`` (bit-identical results). The call launches hop 1;
    with ``async_op`` the handle's ``advance()`` launches hop 2 once hop 1 has arrived (else
    ``wait()`` does), so a caller that advances it after some work of its own (the ZeRO
    layer, at its next hook) does not wait for hop 1 at the launch. ``bits=None``
    is the unquantized ``reduce_scatter_tensor`` baseline over the world.
    ``stochastic`` rounds stochastically with ``seed`` mixed with the rank.

    ``error_feedback``: this gradient's :class:`qcoll.comm.ErrorFeedback`, held by the caller
    and passed on every call for it. Hop 1 quantizes ``input`` plus what it failed to send last
    time (a residual of the input's size), hop 2 the node's partial sums plus its own residual
    (``N x S``), and each keeps what its codes lost; the final reduction is unchanged. Over
    calls, the outputs sum to the exact sums within one call's rounding (what makes 2-bit
    gradients usable). Not with ``similarity`` or ``outliers``; every rank passes one or none.

    ``similarity``: a float64 accumulator of 5 values (``qcoll.comm.similarity.new_stats()``)
    to which this rank adds, for its slice, the dot product and squared norms of the two
    halves of the contributions it reduces (the nodes' partial sums split into the first
    ``N // 2`` nodes and the rest; with one node, the local ranks' gradients) and each
    half's expected quantization-noise energy (docs/SIMILARITY.md). Summed over the world,
    they give the cosine of the two half-batch gradients (SimiGrad) at no extra traffic.
    With ``bits=None`` and ``similarity`` the reduction runs as an unquantized 2-hop
    all-to-all (the same sum, possibly rounded in another order) instead of
    ``reduce_scatter_tensor``.

    Ranks that disagree: what each hop sends to one peer travels behind a 16-byte
    frame header (``bits``, ``block_size``, the chunk's slice length; docs/FORMAT.md
    "Frames"), checked on receipt before decoding. A rank whose hop-1 frames disagree
    with its arguments still takes part in hop 2, sending frames marked poisoned, so
    every rank raises :class:`qcoll.comm.RankMismatchError` promptly (in ``wait()``
    for async calls): the ranks that received mismatching frames name the peer and
    both values, the others name the rank that passed the poison on. Where the
    buffers' sizes differ gloo aborts a rank that receives more bytes than it
    expects, and its peers get the transport's error within the group's timeout.
    The frames also carry ``op``: a rank that averages where its peers sum raises like one
    that passed other ``bits``. ``bits=None`` (``reduce_scatter_tensor``) is not checked
    across ranks (only by ``QCOLL_DEBUG=1``, which compares ``op`` too); ``stochastic`` and
    ``seed`` only act locally.
    """
    topology = topology if topology is not None else current_topology()
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a qcoll Topology (none was constructed yet), got {topology!r}")
    topology.check_live()
    validate.check_tensor(output, "output")
    validate.check_tensor(input, "input", contiguous=False)
    validate.check_same(output, input, "output and input")
    hop_bits = validate.check_hop_bits(bits, block_size)
    validate.check_async(async_op)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    check_int(num_chunks, "num_chunks", minimum=1)
    check_bool(stochastic, "stochastic")
    check_bool(hadamard, "hadamard")
    if hadamard and bits is None:
        raise ValueError("hadamard=True needs quantized gradients (bits is None)")
    outliers = reserve.check_outliers(outliers, block_size)
    if outliers and (bits is None or similarity is not None):
        raise ValueError(f"outliers={outliers} needs quantized gradients (bits is not None) and no similarity")
    fmt.check_seed(seed)
    W = topology.world_size
    S = output.numel()
    if input.numel() != W * S:
        raise ValueError(f"input must have world x output numel = {W} x {S} = {W * S} elements, got {input.numel()}")
    if similarity is not None:
        sim.check_stats(similarity, input.device)
    if error_feedback is not None:
        if not isinstance(error_feedback, ErrorFeedback):
            raise TypeError(f"error_feedback must be a qcoll ErrorFeedback or None, got "
                            f"{type(error_feedback).__name__}")
        if bits is None or similarity is not None or outliers:
            raise ValueError(f"error_feedback needs quantized gradients without similarity or outliers, got "
                             f"bits={bits}, similarity={'set' if similarity is not None else None}, "
                             f"outliers={outliers}")
        error_feedback.bind(W * S, W, input.device, collective="reduce_scatter", nodes=topology.num_nodes)
        error_feedback.calls += 1
    validate.debug_check("reduce_scatter", None, S, bits, block_size, input.dtype, input.device, reduce_op=op)
    if bits is None and similarity is not None:
        return _plain_two_hop(output, input, topology, op == "avg", similarity, async_op)
    if bits is None:
        return _baseline(output, input, W, op, async_op)
    if hadamard:
        input = rows.hadamard_rows(input.reshape(W, S), block_size)
    call = _Qgz(output, input, hop_bits, block_size, topology, op == "avg", stochastic, seed, num_chunks, similarity,
                hadamard, outliers, error_feedback)
    return finish(call.complete, async_op, "qcoll::qgZ", call.advance)


class _Qgz:
    """One quantized reduce-scatter: hop 1 of every chunk launched on construction, hop 2 by
    :meth:`advance` (the handle's ``advance()``, or :meth:`complete`), finished by :meth:`complete`.

    A hop whose frames disagree with this rank's arguments is recorded in ``failures``;
    every remaining hop still runs (hop 2 sends poisoned frames for a failed hop 1), so
    no peer is left waiting, and :meth:`complete` raises the first failure.
    """

    def __init__(self, output, input, hop_bits, block_size, topology, average, stochastic, seed, num_chunks,
                 similarity=None, rotated=False, outliers=0, error_feedback=None):
        self.t, self.block_size, self.average, self.rotated = topology, block_size, average, rotated
        self.ef = error_feedback
        self.k = outliers
        self.similarity = similarity
        self.stochastic = stochastic
        self.seed = rank_seed(seed, topology.rank) if stochastic else 0
        self.N, self.L = topology.num_nodes, topology.ranks_per_node
        intra, inter = hop_bits
        # the codes' width before and after the requantization between the hops (a hop that
        # does not run, with one rank per node or one node, leaves one width for both)
        self.bits1 = intra if self.L > 1 else inter
        self.bits2 = inter if self.N > 1 else self.bits1
        self.output = output
        S = output.numel()
        self.x3 = input.reshape(self.N, self.L, S)
        self.chunks = _chunk_bounds(S, block_size, num_chunks)
        self.failures: list[RankMismatchError] = []
        self.receipt1, self.receipt2 = _hop_receipt(topology, 1), _hop_receipt(topology, 2)
        self.first = {k: self._hop1(k) for k in range(len(self.chunks))}
        self.second = {}

    def advance(self) -> None:
        """Launch hop 2 of every chunk (each after its hop 1 has arrived); hop 1 of every chunk
        went out at the launch, so hop 2 of chunk ``k`` overlaps hop 1 of chunk ``k+1``."""
        for k in range(len(self.chunks)):
            if k not in self.second:
                self.second[k] = self._hop2(k)

    def _header(self, k: int, hop: int) -> framing.Header:
        a, b = self.chunks[k]
        return framing.Header(self.bits1 if hop == 1 else self.bits2, self.block_size, b - a, rotated=self.rotated,
                              outliers=self.k, average=self.average, error_feedback=self.ef is not None)

    def _hop1(self, k: int):
        """Reorder and quantize chunk ``k``, send each local peer its N slices; (recv, work)."""
        a, b = self.chunks[k]
        x = self.x3[:, :, a:b]
        if self.ef is not None:
            residual = self.ef.send.view(self.N, self.L, -1)[:, :, a:b]
            x = ErrorFeedback.compensate(x, residual)
        q1 = reserve.swizzle_quantize(x.contiguous(), self.N, self.L, self.bits1, self.block_size,
                                      self.k, self.stochastic, self.seed, a)
        if self.ef is not None:   # row l*N+n is slice (n, l): decode back into the input's order
            sent = rows.dequantize_rows(q1.view(self.L * self.N, -1), b - a, self.bits1, self.block_size,
                                        torch.float32).view(self.L, self.N, -1).transpose(0, 1)
            self.ef.keep(residual, x, sent)
        if self.L == 1:
            return q1.view(1, self.N, -1), None
        return all_to_all_frames(framing.frame(q1.view(self.L, -1), self._header(k, 1)), self.t.intra_group, self.L)

    def _received(self, k: int, hop: int, recv, work, shape):
        """The checked payload of a hop's frames in ``shape``, or None (recorded) when they disagree."""
        name = "reduce_scatter (intra-node hop)" if hop == 1 else "reduce_scatter (inter-node hop)"
        header = self._header(k, hop)
        wait_work(work, name, lambda: f"frames of {recv.shape[1]} bytes ({header.describe()})",
                  self.t.intra_group if hop == 1 else self.t.inter_group)
        try:
            return framing.unframe(recv, header, self.receipt1 if hop == 1 else self.receipt2).view(*shape)
        except RankMismatchError as e:
            self.failures.append(e)
            return None

    def _hop2(self, k: int):
        """Reduce chunk ``k``'s node partial sums, requantize, send each node its slice; (recv, work)."""
        recv1, work1 = self.first[k]
        got = recv1 if work1 is None else self._received(k, 1, recv1, work1, (self.L, self.N, -1))
        if self.N == 1:
            return got, None
        a, b = self.chunks[k]
        header = self._header(k, 2)
        if got is None:          # pass the failure on instead of leaving the other nodes waiting
            return self._poison(header)
        if self.L == 1:
            q2 = got[0]
        else:
            if self.similarity is not None:  # hop 1's noise is all in this node's partial sums
                received = got.reshape(-1, got.shape[-1])
                values = rows.dequantize_rows(received, b - a, self.bits1, self.block_size, torch.float32)
                energy = sim.noise_energy(received, values, self.bits1, self.block_size, self.stochastic)
                sim.add_half_noise(self.similarity, energy, self.t.node < sim.half_split(self.N))
            if self.ef is None:
                q2 = reserve.reduce_requantize(got, b - a, self.bits1, self.bits2, self.block_size, self.k,
                                               self.stochastic, self.seed, a)
            else:   # the node's partial sums plus what hop 2 failed to send last time
                residual = self.ef.own.view(self.N, -1)[:, a:b]
                partial = ErrorFeedback.compensate(rows.dequantize_reduce(got, b - a, self.bits1, self.block_size),
                                                   residual)
                q2 = rows.quantize_rows(partial, self.bits2, self.block_size, self.stochastic, self.seed, a)
                self.ef.keep(residual, partial, rows.dequantize_rows(q2, b - a, self.bits2, self.block_size,
                                                                     torch.float32))
        return all_to_all_frames(framing.frame(q2.view(self.N, -1), header), self.t.inter_group, self.N)

    def _poison(self, header: framing.Header):
        """Hop 2 after a hop-1 mismatch: poisoned headers out; peers' frames received into room
        for this rank's frame or for one with the disagreeing sender's arguments, whichever is larger."""
        capacity = framing.HEADER_BYTES + header.payload_nbytes()
        other = self.failures[-1].got
        if other is not None:
            capacity = max(capacity, framing.HEADER_BYTES + other.payload_nbytes())
        return _poison_all_to_all(header, capacity, self.t.inter_group, self.N, self.t.node, self.output.device)

    def complete(self):
        """Wait for every hop, reduce each chunk into the output; raise the first mismatch."""
        self.advance()
        # rotated: reduce into fp32, rotate back, then round once to the output's dtype
        out_flat = self.output.view(-1) if not self.rotated else torch.empty(
            self.output.numel(), dtype=torch.float32, device=self.output.device)
        for k, (a, b) in enumerate(self.chunks):
            recv, work = self.second[k]
            got = recv if work is None else self._received(k, 2, recv, work, (self.N, 1, -1))
            if self.failures:
                continue         # keep waiting for every hop, decode nothing
            if self.similarity is not None:
                self._measure(got, b - a)
            total = reserve.dequantize_reduce(got, b - a, self.bits2, self.block_size, self.k)[0]
            if self.average:
                total = total / self.t.world_size
            out_flat[a:b].copy_(total)
        if self.failures:
            raise self.failures[0]
        if self.rotated:  # the sum of rotated slices is the rotated sum: rotate it back
            self.output.view(1, -1).copy_(rows.hadamard_rows(out_flat.view(1, -1), self.block_size))
        return self.output


    def _measure(self, got: torch.Tensor, n: int) -> None:
        """Add this chunk's similarity statistics: the received contributions ``[K, 1, frame]``
        (node partial sums, or with one node the local ranks' slices) split in two halves."""
        contributions = got.reshape(got.shape[0], -1)
        half = sim.half_split(contributions.shape[0])
        parts = rows.dequantize_rows(contributions, n, self.bits2, self.block_size, torch.float32)
        sim.add_parts(self.similarity, parts, half)
        sim.add_noise(self.similarity, sim.noise_energy(contributions, parts, self.bits2, self.block_size,
                                                        self.stochastic), half)


def _plain_two_hop(output, input, topology: Topology, average: bool, similarity: torch.Tensor, async_op):
    """The unquantized reduce-scatter as qgZ's 2-hop all-to-all, measuring the similarity of
    the halves of the contributions of the final reduction (as :class:`_Qgz` does)."""
    t = topology
    N, L, S = t.num_nodes, t.ranks_per_node, output.numel()
    x = input.reshape(N, L, S)
    if L > 1:  # to local peer l: the N slices of the ranks (n, l)
        send = x.transpose(0, 1).contiguous()
        hop1 = torch.empty_like(send)
        stats.add("all_to_all", t.intra_group, (L - 1) * N * S * send.element_size())
        dist.all_to_all_single(hop1.view(-1), send.view(-1), group=t.intra_group)
        parts = hop1[:, 0] if N == 1 else hop1.sum(0)   # one node: the local ranks' slices
    else:
        parts = x[:, 0]
    if N > 1:  # to node n: the partial sums of its ranks' slices
        send = parts.contiguous()
        parts = torch.empty_like(send)
        stats.add("all_to_all", t.inter_group, (N - 1) * S * send.element_size())
        dist.all_to_all_single(parts.view(-1), send.view(-1), group=t.inter_group)
    sim.add_parts(similarity, parts, sim.half_split(parts.shape[0]))
    total = parts[0].clone()
    for j in range(1, parts.shape[0]):
        total += parts[j]
    output.view(-1).copy_(total / t.world_size if average else total)
    return finish(lambda: output, async_op, "qcoll::qgZ")


def _baseline(output, input, world, op, async_op):
    src = input.contiguous().view(-1)
    stats.add("reduce_scatter", None, src.numel() * src.element_size() * (world - 1) // world)
    work = reduce_scatter_flat(output, src, group=None, async_op=True)

    def complete():
        wait_work(work, "reduce_scatter", lambda: f"an unquantized input of {src.numel()} elements")
        if op == "avg":
            output.div_(world)
        return output

    return finish(complete, async_op, "qcoll::qgZ")
