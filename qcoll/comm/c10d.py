"""What qcoll needs of torch.distributed's group registry, for registered groups and for bare
ones. The flat-tensor collectives under their current names (torch >= 2.13 renamed
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and warns on the old ones).

A *bare* group is a c10d ``ProcessGroup`` built from a store, rank and size without
``init_process_group`` / ``new_group`` (torchft's replica-group process groups are built so,
and rebuilt on every quorum change). torch's registry does not know it: its rank and size come
from the group itself, and its "ranks" in qcoll's messages are its own ranks 0..size-1.
"""
import weakref

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_bare: "weakref.WeakSet" = weakref.WeakSet()


def accept_bare(group) -> None:
    """Let qcoll's collectives run over the bare c10d ``group`` (its owner builds and drops it;
    a group torch's registry dropped, e.g. after ``destroy_process_group``, stays refused)."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    _bare.add(group)


def is_bare(group) -> bool:
    return group is not None and group in _bare


def registered(group) -> bool:
    """``group`` is the default group (None) or one that torch.distributed's registry knows."""
    if group is None or group is dist.group.WORLD:
        return True
    return group in dist.distributed_c10d._world.pg_group_ranks


def group_size(group) -> int:
    return dist.get_world_size(group) if registered(group) else group.size()


def group_rank(group) -> int:
    """This process's rank within ``group``."""
    return dist.get_rank(group) if registered(group) else group.rank()


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``'s members in group order (a bare group: its own ranks)."""
    if registered(group):
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return list(range(group.size()))


def my_rank(group) -> int:
    """This process's rank as qcoll's messages name it: global where a default group exists,
    else (a bare group with no default group) its rank in ``group``."""
    if dist.is_initialized() and registered(group):
        return dist.get_rank()
    return group_rank(group)
