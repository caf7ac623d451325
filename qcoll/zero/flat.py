"""``FlatGroup``: some parameters of one unit, flattened into one buffer and sharded.

Layout: the parameters are concatenated (row-major, in registration order) into
``total`` elements; rank ``r`` owns elements ``[r*S, (r+1)*S)`` with
``S = ceil(total / world)``, which is exactly the layout of a 1-D DTensor
``Shard(0)`` of length ``total`` (so checkpoints reshard across world sizes).
The tail of the last shards is zero padding; it stays zero (its gradient is 0).

The module's parameters keep their identity (tied weights, user references). While
the group is gathered their ``.data`` are views into ``full``, a ``world * S`` buffer
in the compute dtype; otherwise ``full``'s storage is resized to 0 and each
parameter's ``.data`` is an empty tensor (numel 0, the compute dtype, the device), as
FSDP's ``use_orig_params`` does: reading a released parameter gives an empty tensor
or a shape error, never memory that is gone. A parameter keeps its own version counter
across ``.data`` swaps (the gathers write through ``full``, never through the
parameter), so autograd's saved parameters and views of them, in eager and compiled
graphs alike, see the values again once the backward pass has gathered the group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import SecondaryShard, Topology, all_gather_quantized, reduce_scatter_quantized, replica_gather
from .config import ZeroConfig


class FlatGroup:
    def __init__(self, name: str, index: int, params: list[tuple[str, nn.Parameter]], topology: Topology,
                 config: ZeroConfig, sync_module_states: bool):
        self.name = name
        self.index = index
        self.topology = topology
        self.config = config
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.trainable = any(p.requires_grad for p in self.params)
        self.shapes = [p.shape for p in self.params]
        self.orig_dtypes = [p.dtype for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.total = sum(self.numels)
        W = topology.world_size
        self.shard_numel = -(-self.total // W)
        self.local_numel = max(0, min(self.shard_numel, self.total - topology.rank * self.shard_numel))
        full = torch.zeros(W * self.shard_numel, dtype=torch.float32, device=self.params[0].device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            full[off:off + n].copy_(p.detach().reshape(-1))
        if sync_module_states and W > 1:
            dist.broadcast(full, src=0)
        r, S = topology.rank, self.shard_numel
        self.master = nn.Parameter(full[r * S:(r + 1) * S].clone(), requires_grad=self.trainable)
        del full
        self.full = torch.empty(W * S, dtype=config.dtype, device=self.master.device)
        self.views = [self.full[off:off + n].view(shape)
                      for off, n, shape in zip(self.offsets, self.numels, self.shapes)]
        self.released = self.full.new_empty(0)
        self._free_storage()
        self.secondary = SecondaryShard(topology) if config.hpz else None
        self.gathered = False
        self.pending = None          # handle of an async gather in flight
        self.forward_users = 0       # units currently running forward with this group
        self.backward_hold = False   # gathered for backward, until its gradients are reduced
        self.grads_ready = 0
        self.reduce_launched = False

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

    def gathered_nbytes(self) -> int:
        """Bytes of full parameters this group holds now (in flight or gathered)."""
        return self.full.untyped_storage().nbytes()

    # ------------------------------------------------------------------ gather
    #: Set by the engine inside ``generation_mode()``: forwards keep the hpZ secondary shard (without
    #: gradients, frozen groups too) and, once kept, gather from it inside the node as backward does.
    hold_secondary = False

    def start_gather(self, backward: bool) -> None:
        """Launch the async gather of the full parameters (no-op if gathered or in flight)."""
        if self.gathered or self.pending is not None:
            return
        cfg = self.config
        self._alloc_storage()
        if (backward or self.hold_secondary) and self.secondary is not None and self.secondary.data is not None:
            self.pending = replica_gather(self.full, self.secondary, async_op=True)
            return
        src = self.master.detach()
        if src.dtype != self.full.dtype:
            src = src.to(self.full.dtype)
        keep = self.secondary if (self.secondary is not None and not backward and
                                  (self.hold_secondary or (torch.is_grad_enabled() and self.trainable))) else None
        self.pending = all_gather_quantized(self.full, src, bits=cfg.weight_bits, block_size=cfg.weight_block,
                                            async_op=True, secondary=keep)

    def ensure_gathered(self, backward: bool) -> None:
        if self.gathered:
            return
        self.start_gather(backward)
        self.pending.wait()
        self.pending = None
        self.gathered = True

    def maybe_free(self) -> None:
        """Free the full parameters unless a forward or a backward still needs them."""
        if self.forward_users or self.backward_hold:
            return
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.gathered or self.full.untyped_storage().nbytes():
            self._free_storage()
            self.gathered = False

    # ------------------------------------------------------------------ gradients
    def launch_reduce(self, seed: int, similarity: torch.Tensor | None = None):
        """Flatten the parameters' gradients, drop them, and start the qgZ reduce-scatter.

        Returns ``(handle, shard)``: after ``handle.wait()``, ``shard`` holds this rank's
        slice of the world-averaged gradient (fp32) and ``similarity`` (if given) this
        slice's half-batch statistics added (see ``reduce_scatter_quantized``).
        """
        cfg = self.config
        W, S = self.topology.world_size, self.shard_numel
        flat = torch.zeros(W * S, dtype=torch.float32, device=self.master.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                flat[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        shard = torch.empty(S, dtype=torch.float32, device=self.master.device)
        handle = reduce_scatter_quantized(shard, flat, bits=cfg.grad_bits, block_size=cfg.grad_block,
                                          topology=self.topology, op="avg", stochastic=cfg.stochastic_grad_rounding,
                                          seed=seed if cfg.stochastic_grad_rounding else 0, async_op=True,
                                          similarity=similarity)
        self.reduce_launched = True
        return handle, shard

    def accumulate(self, shard: torch.Tensor) -> None:
        if self.master.grad is None:
            self.master.grad = shard
        else:
            self.master.grad.add_(shard)

    def drop_param_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def end_backward(self) -> None:
        self.backward_hold = False
        self.grads_ready = 0
        self.reduce_launched = False
        if self.secondary is not None:
            self.secondary.release()
        self.maybe_free()

    # ------------------------------------------------------------------ full values
    def gather_full_fp32(self) -> torch.Tensor:
        """The exact (unquantized) fp32 values of all parameters, ``total`` elements, on every rank."""
        W, S = self.topology.world_size, self.shard_numel
        out = torch.empty(W * S, dtype=torch.float32, device=self.master.device)
        all_gather_quantized(out, self.master.detach(), bits=None)
        return out[: self.total]

    def load_full_fp32(self, full: torch.Tensor) -> None:
        """Set this rank's master shard from the full flat values (``total`` elements)."""
        r, S = self.topology.rank, self.shard_numel
        with torch.no_grad():
            self.master.zero_()
            self.master[: self.local_numel].copy_(full[r * S: r * S + self.local_numel])
