"""Parameters added to a sharded model after :func:`qcoll.zero.shard` (PEFT's LoRA adapters,
a new head): adopted as replicated groups.

Each rank's new parameters start from rank 0's values (one broadcast, as ``shard``'s
``sync_module_states``: PEFT initialises adapters from each process's own random state), are
kept whole on every rank (:class:`~qcoll.zero.replicated.ReplicatedGroup`, fp32 master), their
gradients averaged by one all-reduce per backward, and stepped by any optimizer built after
they were added. They join the root unit (a replicated group is never gathered: it only keeps
its compute-dtype copy fresh). The engine looks for them at the start of every forward and
:class:`qcoll.zero.Optimizer` at its construction; both are collective points, so every rank
adopts the same parameters in the same order.
"""
from __future__ import annotations

from torch import nn

from .replicated import ReplicatedGroup
from .state import MANAGED_ATTR


def new_parameters(root: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``root`` that no group manages, in registration order."""
    if all(p is None or getattr(p, MANAGED_ATTR, False) for m in root.modules() for p in m._parameters.values()):
        return []  # the common case, checked at every forward without building names
    return [(n, p) for n, p in root.named_parameters() if not getattr(p, MANAGED_ATTR, False)]


def adopt(root: nn.Module, state) -> None:
    """Build replicated groups (trainable, frozen) for ``root``'s new parameters and hand them to
    the engine (collective: every rank calls it at the same point)."""
    found = new_parameters(root)
    if not found:
        return
    empty = [n for n, p in found if p.numel() == 0]
    if empty:  # a copy of a released parameter (copy.deepcopy, PEFT's modules_to_save after sharding)
        raise ValueError(f"qcoll.zero: parameter(s) {', '.join(map(repr, empty[:3]))} were added to the model after "
                         "qcoll.zero.shard as empty tensors (copies of sharded parameters, whose values live in "
                         "shards); make such copies, e.g. apply PEFT with modules_to_save, before sharding")
    engine, root_unit = state.engine, state.units[0]
    for params, suffix in (([(n, p) for n, p in found if p.requires_grad], ""),
                           ([(n, p) for n, p in found if not p.requires_grad], ".frozen")):
        if not params:
            continue
        g = ReplicatedGroup(f"<added>{suffix}.{len(state.groups)}", len(state.groups), params, state.topology,
                            state.config, sync_module_states=True)
        for _, p in params:
            setattr(p, MANAGED_ATTR, True)
        state.groups.append(g)
        root_unit.groups.append(g)
        root_unit.used.extend(p for _, p in params)
        engine.add_group(g)

