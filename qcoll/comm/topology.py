"""Topology: world, node and local rank, with intra-node and inter-node process groups."""
from __future__ import annotations

import datetime
import json
import os

import torch.distributed as dist

from ..checks import check_int
from . import liveness
from .agreement import Agreement, group_timeout as _default_timeout, wait_timeout

_current: "Topology | None" = None
_AGREEMENT = Agreement("qcoll.Topology")


def group_is_live(group) -> bool:
    """Whether ``group`` is a process group of the current ``torch.distributed`` state (not one
    destroyed by ``destroy_process_group``; a re-initialized default group makes new groups)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return dist.is_initialized() and (pg_map is None or group in pg_map)


class Topology:
    """How the ranks of the default group are split into nodes.

    ``ranks_per_node=L`` emulates ``world // L`` nodes on one host; the default
    comes from ``LOCAL_WORLD_SIZE`` (torchrun) and otherwise treats the world as
    one node. Global rank ``r`` is local rank ``r % L`` of node ``r // L``.
    ``torch.distributed`` must be initialized; every rank must construct the
    topology (it creates process groups collectively), with the same ``ranks_per_node``:
    before any group is made the ranks compare it through the default group's store, and
    ranks that differ raise a ``ValueError`` on every rank naming them (instead of hanging
    in ``new_group`` for the group's timeout). ``timeout`` (a ``datetime.timedelta``;
    default 60 s, or the group's timeout when shorter): how long a rank waits for the
    others to reach the constructor; a ``RuntimeError`` names the ranks that did not.
    """

    def __init__(self, ranks_per_node: int | None = None, timeout: datetime.timedelta | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("qcoll.Topology needs torch.distributed to be initialized first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
            raise TypeError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
        # agreed first, checked after: a value only some ranks refuse must not leave the others waiting
        _agree(ranks_per_node, timeout or wait_timeout())
        check_int(ranks_per_node, "ranks_per_node", minimum=1)
        if self.world_size % ranks_per_node:
            raise ValueError(
                f"world size {self.world_size} is not divisible by ranks_per_node={ranks_per_node}"
            )
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.world_size // ranks_per_node
        self.node = self.rank // ranks_per_node
        self.local_rank = self.rank % ranks_per_node
        self.world_group = dist.group.WORLD
        self.intra_group, self.inter_group = _node_groups(self.world_size, ranks_per_node)
        global _current
        _current = self

    def check_live(self) -> None:
        """Raise RuntimeError when the process groups this topology was built on were destroyed
        (``dist.destroy_process_group``, possibly followed by a new ``init_process_group``)."""
        if (dist.is_initialized() and dist.group.WORLD is self.world_group and group_is_live(self.intra_group)
                and group_is_live(self.inter_group)):
            return
        raise RuntimeError(f"qcoll {self!r} was built on process groups that have since been destroyed "
                           f"(torch.distributed.destroy_process_group); build a new qcoll.Topology after "
                           f"init_process_group and use it instead")

    @classmethod
    def from_env(cls, timeout: datetime.timedelta | None = None) -> "Topology":
        """Nodes of ``LOCAL_WORLD_SIZE`` ranks, as torchrun sets it."""
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise RuntimeError("LOCAL_WORLD_SIZE is not set (it is set by torchrun)")
        return cls(int(os.environ["LOCAL_WORLD_SIZE"]), timeout)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def __repr__(self) -> str:
        return (f"Topology(world={self.world_size}, nodes={self.num_nodes}, ranks_per_node={self.ranks_per_node}, "
                f"rank={self.rank}, node={self.node}, local_rank={self.local_rank})")


def _agree(ranks_per_node, timeout: datetime.timedelta) -> None:
    """Every rank passed the same ``ranks_per_node`` (else a ValueError on every rank naming the
    ranks that differ); each rank's host and pid are kept for :mod:`qcoll.comm.liveness`."""
    every = _AGREEMENT.exchange(json.dumps({"ranks_per_node": repr(ranks_per_node), **liveness.me()}), timeout,
                                "Every rank must construct the same qcoll.Topology, in the same order.")
    every = {r: json.loads(v) for r, v in every.items()}
    liveness.record(every)
    by_value: dict = {}
    for r, v in every.items():
        by_value.setdefault(v["ranks_per_node"], []).append(r)
    if len(by_value) > 1:
        sides = "; ".join(f"ranks {ranks} passed ranks_per_node={value}" for value, ranks in by_value.items())
        raise ValueError(f"qcoll.Topology: the ranks passed different ranks_per_node ({sides}); every rank must "
                         f"pass the same (LOCAL_WORLD_SIZE, set by torchrun, when None). No process group was made")


#: (the world group, ranks per node) -> (intra-node group, inter-node group) of this rank. Every
#: rank builds the same topologies in the same order, so all of them reuse the same groups; a
#: process group costs threads of its own (gloo: three), so a new one per Topology would pile up.
_groups: dict = {}


def _node_groups(world: int, L: int):
    key = (id(dist.group.WORLD), L)
    cached = _groups.get(key)
    if cached is not None and all(group_is_live(g) for g in cached):
        return cached
    timeout = _default_timeout()
    intra = [list(range(n * L, (n + 1) * L)) for n in range(world // L)]
    inter = [list(range(l, world, L)) for l in range(L)]
    groups = (dist.new_subgroups_by_enumeration(intra, timeout=timeout)[0],
              dist.new_subgroups_by_enumeration(inter, timeout=timeout)[0])
    _groups[key] = groups
    return groups


def current_topology() -> "Topology | None":
    """The most recently constructed topology (used to classify a group's bytes)."""
    return _current
