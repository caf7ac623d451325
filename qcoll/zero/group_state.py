"""The states of a :class:`~qcoll.zero.flat.FlatGroup` and the check on their transitions.

A group's full parameters are in one of three :class:`GatherState` s, and during a
backward its gradients in one of three :class:`GradState` s. The two are independent
(a group may be gathered, held for backward, or reducing while a prefetch gathers it),
as FSDP2's ``ShardedState`` and ``TrainingState`` are. Every transition of a group
asserts the state it starts from (:func:`assert_in`), so a schedule bug in the engine
stops at the step that went wrong instead of corrupting parameters later.
"""
from __future__ import annotations

from enum import Enum, auto


class GatherState(Enum):
    """Where the group's full (unsharded) parameters are."""

    RELEASED = auto()    #: freed: each parameter's ``.data`` is an empty tensor
    GATHERING = auto()   #: storage allocated, a gather (qwZ, or hpZ inside the node) in flight
    GATHERED = auto()    #: the full parameters are valid and the parameters point into them


class GradState(Enum):
    """What a backward pass is doing with the group."""

    IDLE = auto()        #: no backward has reached it (or the last one ended)
    HELD = auto()        #: gathered for a unit's backward; kept until its gradients are reduced
    REDUCING = auto()    #: gradients flattened and handed to the reduce-scatter (qgZ)


def assert_in(state, allowed: tuple, what: str, group_name: str) -> None:
    """Raise AssertionError when ``state`` is not one of ``allowed`` for transition ``what``."""
    if state not in allowed:
        names = " or ".join(s.name for s in allowed)
        raise AssertionError(f"qcoll.zero: group {group_name!r}: {what} expects {names}, but it is {state.name}")
