"""``ZeroState``: what :func:`qcoll.zero.shard` keeps on the module it shards."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..comm import Topology
from .config import ZeroConfig
from .engine import Engine
from .flat import FlatGroup
from .units import Unit

#: The attribute of a sharded module that holds its :class:`ZeroState`.
STATE_ATTR = "_qcoll_zero_state"
#: Set on every parameter that a :class:`FlatGroup` manages (refuses sharding it twice).
MANAGED_ATTR = "_qcoll_zero_managed"


@dataclass
class ZeroState:
    """The sharding of one module: its topology and config, its units (submodules
    gathered together), the flat groups holding the parameters' shards, and the engine
    (hooks and per-step schedule)."""

    topology: Topology
    config: ZeroConfig
    units: list[Unit]
    groups: list[FlatGroup]
    engine: Engine

    def trainable_masters(self) -> list[nn.Parameter]:
        """The fp32 master shards that an optimizer steps, one per trainable group."""
        return [g.master for g in self.groups if g.trainable]

    def managed(self) -> dict[int, tuple[FlatGroup, int]]:
        """``id(parameter) -> (group, index in the group)`` for every managed parameter."""
        return {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}


def state_of(module: nn.Module, argument: str = "model") -> ZeroState:
    """The :class:`ZeroState` of a module sharded by :func:`qcoll.zero.shard`; a TypeError
    naming ``argument`` (the caller's parameter) for anything else."""
    state = module.__dict__.get(STATE_ATTR) if isinstance(module, nn.Module) else None
    if state is None:
        hint = " (shard it first: qcoll.zero.shard(model))" if isinstance(module, nn.Module) else ""
        raise TypeError(f"{argument} must be a module sharded by qcoll.zero.shard(...), got "
                        f"{type(module).__name__}{hint}")
    return state
