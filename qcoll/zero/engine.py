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

Every rank must run the same units in the same order and use the same
parameters in each backward (as with DDP without ``find_unused_parameters``):
the collectives are matched by order.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..quant.rng import mix32_int
from .flat import FlatGroup
from .units import Unit


class Engine:
    def __init__(self, units: list[Unit], groups: list[FlatGroup], config):
        self.units = units
        self.groups = groups
        self.config = config
        self.order: list[Unit] = []        # units of the current forward, in call order
        self.last_order: list[Unit] = []   # the previous forward's order (prefetch plan)
        self.sync_grads = True
        self.in_backward = False
        self.reduces = []
        self.micro_step = 0
        self._hooks = []
        for u in units:
            # The hooks talk to other ranks: torch.compile runs them eagerly (a graph break at each
            # unit's boundary, as FSDP2's hooks do) and compiles what lies between them.
            pre = torch.compiler.disable(functools.partial(self._pre_forward, u))
            post = torch.compiler.disable(functools.partial(self._post_forward, u))
            self._hooks.append(u.module.register_forward_pre_hook(pre))
            self._hooks.append(u.module.register_forward_hook(post))
        for g in groups:
            if g.trainable:
                for p in g.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, g)))

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        if self.order:
            self.last_order = self.order
        self.order = []

    def end_forward(self, failed: bool) -> None:
        for g in self.groups:
            if failed:
                g.forward_users = 0
            g.maybe_free()

    def _pre_forward(self, unit: Unit, module, args):
        call = len(self.order)
        self.order.append(unit)
        for g in unit.groups:
            g.forward_users += 1
        for g in unit.groups:
            g.ensure_gathered(backward=False)
        for nxt in self.last_order[call + 1: call + 1 + self.config.prefetch]:
            for g in nxt.groups:
                g.start_gather(backward=False)

    def _post_forward(self, unit: Unit, module, args, output):
        for g in unit.groups:
            g.forward_users -= 1
            g.maybe_free()
        if torch.is_grad_enabled():  # frozen units too: a gradient may flow through them to earlier units
            leaves, _ = tree_flatten(output)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                hook = functools.partial(self._pre_backward, unit, self.order, len(self.order) - 1)
                register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit, order: list[Unit], call: int, grad) -> None:
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._end_backward)
        for g in unit.groups:
            g.backward_hold = True
            g.ensure_gathered(backward=True)
        for prev in reversed(order[max(0, call - self.config.prefetch): call]):
            for g in prev.groups:
                if not g.reduce_launched:
                    g.start_gather(backward=True)

    def _grad_ready(self, group: FlatGroup, param) -> None:
        if not self.sync_grads or group.reduce_launched:
            return
        group.grads_ready += 1
        if group.grads_ready == len(group.params):
            self._reduce(group)

    def _seed(self, group: FlatGroup) -> int:
        return mix32_int(mix32_int(self.micro_step + 1) ^ (group.index + 1))

    def _reduce(self, group: FlatGroup) -> None:
        handle, shard = group.launch_reduce(self._seed(group))
        self.reduces.append((group, handle, shard))
        group.backward_hold = False
        if group.secondary is not None:
            group.secondary.release()
        group.maybe_free()

    def _end_backward(self) -> None:
        try:
            if self.sync_grads:
                for g in self.groups:
                    if g.trainable and not g.reduce_launched:
                        self._reduce(g)
            self.wait_reduces()
        finally:
            for g in self.groups:
                g.end_backward()
            self.in_backward = False
            self.micro_step += 1

    def wait_reduces(self) -> None:
        reduces, self.reduces = self.reduces, []
        for group, handle, shard in reduces:
            handle.wait()
            group.accumulate(shard)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
