"""FSDP2's ``AllGather`` / ``ReduceScatter`` comm interfaces over qcoll's collectives.

FSDP2 (``torch.distributed.fsdp``) calls an ``AllGather`` with one parameter group's flat
all-gather input (this rank's shard of every parameter, concatenated in the group's order)
and the output ``[group size x input numel]``, and a ``ReduceScatter`` with the flat
gradient buffer in ``reduce_scatter_tensor``'s layout. These classes put qwZ and qgZ in
those two places; :func:`qcoll.fsdp.quantize_comm` installs them. Stateless between calls
apart from the parameter sizes they are built with, a reduce-scatter's error-feedback residuals,
and the reductions left in flight (:mod:`.overlap`), which both classes advance.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..comm import ErrorFeedback, Topology, all_gather_quantized, reduce_scatter_quantized
from ..comm import validate
from ..comm.c10d import reduce_scatter_flat
from ..comm.handle import wait_work
from ..comm.stats import stats
from ..quant import format as fmt
from .overlap import DeferredReductions, why_not_defer


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def spans_nodes(group, topology: Topology) -> bool:
    """Whether ``group`` has ranks on more than one node of ``topology``."""
    return len({topology.node_of(r) for r in group_ranks(group)}) > 1


def is_world(group, topology: Topology) -> bool:
    """Whether ``group`` is the whole world in rank order (the node-by-node collectives' group)."""
    return group_ranks(group) == list(range(topology.world_size))


class _Allocate:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain ``torch.empty`` (the caching allocator; FSDP2's default)."""
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Allocate, AllGather):
    """FSDP2's parameter all-gather as qwZ on the groups that span nodes.

    ``param_sizes``: the unsharded sizes of the parameter group's parameters, in FSDP2's
    order (``quantize_comm`` reads them from the group). Each parameter's shard is
    quantized on blocks of its own (no block straddles two parameters, as in
    ``qcoll.zero``'s aligned layout): each shard is placed at a multiple of ``block_size``
    in the wire buffer, so a shard's last block may be short. Without ``param_sizes`` the
    input is one run of blocks.

    A group that spans nodes is gathered with :func:`qcoll.all_gather_quantized` at
    ``bits`` (node by node when it is the whole world and the topology has several ranks
    per node). A group inside one node (hpZ's backward gather, after
    ``reshard_after_forward=<ranks per node>``) moves ``bits`` codes too
    (``quantize_inside``, default True), and the backward still sees the forward's weights
    bit for bit: the post-forward shard FSDP2 keeps is the forward's dequantized weight, and
    quantizing a dequantized block again with the same bits and block gives the same codes and
    scale. So each parameter's post-forward shard, which FSDP2 cuts from the forward's
    all-gather output (``N`` consecutive world shards, one per node), is sent as the forward's
    own blocks: each world shard on blocks of its own. ``quantize_inside=False`` gathers it
    unquantized. It runs on the topology's node group (:meth:`_inside`). Both go through
    qcoll's collectives, so ``qcoll.comm.stats`` counts them and frames check them.

    ``async_op`` calls complete before returning (FSDP2 then orders its copy-out on the
    all-gather stream, on which the collective ran). ``deferred``: the reductions in flight of
    the same ``quantize_comm`` (:class:`~qcoll.fsdp.overlap.DeferredReductions`), advanced
    first at each call.
    """

    def __init__(self, topology: Topology, bits: int = 8, block_size: int = fmt.DEFAULT_WEIGHT_BLOCK,
                 param_sizes: Sequence[torch.Size] | None = None, quantize_inside: bool = True,
                 deferred: DeferredReductions | None = None):
        validate.check_topology(topology)
        validate.check_quant_args(bits, block_size)
        if bits is None:
            raise ValueError("bits=None: leave FSDP2's own all-gather in place instead (quantize_comm(weight_bits=None))")
        self.topology, self.bits, self.block_size = topology, bits, block_size
        self.param_sizes = None if param_sizes is None else [torch.Size(s) for s in param_sizes]
        self.quantize_inside = quantize_inside
        self.deferred = deferred

    def __repr__(self) -> str:
        return f"QuantizedAllGather(bits={self.bits}, block_size={self.block_size}, {self.topology!r})"

    def shard_numels(self, group_size: int) -> list[int] | None:
        """Each parameter's shard numel on a group of ``group_size`` ranks (FSDP2 pads dim 0
        to a multiple of the group size), or None without ``param_sizes``."""
        if self.param_sizes is None:
            return None
        out = []
        for size in self.param_sizes:
            dim0 = size[0] if len(size) else 1
            rest = size[1:].numel() if len(size) else 1
            out.append(-(-dim0 // group_size) * rest)
        return out

    def _inside(self, group):
        """The group for a gather inside the node: the topology's node group when ``group`` (FSDP2's
        post-forward group of hpZ) has the node's ranks in the same order, else ``group``. FSDP2
        makes that group with torch's default timeout (30 minutes for gloo) whatever
        ``init_process_group`` was given; the topology's groups have the default group's, so a
        rank whose node-mate failed gives up there after the job's timeout instead."""
        t = self.topology
        node = list(range(t.node * t.ranks_per_node, (t.node + 1) * t.ranks_per_node))
        return t.intra_group if group_ranks(group) == node else group

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        if self.deferred is not None:
            self.deferred.advance()
        if not spans_nodes(group, self.topology):
            self._gather_inside(output_tensor, input_tensor, group)
            return None
        where = dict(topology=self.topology) if is_world(group, self.topology) else dict(group=group)
        size = len(group_ranks(group))
        layout = _AlignedLayout.build(self.shard_numels(size), input_tensor.numel(), self.block_size)
        if layout is None:
            all_gather_quantized(output_tensor, input_tensor, self.bits, self.block_size, **where)
            return None
        wire_out = torch.empty(size * layout.padded, dtype=output_tensor.dtype, device=output_tensor.device)
        all_gather_quantized(wire_out, layout.pack(input_tensor), self.bits, self.block_size, **where)
        layout.unpack(wire_out.view(size, -1), output_tensor.view(size, -1))
        return None


    def _gather_inside(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
        """hpZ's backward gather inside the node: each parameter's post-forward shard as the forward's
        blocks at ``bits`` (class docstring); unquantized with ``quantize_inside=False``."""
        size = len(group_ranks(group))
        inside = self._inside(group)
        if not self.quantize_inside or self.param_sizes is None or size == 1:
            all_gather_quantized(output_tensor, input_tensor, None, group=inside)
            return
        world = self.shard_numels(self.topology.world_size)
        layout = _AlignedLayout.build([n for n in world for _ in range(self.topology.world_size // size)],
                                      input_tensor.numel(), self.block_size, what="hpZ's post-forward shards")
        if layout is None:   # every world shard starts at a block already
            all_gather_quantized(output_tensor, input_tensor, self.bits, self.block_size, group=inside)
            return
        wire_out = torch.empty(size * layout.padded, dtype=output_tensor.dtype, device=output_tensor.device)
        all_gather_quantized(wire_out, layout.pack(input_tensor), self.bits, self.block_size, group=inside)
        layout.unpack(wire_out.view(size, -1), output_tensor.view(size, -1))


class _AlignedLayout:
    """Shards of ``numels`` elements, each placed at a multiple of the block size."""

    def __init__(self, numels: list[int], starts: list[int], padded: int):
        self.numels, self.starts, self.padded = numels, starts, padded

    @classmethod
    def build(cls, numels: list[int] | None, total: int, block_size: int,
              what: str = "the parameter group's shards") -> "_AlignedLayout | None":
        """The layout, or None when the plain input is already aligned (or no sizes are known)."""
        if numels is None:
            return None
        if sum(numels) != total:
            raise ValueError(f"the all-gather input has {total} elements, but {what} "
                             f"add up to {sum(numels)} ({numels}); quantize_comm supports FSDP2's default "
                             f"Shard(0) placement only (no shard_placement_fn, no fsdp_pre_all_gather "
                             f"tensor subclasses)")
        starts, at = [], 0
        for n in numels:
            starts.append(at)
            at += -(-n // block_size) * block_size
        if all(s % block_size == 0 for s in _prefix(numels)):
            return None
        return cls(numels, starts, at)

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.padded, dtype=flat.dtype, device=flat.device)
        for piece, start in zip(flat.split(self.numels), self.starts):
            out[start: start + piece.numel()].copy_(piece)
        return out

    def unpack(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """``wire`` ``[ranks, padded]`` -> ``out`` ``[ranks, sum(numels)]``."""
        at = 0
        for n, start in zip(self.numels, self.starts):
            out[:, at: at + n].copy_(wire[:, start: start + n])
            at += n


def _prefix(numels: list[int]) -> list[int]:
    """The offsets at which shards 1.. start in the plain concatenation."""
    out, at = [], 0
    for n in numels[:-1]:
        at += n
        out.append(at)
    return out


_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


def describe_op(op) -> str:
    """``ReduceOp.MAX``, ``ReduceOp.PREMUL_SUM (factor 0.5)``: a reduce op by its name (a ``ReduceOp``
    instance's repr is ``<... object at 0x...>``)."""
    kind = getattr(op, "op", op)              # a ReduceOp instance holds its RedOpType in .op
    name = getattr(kind, "name", None)
    if name is None:
        return repr(op)
    factor = getattr(op, "factor", None) if kind == dist.ReduceOp.PREMUL_SUM else None
    return f"ReduceOp.{name}" + (f" (factor {factor})" if factor is not None else "")


def reduce_op_name(op) -> str:
    """FSDP2's reduce op as qgZ's ``op``; a ``ValueError`` for the others."""
    for known, name in _OPS.items():
        if op == known:
            return name
    raise ValueError(f"qcoll's quantized gradient reduction supports ReduceOp.SUM and ReduceOp.AVG, got "
                     f"{describe_op(op)} "
                     f"(set_gradient_divide_factor makes FSDP2 pass PREMUL_SUM; leave it unset, or pass "
                     f"quantize_comm(grad_bits=None))")


class QuantizedReduceScatter(_Allocate, ReduceScatter):
    """FSDP2's gradient reduce-scatter as qgZ (quantized 2-hop all-to-all) over the world.

    ``bits``: one width for both hops, or ``(intra-node, inter-node)``; ``hadamard`` and
    ``stochastic`` as :func:`qcoll.reduce_scatter_quantized`. FSDP2's op ``AVG`` (its
    default for fp32 and bf16 gradients) divides by the world size, ``SUM`` does not.
    A group inside one node is reduced unquantized (``reduce_scatter_tensor``).
    ``error_feedback``: keep this module's qgZ residuals (``self.feedback``, a
    :class:`qcoll.ErrorFeedback`: fp32 of the module's whole gradient plus ``nodes / world`` of it);
    ``feedback_beta``: its ``beta`` (LoCo's moving average).
    ``deferred`` and ``param_group`` (FSDP2's ``FSDPParamGroup`` this reduce-scatter serves):
    a quantized reduction that FSDP2 only views afterwards returns after launching hop 1 and
    completes when the backward ends (:mod:`qcoll.fsdp.overlap`); without them, or where FSDP2
    reads the output at once, every call completes before it returns.
    """

    def __init__(self, topology: Topology, bits: int | tuple[int, int] = 4,
                 block_size: int = fmt.DEFAULT_GRAD_BLOCK, hadamard: bool = False, stochastic: bool = False,
                 error_feedback: bool = False, feedback_beta: float = 0.0,
                 deferred: DeferredReductions | None = None, param_group=None):
        validate.check_topology(topology)
        if validate.check_hop_bits(bits, block_size) is None:
            raise ValueError("bits=None: leave FSDP2's own reduce-scatter in place instead "
                             "(quantize_comm(grad_bits=None))")
        self.topology, self.bits, self.block_size = topology, bits, block_size
        self.hadamard, self.stochastic = hadamard, stochastic
        self.feedback = ErrorFeedback(beta=feedback_beta) if error_feedback else None
        if (deferred is None) != (param_group is None):
            raise ValueError("deferred and param_group go together: pass both (to defer reductions) or neither")
        self.deferred, self.param_group = deferred, param_group

    def __repr__(self) -> str:
        return f"QuantizedReduceScatter(bits={self.bits}, block_size={self.block_size}, {self.topology!r})"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        name = reduce_op_name(op)
        if not spans_nodes(group, self.topology):
            size = len(group_ranks(group))
            stats.add("reduce_scatter", group, input_tensor.numel() * input_tensor.element_size() * (size - 1) // size)
            work = reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=True)
            wait_work(work, "reduce_scatter", lambda: f"an unquantized input of {input_tensor.numel()} elements", group)
            return None
        if not is_world(group, self.topology):
            raise ValueError(f"qgZ reduces over the whole world; FSDP2 reduced over ranks {group_ranks(group)}, "
                             f"which spans nodes of {self.topology!r} but is not the world")
        defer = self.deferred is not None and why_not_defer(self.param_group, output_tensor, name) is None
        if self.deferred is not None:
            self.deferred.advance()
        handle = reduce_scatter_quantized(output_tensor, input_tensor, self.bits, self.block_size, self.topology,
                                          op=name, stochastic=self.stochastic, hadamard=self.hadamard,
                                          error_feedback=self.feedback, async_op=defer)
        if defer:
            self.deferred.add(handle)
        return None
