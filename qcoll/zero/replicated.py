"""``ReplicatedGroup``: the small parameters that every rank keeps whole (persistence).

DeepSpeed keeps parameters below ``stage3_param_persistence_threshold`` elements
unpartitioned, and FSDP leaves small or ignored parameters out of sharding: gathering a
LayerNorm gain costs a collective's latency for a few hundred bytes, twice a step. With
``ZeroConfig(persist_threshold=N)`` qcoll puts every parameter of fewer than ``N`` elements
into one group per kind (trainable, frozen) that is *replicated*: each rank holds the whole
fp32 master and its optimizer state, the parameters keep their values between forwards (a
local cast of the master, refreshed when the master changed), and the gradients of all of
them are averaged with one unquantized all-reduce per backward, launched when the last of
them is ready. Every rank then takes the same optimizer step on the same master (the
all-reduce gives every rank the same bytes), so the replicas never drift.

Checkpoints see the same compact layout as for a sharded group (each rank writes its slice
of the 1-D DTensor), so a checkpoint does not depend on the threshold it was saved with.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.stats import stats
from . import user_grads
from .flat import FlatGroup
from .group_state import GatherState, GradState, assert_in


class _AllReduce:
    """Completes the gradients' all-reduce: wait, then average."""

    def __init__(self, work, grad: torch.Tensor, world: int):
        self._work, self._grad, self._world = work, grad, world

    def advance(self) -> None:
        """One stage: nothing further to launch."""

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._grad.div_(self._world)
        return self._grad


class ReplicatedGroup(FlatGroup):
    """A :class:`FlatGroup` whose "shard" is the whole group on every rank."""

    replicated = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._copied_version = None
        self.unshard(backward=False)  # the parameters hold their values from the start

    # ------------------------------------------------------------------ gather: a local copy
    def unshard(self, backward: bool) -> None:
        """-> GATHERED: the parameters hold the master's values in the compute dtype (copied
        only when the master changed since the last copy; no communication)."""
        if self.gather_state is GatherState.RELEASED:
            self._alloc_storage()
        if self._copied_version != self.master._version or self.gather_state is GatherState.RELEASED:
            with torch.no_grad():
                self.full.copy_(self.master.detach())
            self._copied_version = self.master._version
        self.gather_state = GatherState.GATHERED

    def reshard(self) -> None:
        """Kept: a replicated group is never released."""

    def master_changed(self) -> None:
        """Copy the changed master into the parameters."""
        self.unshard(backward=False)

    def hold_for_backward(self) -> None:
        """As :meth:`FlatGroup.hold_for_backward`; a unit whose backward starts after the group's
        all-reduce (its parameters span units) finds it gathered and needs nothing."""
        if self.grad_state is not GradState.REDUCING:
            super().hold_for_backward()

    # ------------------------------------------------------------------ gradients: one all-reduce
    def reduce_grads(self, seed: int, similarity: torch.Tensor | None = None):
        """IDLE/HELD -> REDUCING: flatten the gradients and start their average over the world
        (unquantized all-reduce). Returns ``(handle, grad)`` as :meth:`FlatGroup.reduce_grads`."""
        assert_in(self.grad_state, (GradState.IDLE, GradState.HELD), "reduce_grads", self.name)
        user_grads.release(self)
        flat = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.master.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                flat[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        W = self.topology.world_size
        stats.add("all_reduce", None, 2 * (W - 1) * flat.numel() * flat.element_size() // W)
        work = dist.all_reduce(flat, async_op=True) if W > 1 else None
        self.grad_state = GradState.REDUCING
        return _AllReduce(work, flat, W), flat

    # ------------------------------------------------------------------ full values
    @property
    def padded(self) -> bool:
        return False

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` is already whole on every rank: a copy (no collective)."""
        return local.detach().to(torch.float32).clone()

    def load_full_fp32(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.master.copy_(full[: self.shard_numel])

    def local_param_numel(self) -> int:
        return self.total

    def local_range(self, i: int) -> tuple[int, int]:
        """Every rank holds all of parameter ``i``."""
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def compact_shard(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the compact layout (a view: every rank holds all of it)."""
        start = self.topology.rank * self.compact_shard_numel
        return local[start: start + self.local_numel]

    def shard_from_compact(self, compact_local: torch.Tensor, out: torch.Tensor) -> None:
        """The whole group into ``out`` from every rank's compact slice (collective)."""
        with torch.no_grad():
            out.copy_(self.gather_compact(compact_local))
