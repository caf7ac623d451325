"""Count the collectives a rank issues, whoever issues them (qcoll, FSDP2, a user's code).

The rule, one for every mode and peer of ``qcoll-bench train``: **one collective = one
call of a communication method of a** ``torch.distributed.ProcessGroup`` (all-gather,
reduce-scatter, all-to-all, all-reduce, broadcast, reduce, gather, scatter, barrier,
send, recv, their ``*_single`` / ``*_coalesced`` / ``_base`` forms; :data:`METHODS`).
Every ``torch.distributed`` collective function ends in exactly one such call on the
group it is given, under whatever name the caller holds the function (qcoll binds
``all_gather_single`` to a module-level name at import; FSDP2 looks it up at each
call), so counting at the group's methods counts qcoll and FSDP2 alike. A collective
on a group whose ranks span nodes (:func:`qcoll.comm.stats.group_spans_nodes`) is
also counted as *inter-node*. Calls are counted when issued (an async collective
counts once, at its start). What torch's functional collectives issue from C++
(``torch.ops._c10d_functional``, compiled graphs) is not seen; neither the train
benchmark's qcoll modes nor eager FSDP2 use them.

Usage::

    with CollectiveCounter() as c:
        ...                       # c.total, c.inter, c.by_op (a dict op -> calls)
        mark = c.snapshot()       # (total, inter, by_op) now; subtract two with delta()
"""
from __future__ import annotations

import threading
from collections import Counter

import torch.distributed as dist

METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
           "all_gather_single", "all_gather_single_coalesced", "_allgather_base", "reduce_scatter",
           "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
           "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single", "broadcast", "reduce",
           "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "recv_anysource")

_lock = threading.Lock()
_active: list["CollectiveCounter"] = []
_originals: dict[str, object] = {}   # name -> the class's own attribute (pybind11's method descriptor), or None


def _wrap(name: str, original):
    def counted(group, *args, **kwargs):
        for c in list(_active):
            c._count(name, group)
        return original(group, *args, **kwargs)

    counted.__name__ = counted.__qualname__ = name
    counted.__doc__ = getattr(original, "__doc__", None)
    counted.__wrapped__ = original
    return counted


def _install() -> None:
    cls = dist.ProcessGroup
    for name in METHODS:
        function = getattr(cls, name, None)   # unbound: takes the group first
        if function is None:                  # a torch without this method
            continue
        # restore what the class itself held: pybind11's method descriptor (getattr on the class
        # returns the bare function, which would no longer bind the group), or nothing if inherited
        _originals[name] = vars(cls).get(name)
        setattr(cls, name, _wrap(name, function))


def _uninstall() -> None:
    cls = dist.ProcessGroup
    for name, original in _originals.items():
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    _originals.clear()


class CollectiveCounter:
    """Counts the collectives this process issues while it is entered (nestable, not reentrant)."""

    def __init__(self) -> None:
        self.total = 0
        self.inter = 0
        self.by_op: Counter = Counter()
        self._spans: dict[int, bool] = {}

    def _count(self, op: str, group) -> None:
        self.total += 1
        self.by_op[op] += 1
        key = id(group)
        spans = self._spans.get(key)
        if spans is None:
            from ..comm.stats import group_spans_nodes

            try:
                spans = self._spans[key] = group_spans_nodes(group)
            except Exception:        # a group torch.distributed does not know (not registered): count it intra
                spans = self._spans[key] = False
        if spans:
            self.inter += 1

    def snapshot(self) -> tuple[int, int, dict]:
        return self.total, self.inter, dict(self.by_op)

    @staticmethod
    def delta(after: tuple[int, int, dict], before: tuple[int, int, dict]) -> tuple[int, int, dict]:
        ops = {k: v - before[2].get(k, 0) for k, v in after[2].items()}
        return after[0] - before[0], after[1] - before[1], {k: v for k, v in sorted(ops.items()) if v}

    def __enter__(self) -> "CollectiveCounter":
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self)
            if not _active:
                _uninstall()
