"""``FlatGroup``: some parameters of one unit, flattened into one buffer and sharded.

Layout (block-aligned, DESIGN.md): the parameters are laid out row-major in
registration order, each starting at a multiple of ``align`` (the weight block size
when weights are quantized, else 1), in a buffer of ``world * S`` elements where the
shard size ``S`` is a whole number of ``align`` blocks. Rank ``r`` owns elements
``[r*S, (r+1)*S)``. So no quantization block of the forward's qwZ gather mixes two
parameters (a LayerNorm gain near 1.0 beside a weight matrix near 0.02 would make the
small weights round to zero at 4 bits), and each parameter's codes are a whole number
of blocks that can be exported as the forward used them. The padding between
parameters and at the end is zero and stays zero (its gradient is 0); the memory
report counts it.

Checkpoints do not see the padding: :meth:`FlatGroup.compact_shard` gives this rank's
slice of the *compact* layout (the parameters concatenated without gaps, ``total``
elements, ``ceil(total / world)`` per rank, exactly a 1-D DTensor ``Shard(0)``), and
:meth:`FlatGroup.shard_from_compact` goes back, so a checkpoint written by one world
size (or block size) loads into another.

The module's parameters keep their identity (tied weights, user references). While
the group is gathered their ``.data`` are views into ``full``, a ``world * S`` buffer
in the compute dtype; otherwise ``full``'s storage is resized to 0 and each
parameter's ``.data`` is an empty tensor (numel 0, the compute dtype, the device), as
FSDP's ``use_orig_params`` does: reading a released parameter gives an empty tensor
or a shape error, never memory that is gone. A parameter keeps its own version counter
across ``.data`` swaps (the gathers write through ``full``, never through the
parameter), so autograd's saved parameters and views of them, in eager and compiled
graphs alike, see the values again once the backward pass has gathered the group.

The group's schedule state is explicit (:mod:`qcoll.zero.group_state`): ``gather_state``
(released / gathering / gathered) and ``grad_state`` (idle / held for backward /
reducing), changed only by the transitions below, each asserting where it starts from.
The engine calls only those. The group also holds its hpZ secondary shard (the node's
rows of its last forward gather, a :class:`qcoll.comm.SecondaryShard`) while a backward
or generation mode needs it; the collectives keep no state of their own. A *pinned* group
(:meth:`FlatGroup.pin`: generation mode's cache, gradient accumulation with
``reshard_after_backward=False``) stays gathered across forwards and backwards until it is
unpinned; the pin remembers the master's version, so the engine can tell when the kept
weights went stale (an optimizer step) and gather them again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import (ErrorFeedback, SecondaryShard, Topology, all_gather_quantized, reduce_scatter_quantized,
                    replica_gather)
from ..comm.handle import Handle
from .grad_feedback import bucket_feedback, split_feedback
from . import user_grads
from .config import ZeroConfig
from .group_state import GatherState, GradState, assert_in


class FlatGroup:
    #: whether every rank holds all of the group (:class:`~qcoll.zero.replicated.ReplicatedGroup`)
    replicated = False

    def __init__(self, name: str, index: int, params: list[tuple[str, nn.Parameter]], topology: Topology,
                 config: ZeroConfig, sync_module_states: bool):
        self.name = name
        self.index = index
        self.topology = topology
        self.config = config
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [p.shape for p in self.params]
        self.orig_dtypes = [p.dtype for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.total = sum(self.numels)
        self.align = config.weight_block if config.weight_bits is not None and not self.replicated else 1
        self.offsets = _aligned_offsets(self.numels, self.align)
        # the layout's world: the ranks the buffer is split over (1 for a replicated group)
        W, r = (1, 0) if self.replicated else (topology.world_size, topology.rank)
        end = self.offsets[-1] + self.numels[-1] if self.params else 0
        self.shard_numel = _round_up(-(-end // W), self.align)
        #: this rank's slice of the compact layout (no padding): what checkpoints hold
        self.compact_shard_numel = -(-self.total // topology.world_size)
        self.local_numel = max(0, min(self.compact_shard_numel, self.total - topology.rank * self.compact_shard_numel))
        full = torch.zeros(W * self.shard_numel, dtype=torch.float32, device=self.params[0].device)
        for i, (p, off, n) in enumerate(zip(self.params, self.offsets, self.numels)):
            full[off:off + n].copy_(p.detach().reshape(-1))
            p.ds_numel, p.ds_shape = n, self.shapes[i]  # an empty parameter's full size: DeepSpeed's names (PEFT reads them)
            setattr(p, user_grads.SLOT_ATTR, (self, i))
        if sync_module_states and topology.world_size > 1:
            dist.broadcast(full, src=0)
        S = self.shard_numel
        self.master = nn.Parameter(full[r * S:(r + 1) * S].clone(), requires_grad=self.trainable)
        del full
        self.full = torch.empty(W * S, dtype=config.dtype, device=self.master.device)
        self.views = [self.full[off:off + n].view(shape)
                      for off, n, shape in zip(self.offsets, self.numels, self.shapes)]
        self.released = self.full.new_empty(0)
        self._free_storage()
        self.gather_state = GatherState.RELEASED
        self.grad_state = GradState.IDLE
        #: the hpZ secondary shard kept from the last forward gather (None: none held)
        self.secondary: SecondaryShard | None = None
        #: generation mode: forwards keep the secondary shard (without gradients, frozen groups
        #: too) and, once kept, gather from it inside the node as backward does
        self.hold_secondary = False
        #: pinned (kept gathered across forwards): the master's ``_version`` when pinned; None: not pinned
        self.pinned_version: int | None = None
        self._pending = None         # GATHERING: the gather's handle
        self._keep_gathered = False  # GATHERING: keep a secondary shard from it
        self._forward_users = 0      # units currently running forward with this group
        self._grads_ready = 0        # parameters whose gradient this backward has accumulated
        self.engine = None           # the Engine that schedules this group (set by it)
        #: parameter index -> the ShardedGrad its .grad holds after a backward (qcoll.zero.user_grads)
        self.proxies = {}
        #: parameter index -> whether it had a gradient, while a torch optimizer steps its shard
        self.exposed = {}
        #: qgZ's residuals of this group's gradient (``config.grad_error_feedback``; bound at the
        #: first reduction)
        self.grad_feedback: ErrorFeedback | None = (
            ErrorFeedback(device=self.master.device, beta=config.grad_feedback_beta)
            if config.grad_error_feedback and not self.replicated else None)

    @property
    def trainable(self) -> bool:
        """Whether any parameter requires a gradient now (``requires_grad`` changes after
        :func:`~qcoll.zero.shard`, e.g. PEFT freezing the base model, are honoured)."""
        return any(p.requires_grad for p in self.params)

    # ------------------------------------------------------------------ this rank's slices
    def local_range(self, i: int) -> tuple[int, int]:
        """``[a, b)``: where this rank's elements of parameter ``i`` lie in ``master`` (empty
        when the parameter has none here)."""
        start = self.topology.rank * self.shard_numel
        off, n = self.offsets[i], self.numels[i]
        a = min(max(off - start, 0), self.shard_numel)
        return a, max(a, min(off + n - start, self.shard_numel))

    def master_slice(self, i: int) -> torch.Tensor:
        """This rank's elements of parameter ``i``: a 1-D fp32 view of the master shard."""
        a, b = self.local_range(i)
        return self.master.detach()[a:b]

    def grad_slice(self, i: int) -> torch.Tensor:
        """This rank's elements of parameter ``i``'s reduced gradient: a 1-D view of ``master.grad``."""
        a, b = self.local_range(i)
        return self.master.grad[a:b]

    # ------------------------------------------------------------------ storage
    def _alloc_storage(self) -> None:
        nbytes = self.full.numel() * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)
        for p, view in zip(self.params, self.views):
            p.data = view

    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self.released

    def current_data(self, i: int) -> torch.Tensor:
        """What parameter ``i``'s ``.data`` is in the group's gather state: its view of ``full``
        while gathering or gathered, else the empty tensor."""
        return self.released if self.gather_state is GatherState.RELEASED else self.views[i]

    def master_changed(self) -> None:
        """The master was changed from outside the group (a torch optimizer's step on its
        slices): nothing to refresh here (a replicated group copies it again)."""

    def gathered_nbytes(self) -> int:
        """Bytes of full parameters this group holds now (in flight or gathered)."""
        return self.full.untyped_storage().nbytes()

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full parameters when gathered (what pinning the group costs)."""
        return self.full.numel() * self.full.element_size()

    # ------------------------------------------------------------------ gather transitions
    def unshard(self, backward: bool) -> None:
        """RELEASED -> GATHERING: launch the async gather of the full parameters (a no-op when
        gathering or gathered). ``backward`` (or generation mode) gathers from the hpZ secondary
        shard inside the node when one is held, else qwZ across the world."""
        if self.gather_state is not GatherState.RELEASED:
            return
        self._alloc_storage()
        self.gather_state = GatherState.GATHERING
        if (backward or self.hold_secondary) and self.secondary is not None:
            self._pending, self._keep_gathered = replica_gather(self.full, self.secondary, async_op=True), False
            return
        src = self.master.detach()
        if src.dtype != self.full.dtype:
            src = src.to(self.full.dtype)
        self._keep_gathered = self.config.hpz and not backward and not self.pinned and (
            self.hold_secondary or (torch.is_grad_enabled() and self.trainable))
        self._pending = all_gather_quantized(self.full, src, bits=self.config.weight_bits,
                                             block_size=self.config.weight_block, async_op=True,
                                             outliers=self.config.weight_outliers,
                                             topology=self.topology if self.config.hierarchical_gather else None)

    def wait_for_unshard(self) -> None:
        """GATHERING -> GATHERED (a no-op when gathered): wait for the gather; a forward
        gather that keeps the hpZ secondary shard takes its node's rows now."""
        if self.gather_state is GatherState.GATHERED:
            return
        assert_in(self.gather_state, (GatherState.GATHERING,), "wait_for_unshard", self.name)
        pending, self._pending = self._pending, None
        try:
            result = pending.wait()
        except BaseException:  # a failed gather (ranks disagree, transport): nothing valid is held
            self._keep_gathered = False
            self._free_storage()
            self.gather_state = GatherState.RELEASED
            raise
        if self._keep_gathered:
            self.secondary = SecondaryShard.keep(result, self.topology)
            self._keep_gathered = False
        self.gather_state = GatherState.GATHERED

    def advance(self) -> None:
        """Launch the next stage of a gather in flight (its handle's ``advance()``: the
        hierarchical gather's stage inside the node, once the stage across nodes has arrived).
        The engine calls it at its hooks, in the same order on every rank."""
        if self._pending is not None:
            self._pending.advance()

    def gather_now(self, backward: bool) -> None:
        """Any gather state -> GATHERED: :meth:`unshard` and :meth:`wait_for_unshard`."""
        self.unshard(backward)
        self.wait_for_unshard()

    def reshard(self) -> None:
        """-> RELEASED, unless a running forward or a held backward still needs the full
        parameters, or the group is pinned (then nothing changes). A gather in flight is
        completed first."""
        if self._forward_users or self.grad_state is GradState.HELD or self.pinned:
            return
        if self.gather_state is GatherState.GATHERING:
            self.wait_for_unshard()
        if self.gather_state is GatherState.GATHERED:
            self._free_storage()
            self.gather_state = GatherState.RELEASED

    # ------------------------------------------------------------------ pinning
    @property
    def pinned(self) -> bool:
        """Whether the group is kept gathered across forwards (:meth:`pin`)."""
        return self.pinned_version is not None

    def pin(self) -> None:
        """Keep the full parameters once gathered (the next gather, or the one held now) across
        forwards and backwards, until :meth:`unpin`; no hpZ secondary shard is kept meanwhile."""
        assert not self.pinned, f"qcoll.zero: group {self.name!r}: pinned twice"
        self.pinned_version = self.master._version

    @property
    def pin_stale(self) -> bool:
        """Whether the group is pinned and its master changed since (the kept weights are old)."""
        return self.pinned and self.pinned_version != self.master._version

    def unpin(self, reshard: bool = True) -> None:
        """Stop keeping the full parameters; ``reshard``: release them now unless a forward
        or backward holds them (else they go at that user's next :meth:`reshard`)."""
        self.pinned_version = None
        if reshard:
            self.reshard()

    # ------------------------------------------------------------------ forward uses
    def begin_forward_use(self) -> None:
        """A unit that needs this group starts its forward (the group stays gathered until it ends)."""
        self._forward_users += 1

    def end_forward_use(self) -> None:
        """That unit's forward ended: reshard unless another user or a backward still needs it."""
        assert self._forward_users > 0, f"qcoll.zero: group {self.name!r}: end_forward_use without a forward use"
        self._forward_users -= 1
        self.reshard()

    def clear_forward_uses(self) -> None:
        """A forward raised inside units that never ended: forget their uses and reshard."""
        self._forward_users = 0
        self.reshard()

    # ------------------------------------------------------------------ hpZ secondary shard
    def drop_secondary(self) -> None:
        """Free the kept hpZ secondary shard (if any)."""
        self.secondary = None

    def begin_generation(self) -> SecondaryShard | None:
        """Enter generation mode: keep secondaries from now on; returns the one held on entry
        (a pending backward's), set aside until :meth:`end_generation`."""
        assert not self.hold_secondary, f"qcoll.zero: group {self.name!r}: generation mode entered twice"
        set_aside, self.secondary = self.secondary, None
        self.hold_secondary = True
        return set_aside

    def end_generation(self, set_aside: SecondaryShard | None) -> None:
        """Leave generation mode: drop the secondary it kept and put back ``set_aside``."""
        self.hold_secondary = False
        self.secondary = set_aside

    # ------------------------------------------------------------------ gradient transitions
    @property
    def reducing(self) -> bool:
        """Whether this backward handed the group's gradients to the reduce-scatter already."""
        return self.grad_state is GradState.REDUCING

    def hold_for_backward(self) -> None:
        """IDLE/HELD -> HELD and gathered: a unit that uses the group starts its backward."""
        assert_in(self.grad_state, (GradState.IDLE, GradState.HELD), "hold_for_backward", self.name)
        user_grads.release(self)  # the parameters' .grad must be free for autograd to accumulate into
        self.grad_state = GradState.HELD
        self.gather_now(backward=True)

    def grad_ready(self) -> bool:
        """One parameter's gradient is accumulated; True when all of them are (IDLE/HELD)."""
        assert_in(self.grad_state, (GradState.IDLE, GradState.HELD), "grad_ready", self.name)
        self._grads_ready += 1
        # every parameter: while one is frozen, its backward may still read the group after the
        # others' gradients are in, and the group is reduced at the end of the backward instead
        return self._grads_ready == len(self.params)

    def take_grads(self) -> torch.Tensor:
        """IDLE/HELD -> REDUCING: flatten the parameters' gradients into a fp32 ``[world * S]``
        buffer of the group's layout (zeros where a parameter has none), drop them, drop the
        secondary shard and reshard. Returns the buffer for :func:`reduce_together`."""
        assert_in(self.grad_state, (GradState.IDLE, GradState.HELD), "take_grads", self.name)
        user_grads.release(self)
        flat = torch.zeros(self.topology.world_size * self.shard_numel, dtype=torch.float32, device=self.master.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                flat[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        self.grad_state = GradState.REDUCING
        self.drop_secondary()
        self.reshard()
        return flat

    def reduce_grads(self, seed: int, similarity: torch.Tensor | None = None):
        """IDLE/HELD -> REDUCING: :meth:`take_grads` and start their qgZ reduce-scatter alone.

        Returns ``(handle, shard)``: after ``handle.wait()``, ``shard`` holds this rank's
        slice of the world-averaged gradient (fp32) and ``similarity`` (if given) this
        slice's half-batch statistics added (see ``reduce_scatter_quantized``).
        """
        assert_in(self.grad_state, (GradState.IDLE, GradState.HELD), "reduce_grads", self.name)
        handle, (shard,) = reduce_together([self], [self.take_grads()], seed, similarity)
        return handle, shard

    def accumulate(self, shard: torch.Tensor) -> None:
        """Add a reduced gradient shard to the fp32 master's gradient."""
        if self.master.grad is None:
            self.master.grad = shard
        else:
            self.master.grad.add_(shard)

    def drop_param_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.proxies.clear()

    def end_backward(self) -> None:
        """Any grad state -> IDLE: the backward ended (its reductions are waited for); drop
        the secondary shard and reshard."""
        self.grad_state = GradState.IDLE
        self._grads_ready = 0
        self.drop_secondary()
        self.reshard()

    # ------------------------------------------------------------------ full values
    @property
    def padded(self) -> bool:
        """Whether the layout has gaps (or a tail) beyond the compact one."""
        return self.shard_numel != self.compact_shard_numel or self.offsets != _aligned_offsets(self.numels, 1)

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """All ranks' ``local`` (a ``[S]`` tensor in this layout, fp32) gathered unquantized:
        ``world * S`` elements on every rank (collective)."""
        out = torch.empty(self.topology.world_size * self.shard_numel, dtype=torch.float32, device=local.device)
        all_gather_quantized(out, local.detach().to(torch.float32), bits=None)
        return out

    def gather_full_fp32(self) -> torch.Tensor:
        """The exact (unquantized) fp32 master values in this layout (``world * S`` elements,
        parameter ``i`` at ``offsets[i]``), on every rank (collective)."""
        return self.gather_full(self.master)

    def load_full_fp32(self, full: torch.Tensor) -> None:
        """Set this rank's master shard from the full values in this layout (``world * S``, its
        padding zero, as :meth:`gather_full_fp32` gives it)."""
        r, S = self.topology.rank, self.shard_numel
        with torch.no_grad():
            self.master.copy_(full[r * S:(r + 1) * S])

    def local_param_numel(self) -> int:
        """Elements of this rank's shard that hold parameter values (the rest is padding)."""
        start = self.topology.rank * self.shard_numel
        end = start + self.shard_numel
        return sum(max(0, min(end, off + n) - max(start, off)) for off, n in zip(self.offsets, self.numels))

    def _compact_index(self, device) -> torch.Tensor:
        return torch.cat([torch.arange(off, off + n, device=device) for off, n in zip(self.offsets, self.numels)])

    def compact_shard(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's ``local_numel`` elements of the compact layout (fp32), from ``local``
        (``[S]``, this layout): no copy without padding, else a collective (all ranks call it)."""
        r, C = self.topology.rank, self.compact_shard_numel
        if not self.padded:
            return local[: self.local_numel]
        compact = self.gather_full(local)[self._compact_index(local.device)]
        return compact[r * C: r * C + self.local_numel].clone()

    def shard_from_compact(self, compact_local: torch.Tensor, out: torch.Tensor) -> None:
        """Inverse of :meth:`compact_shard`: write this rank's ``[S]`` slice of this layout into
        ``out`` from every rank's ``compact_local`` (collective when padded)."""
        r, S = self.topology.rank, self.shard_numel
        with torch.no_grad():
            out.zero_()
            if not self.padded:
                out[: self.local_numel].copy_(compact_local)
                return
            full = torch.zeros(self.topology.world_size * S, dtype=torch.float32, device=out.device)
            full[self._compact_index(out.device)] = self.gather_compact(compact_local)
            out.copy_(full[r * S:(r + 1) * S])

    def gather_compact(self, compact_local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``compact_local`` gathered: the group's ``total`` values in the compact
        layout (fp32, unquantized; collective)."""
        C = self.compact_shard_numel
        mine = torch.zeros(C, dtype=torch.float32, device=compact_local.device)
        mine[: self.local_numel].copy_(compact_local)
        every = torch.empty(self.topology.world_size * C, dtype=torch.float32, device=compact_local.device)
        all_gather_quantized(every, mine, bits=None)
        return every[: self.total]


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _aligned_offsets(numels: list[int], align: int) -> list[int]:
    """Where each parameter starts: right after the previous one, rounded up to ``align``."""
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos = _round_up(pos + n, align)
    return offsets


def reduce_together(groups: list[FlatGroup], flats: list[torch.Tensor], seed: int,
                    similarity: torch.Tensor | None = None):
    """Start one reduce-scatter (qgZ, or the unquantized baseline) of several groups' gradients
    (:meth:`FlatGroup.take_grads`; one config and topology). Rank ``r``'s slices of the groups are
    laid side by side, each starting at a multiple of the gradient block when quantized, so no
    quantization block mixes two groups and each group's result is the one a reduce-scatter of
    it alone would give (bit for bit with deterministic rounding and no rotation). Returns
    ``(handle, shards)``: after ``handle.wait()`` ``shards[i]`` is group ``i``'s slice (fp32)."""
    cfg, topology = groups[0].config, groups[0].topology
    W = topology.world_size
    device = groups[0].master.device
    if len(groups) == 1:
        rows, starts = flats[0], [0]
        width = groups[0].shard_numel
    else:
        align = cfg.grad_block if cfg.grad_bits is not None else 1
        starts, width = [], 0
        for g in groups:
            starts.append(width)
            width += _round_up(g.shard_numel, align)
        rows = torch.zeros(W, width, dtype=torch.float32, device=device)
        for g, flat, a in zip(groups, flats, starts):
            rows[:, a:a + g.shard_numel].copy_(flat.view(W, g.shard_numel))
    out = torch.empty(width, dtype=torch.float32, device=device)
    feedback = bucket_feedback(groups, starts, width) if cfg.grad_error_feedback else None
    handle = reduce_scatter_quantized(out, rows.reshape(-1), bits=cfg.grad_bits, block_size=cfg.grad_block,
                                      topology=topology, op="avg", stochastic=cfg.stochastic_grad_rounding,
                                      seed=seed if cfg.stochastic_grad_rounding else 0, async_op=True,
                                      similarity=similarity, hadamard=cfg.grad_hadamard, outliers=cfg.grad_outliers,
                                      error_feedback=feedback)
    if feedback is not None and len(groups) > 1:   # the bucket's residuals back into each group's
        inner = handle

        def complete():
            result = inner.wait()
            split_feedback(feedback, groups, starts, width)
            return result
        handle = Handle(complete, "qcoll::qgZ::wait", inner.advance)
    return handle, [out[a:a + g.shard_numel] for g, a in zip(groups, starts)]
