"""The per-step schedule of the ZeRO++ layer: gathers, frees, gradient reduce-scatters.

Forward: a unit's pre-hook gathers its groups with qwZ (keeping the hpZ
secondary shard when gradients are enabled) and starts the gathers of the next
``prefetch`` units of the previous forward's order; the post-hook frees them and
hooks the unit's outputs so that the first gradient reaching them gathers the
groups again for backward (from the secondary shard with hpZ, inside the node)
and prefetches the units that ran before it. When all parameters of a group
have their gradient, the group's gradients are flattened, freed and
reduce-scattered with qgZ (async); the end-of-backward callback reduces the
groups that did not complete (unused parameters count as zero), waits for all
reductions, adds them to the fp32 master gradients and frees everything.

A forward that reads a parameter of a unit other than the ones running (a parent
computing ``h @ self.emb.weight.T``) finds it released; during the model's first
forward a torch-function probe sees every op's arguments, gathers such a parameter's
group on the spot and adds it to the innermost running unit, which from then on
gathers it before its forward and backward like its own.

Generation mode (:meth:`begin_generation` / :meth:`end_generation`, the engine side
of ``ZeroModule.generation_mode()``; the bookkeeping is :class:`GenerationSession`): the
groups that fit ``max_cached_bytes`` stay gathered across the forwards (pinned); every
other group's forward gather keeps its hpZ secondary shard, also without gradients and for
frozen groups, and the forwards after it gather from the kept packed bytes inside the node
(``replica_gather``, as backward does), until the mode ends and releases them. Secondary
shards held on entry (a forward with gradients whose backward has not run) are set aside
and put back on exit; kept weights whose master changed since (an optimizer step) are
dropped at the next forward and gathered again. Backward inside the mode is refused.

Gradient accumulation with ``ZeroConfig(reshard_after_backward=False)``: a forward with
gradients inside ``no_sync()`` pins every group, so each is gathered once (qwZ across
nodes) and kept through the micro-batches' forwards and backwards, as FSDP2's
``set_reshard_after_backward(False)``; the first backward outside ``no_sync()`` unpins them,
and each is released once its gradients are reduced. A pin whose master changed (an
optimizer step between micro-batches) is dropped at the next forward and gathered again.

Collectives of dependent stages (the hierarchical forward gather's stage inside the
node, qgZ's hop 2) are launched at the engine's next hook after their first stage
(:meth:`Engine._advance`), so that the first stage's transport overlaps the compute
in between instead of blocking the hook that launched it.

Every rank must run the same units in the same order and use the same
parameters in each backward (as with DDP without ``find_unused_parameters``):
the collectives are matched by order.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_map_only

from ..comm import similarity as sim
from ..comm.stats import stats
from ..quant.rng import mix32_int
from . import user_grads
from .flat import FlatGroup, reduce_together
from .generation import GenerationSession, GenerationStats
from .buffers import broadcast_from_rank0, persistent_buffers
from .entry import register_entries
from .outputs import output_tensors
from .released_reads import ENGINE_ERROR_ATTR, ReleasedParameterProbe, note_released_reads
from .units import Unit


def _engine_hook(label: str):
    """The engine's own code: the probe ignores its ops, and a profile shows it as ``label``
    (as FSDP2's ``FSDP::pre_forward`` and the like)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            busy, self.busy = self.busy, True
            try:
                with record_function(label):
                    return fn(self, *args, **kwargs)
            except Exception as error:  # not a read of a released parameter: the note must not say so
                setattr(error, ENGINE_ERROR_ATTR, True)
                raise
            finally:
                self.busy = busy

        return run

    return wrap


class Engine:
    def __init__(self, root: nn.Module, units: list[Unit], groups: list[FlatGroup], config):
        self.units = units
        self.groups = groups
        self.config = config
        self.order: list[Unit] = []        # units of the current forward, in call order
        self.last_order: list[Unit] = []   # the previous forward's order (prefetch plan)
        self.sync_grads = True
        self.in_backward = False
        self.reduces = []
        self.bucket: list = []             # (group, gradients) waiting for one coalesced reduction
        self.micro_step = 0
        self.probed = False                # a forward completed under the probe
        self.running: list[Unit] = []     # units inside their forward, innermost last
        self._in_forward = False
        self._probe = None
        self.busy = False                  # inside the engine's own hooks (the probe looks away)
        self.peak_gathered_bytes = 0       # most full-parameter bytes held at once (after each gather)
        self.measure_similarity = False    # SimiGrad: measure the half-batch cosine in each reduction
        self.last_similarity = None        # the cosine of the last measured backward (NaN: undefined)
        self._similarity = None            # this backward's local statistics, while reducing
        self.generation: GenerationSession | None = None  # inside generation_mode()
        self._group_of = {}
        self.param_names = {}
        self._hooks = []
        for g in groups:
            self.add_group(g)
        #: called at the start of every forward: adopts parameters added since sharding
        self.adopt_new_parameters = None
        self.entry = None                  # the module whose call outside the model's forward began this one
        self._nested = 0                   # forwards of the model running inside that call
        self.root = root
        self._buffers_stale = False        # a training forward changed the buffers since the last broadcast
        for u in units:
            # The hooks talk to other ranks: torch.compile runs them eagerly (a graph break at each
            # unit's boundary, as FSDP2's hooks do) and compiles what lies between them.
            pre = torch.compiler.disable(functools.partial(self._pre_forward, u))
            post = torch.compiler.disable(functools.partial(self._post_forward, u))
            # prepended, as FSDP2's: the user's own pre-hooks (weight_norm, PEFT...) see gathered weights
            self._hooks.append(u.module.register_forward_pre_hook(pre, prepend=True))
            self._hooks.append(u.module.register_forward_hook(post))
        # registered last and prepended: the first of the root's pre-hooks
        self._hooks.append(root.register_forward_pre_hook(torch.compiler.disable(self._begin_forward), prepend=True,
                                                          with_kwargs=True))
        # always_call: also when the forward raised (then some units never ended: reset them)
        self._hooks.append(root.register_forward_hook(torch.compiler.disable(self._end_forward), always_call=True))
        # entry calls talk to other ranks too (set here, not as class decorators: `import qcoll` then
        # does not import dynamo, seconds of start-up for every command that shards nothing)
        self.begin_entry = torch.compiler.disable(self.begin_entry)
        self.end_entry = torch.compiler.disable(self.end_entry)
        self._hooks += register_entries(self, root, units)

    def add_group(self, g: FlatGroup) -> None:
        """Schedule group ``g`` (``self.groups`` holds it already, or takes it now)."""
        if g not in self.groups:
            self.groups.append(g)
        g.engine = self
        for n, p in zip(g.names, g.params):
            self._group_of[id(p)] = g
            self.param_names[id(p)] = n
            if p.requires_grad:  # one frozen now and trained later is reduced at the end of backward
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, g)))

    @property
    def in_forward(self) -> bool:
        """Whether a forward of the model is running."""
        return self._in_forward

    # ------------------------------------------------------------------ forward
    def _begin_forward(self, module, args, kwargs):
        if self._in_forward and self.entry is not None:  # the model's forward inside an entry (a registered
            self._nested += 1                               # method calling it, e.g. generate): one forward
            return self._cast(args, kwargs)
        if self._in_forward:  # the previous forward raised where the end hook does not run (compiled)
            self._reset_forward()
        if self.adopt_new_parameters is not None:
            self.adopt_new_parameters()
        if self.generation is None:
            self._pin_for_accumulation()
        for g in self.groups:  # a torch optimizer's step that raised left its shards exposed
            user_grads.conceal(g)
        self.sync_buffers()  # before this forward saves any of them for its backward
        self._in_forward = True
        if self.order:
            self.last_order = self.order
        self.order = []
        if self.generation is not None:
            self.generation.begin_forward(self.groups)
        if not self.probed:
            self._probe = ReleasedParameterProbe(self)
            self._probe.__enter__()
        return self._cast(args, kwargs)

    def _pin_for_accumulation(self) -> None:
        """Before a forward outside generation mode: drop stale pins; inside ``no_sync()`` with
        ``reshard_after_backward=False`` and gradients enabled, pin every sharded group."""
        for g in self.groups:
            if g.pin_stale:
                g.unpin()
        if not self.sync_grads and not self.config.reshard_after_backward and torch.is_grad_enabled():
            for g in self.groups:
                if not g.pinned and not g.replicated:
                    g.pin()

    def _cast(self, args, kwargs):
        """The forward's floating-point arguments in the compute dtype (None: unchanged)."""
        dtype = self.config.compute_dtype
        if dtype is not None:
            cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
            return tree_map_only(torch.Tensor, cast, (args, kwargs))
        return None

    @_engine_hook("qcoll.zero::end_forward")
    def _end_forward(self, module, args, output):
        if self._nested:  # the end of a forward inside an entry: the entry's end reshards
            self._nested -= 1
            return output
        failed = bool(self.running)      # the forward raised inside a unit: the probe runs again next time
        if failed:
            self._reset_forward()
            note_released_reads(sys.exc_info()[1], self.param_names)
        elif self._probe is not None and self.entry is None:  # a forward of the whole model, probed
            self.probed = True
        self._stop_probe()
        self._in_forward = False
        for g in self.groups:
            g.reshard()
        if not failed and self.config.broadcast_buffers and module.training and torch.is_grad_enabled():
            self._buffers_stale = True  # this forward updated each rank's buffers from its own batch
        if self.generation is not None:
            self.generation.end_forward(self.groups)
        return output

    def begin_entry(self, module: nn.Module, args, kwargs):
        """``module`` (below the root) is called outside the model's forward: begin a forward of
        its own, with the root unit gathered (:mod:`qcoll.zero.entry`). Returns what
        :meth:`_begin_forward` returns (the arguments cast to the compute dtype, or None)."""
        cast = self._begin_forward(module, args, kwargs)
        self.entry = module
        self._pre_forward(self.units[0], module, args)
        return cast

    def end_entry(self, module: nn.Module, args, output, failed: bool | None = None) -> None:
        """The call that :meth:`begin_entry` began returned (or raised: ``failed``; None: judged from
        the units still running, as a forward hook cannot tell): end its forward."""
        if failed is None:
            failed = not (self.running and self.running[-1] is self.units[0])
        try:
            if not failed:
                self._post_forward(self.units[0], module, args, output)
            self._end_forward(module, args, output)
        finally:
            self.entry = None

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers if a training forward changed them since the last
        broadcast (:mod:`qcoll.zero.buffers`; collective, every rank at the same point)."""
        if self._buffers_stale:
            self._buffers_stale = False
            broadcast_from_rank0(persistent_buffers(self.root))

    def _stop_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            probe.__exit__(None, None, None)

    def _reset_forward(self) -> None:
        self._stop_probe()
        self.running = []
        for g in self.groups:
            g.clear_forward_uses()

    @_engine_hook("qcoll.zero::gather_released")
    def use_released(self, param: nn.Parameter) -> None:
        """A released parameter is read inside a forward: gather its group and make it one
        of the innermost running unit's groups (gathered for its forward and backward)."""
        group = self._group_of.get(id(param))
        if group is None or not self.running:
            return
        unit = self.running[-1]
        if group not in unit.groups:
            unit.groups.append(group)
            group.begin_forward_use()
        group.gather_now(backward=False)
        self._record_gathered()

    def _advance(self) -> None:
        """Launch the next stage of every collective in flight (gathers, then reductions, each
        in launch order): the same hooks run in the same order on every rank, so every rank
        launches them at the same point of its sequence of collectives."""
        for g in self.groups:
            g.advance()
        for _, handle, _ in self.reduces:
            handle.advance()

    @_engine_hook("qcoll.zero::pre_forward")
    def _pre_forward(self, unit: Unit, module, args):
        self._advance()
        call = len(self.order)
        self.order.append(unit)
        self.running.append(unit)
        for g in unit.groups:
            g.begin_forward_use()
        for g in unit.groups:
            g.gather_now(backward=False)
        for nxt in self.last_order[call + 1: call + 1 + self.config.prefetch]:
            for g in nxt.groups:
                g.unshard(backward=False)
        self._record_gathered()

    @_engine_hook("qcoll.zero::post_forward")
    def _post_forward(self, unit: Unit, module, args, output):
        if self.running and self.running[-1] is unit:
            self.running.pop()
        self._advance()
        for g in unit.groups:
            g.end_forward_use()
        if torch.is_grad_enabled():  # frozen units too: a gradient may flow through them to earlier units
            found, opaque = output_tensors(output)
            tensors = [t for t in found if t.requires_grad]
            if not tensors and opaque and any(g.trainable for g in unit.groups):
                raise TypeError(f"qcoll.zero: the forward of {unit.label} ({type(module).__name__}) returned a "
                                f"{type(output).__name__} in which qcoll finds no tensor that requires grad (it "
                                f"looked through containers and attributes; opaque: "
                                f"{', '.join(sorted({t.__name__ for t in opaque}))}), so its backward could not "
                                "gather the unit's parameters again. Return a tuple, dict or dataclass, or register "
                                "the type as a pytree node (torch.utils._pytree.register_pytree_node)")
            if tensors:
                hook = functools.partial(self._pre_backward, unit, self.order, len(self.order) - 1)
                register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ------------------------------------------------------------------ backward
    @_engine_hook("qcoll.zero::pre_backward")
    def _pre_backward(self, unit: Unit, order: list[Unit], call: int, grad) -> None:
        if self.generation is not None:
            raise RuntimeError("qcoll.zero: backward inside generation_mode(): the mode keeps the hpZ secondary "
                               "shards for forwards without backward; run the backward after the with-block "
                               "(autograd may have freed part of this graph: run its forward again)")
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._end_backward)
            if self.sync_grads:  # the step's last backward: release each group after its reduction
                for g in self.groups:
                    if g.pinned:
                        g.unpin(reshard=False)
        self._advance()
        for g in unit.groups:
            g.hold_for_backward()
        for prev in reversed(order[max(0, call - self.config.prefetch): call]):
            for g in prev.groups:
                if not g.reducing:
                    g.unshard(backward=True)
        self._record_gathered()

    def _record_gathered(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(g.gathered_nbytes() for g in self.groups))

    def _grad_ready(self, group: FlatGroup, param) -> None:
        if not self.sync_grads or group.reducing:
            return
        if group.grad_ready():
            self._advance()
            self._reduce(group)

    def _seed(self, group: FlatGroup) -> int:
        return mix32_int(mix32_int(self.micro_step + 1) ^ (group.index + 1))

    @_engine_hook("qcoll.zero::reduce_grads")
    def _reduce(self, group: FlatGroup) -> None:
        if self.measure_similarity and self._similarity is None:
            self._similarity = sim.new_stats(group.master.device)
        limit = self.config.reduce_bucket_numel
        if not limit or group.replicated:
            handle, shard = group.reduce_grads(self._seed(group), self._similarity)
            self.reduces.append((group, handle, shard))
            return
        self.bucket.append((group, group.take_grads()))
        if sum(flat.numel() for _, flat in self.bucket) >= limit:
            self._flush_bucket()

    def _flush_bucket(self) -> None:
        """Start one reduce-scatter of the gradients of the groups waiting in the bucket."""
        if not self.bucket:
            return
        bucket, self.bucket = self.bucket, []
        groups = [g for g, _ in bucket]
        handle, shards = reduce_together(groups, [flat for _, flat in bucket], self._seed(groups[0]),
                                         self._similarity)
        self.reduces.extend((g, handle, shard) for g, shard in zip(groups, shards))

    @_engine_hook("qcoll.zero::post_backward")
    def _end_backward(self) -> None:
        try:
            if self.sync_grads:
                for g in self.groups:
                    if g.trainable and not g.reducing:
                        self._reduce(g)
                self._flush_bucket()
            self.wait_reduces()
            self._finish_similarity()
        finally:
            self._similarity = None
            self.bucket = []
            for g in self.groups:
                g.end_backward()
                if not self._in_forward:  # a checkpoint's recompute stops early, its units never end
                    g.clear_forward_uses()
            if not self._in_forward:
                self.running = []
            self.in_backward = False
            self.micro_step += 1

    def _finish_similarity(self) -> None:
        """Sum the statistics over the world (one all-reduce of 3 fp32 numbers: the noise
        corrections are subtracted before sending) and keep the half-batch cosine."""
        if self._similarity is None:
            return
        local = torch.tensor(sim.corrected(self._similarity), dtype=torch.float32, device=self._similarity.device)
        stats.add("similarity_all_reduce", None, local.numel() * local.element_size())
        torch.distributed.all_reduce(local)
        self.last_similarity = sim.cosine(*local.double().tolist())

    def wait_reduces(self) -> None:
        reduces, self.reduces = self.reduces, []
        for group, handle, shard in reduces:
            handle.wait()
            group.accumulate(shard)
            user_grads.install(group)

    # ------------------------------------------------------------------ generation mode
    def begin_generation(self, max_cached_bytes: int | None = 0) -> GenerationStats:
        """Enter generation mode (see the module docstring); returns its counts."""
        if self.generation is not None:
            raise RuntimeError("qcoll.zero: generation_mode() is already active on this model (it does not "
                               "nest; use the outer block's stats)")
        if self.in_backward or self._in_forward:
            where = "a backward" if self.in_backward else "a forward"
            raise RuntimeError(f"qcoll.zero: generation_mode() entered inside {where} of the model; enter it "
                               "around the forwards (e.g. around model.generate(...))")
        if any(g.pinned for g in self.groups):
            raise RuntimeError("qcoll.zero: generation_mode() entered while gradient accumulation holds the "
                               "gathered weights (ZeroConfig(reshard_after_backward=False) inside no_sync()): run "
                               "the step's last backward, outside no_sync(), before generating")
        self.generation = GenerationSession(self.groups, max_cached_bytes)
        return self.generation.stats

    def end_generation(self) -> None:
        """Leave generation mode: release every weight and secondary shard it kept, put back
        those set aside on entry (also when the block raised)."""
        try:
            if self._in_forward:  # a forward raised where the end hook does not run (compiled): finish it
                self._in_forward = False
                self._reset_forward()
        finally:
            session, self.generation = self.generation, None
            session.end(self.groups)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
