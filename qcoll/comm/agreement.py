"""Every rank says what it is about to do, through the default group's store, before anything
collective happens: no collective is issued, so nothing can pair up with another call's.

A call that every rank must make with the same arguments (building a :class:`~qcoll.Topology`,
``quantize_comm``) writes a text under ``qcoll/<name>/<n>/<rank>`` (``n``: the how-manieth call
of that name on this rank) and reads every rank's. Ranks that disagree then learn it at once, and
all of them, where the mismatched collectives they would otherwise issue hang until the group's
timeout (``new_group`` with other members, for one: 30 minutes by torch's default).
"""
from __future__ import annotations

import datetime
import itertools
import json

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

#: how long an agreement waits for every rank to reach it, at most (the group's timeout when shorter)
AGREE_TIMEOUT = datetime.timedelta(seconds=60)


def group_timeout() -> datetime.timedelta:
    """The default group's timeout (what ``init_process_group`` was given)."""
    pg = dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend())


def wait_timeout() -> datetime.timedelta:
    """:data:`AGREE_TIMEOUT`, or the group's timeout when shorter."""
    return min(AGREE_TIMEOUT, group_timeout())


class Agreement:
    """The store exchange of one kind of call, ``name`` (a key prefix, and the word errors use)."""

    def __init__(self, name: str):
        self.name = name
        self._calls = itertools.count()

    def skip(self) -> None:
        """Count a call this rank does not make (tests that keep the ranks' counts equal)."""
        next(self._calls)

    def exchange(self, value: str, timeout: datetime.timedelta | None = None, missing_hint: str = "") -> dict:
        """Write ``value`` for this rank and wait (up to ``timeout``, default the store's) for every
        rank's; returns ``{rank: value}``. A ``RuntimeError`` names the ranks that did not write within
        ``timeout`` (``missing_hint`` is appended: what those ranks should have done)."""
        store = _get_default_store()
        n, rank, world = next(self._calls), dist.get_rank(), dist.get_world_size()
        keys = [f"qcoll/{self.name}/{n}/{r}" for r in range(world)]
        store.set(keys[rank], value)
        try:
            store.wait(keys) if timeout is None else store.wait(keys, timeout)
        except RuntimeError:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise RuntimeError(f"{self.name} (call {n} on rank {rank}): ranks {missing} did not call it within "
                               f"{timeout or store.timeout}. {missing_hint}".rstrip()) from None
        return {r: v.decode() for r, v in enumerate(store.multi_get(keys))}

    def same_fields(self, fields: dict, timeout: datetime.timedelta | None = None, missing_hint: str = "") -> None:
        """:meth:`exchange` of ``fields`` (names to their text, e.g. ``repr``), then a ``ValueError`` on
        every rank naming the ranks whose fields differ from rank 0's, and for the first of them each
        field with both values."""
        every = {r: json.loads(v) for r, v in self.exchange(json.dumps(fields, sort_keys=True), timeout,
                                                            missing_hint).items()}
        differ = {r: [k for k in fields if doc.get(k) != every[0].get(k)] for r, doc in every.items()}
        differ = {r: names for r, names in differ.items() if names}
        if differ:
            r, names = min(differ.items())
            raise ValueError(f"{self.name}: ranks {sorted(differ)} passed other arguments than rank 0; rank {r} has "
                             + ", ".join(f"{k}={str(every[r].get(k)):.200} (rank 0: {k}={str(every[0].get(k)):.200})"
                                         for k in names))
