"""Every rank calls ``quantize_comm``, with the same arguments: checked through the store.

The quantized collectives check their frames, but a rank that never called
``quantize_comm`` runs FSDP2's own collectives, which check nothing, on other process
groups: the two sides would only meet the transport's timeout, with no word of why.
So ``quantize_comm`` writes a fingerprint of its arguments and of the model's FSDP
groups under ``qcoll/quantize_comm/<n>/<rank>`` in the default group's store (no
collective is issued, so nothing can pair up with FSDP2's) and reads every rank's.
"""
from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

_calls = itertools.count()


def agree(fingerprint: str, timeout: datetime.timedelta | None = None) -> None:
    """Wait (up to ``timeout``, default the store's) until every rank has written its fingerprint for this
    call; a ``RuntimeError`` naming the ranks that did not, a ``ValueError`` naming the ranks
    whose fingerprint differs from this rank's."""
    store = _get_default_store()
    n, rank, world = next(_calls), dist.get_rank(), dist.get_world_size()
    key = f"qcoll/quantize_comm/{n}/".__add__
    store.set(key(str(rank)), fingerprint)
    try:
        keys = [key(str(r)) for r in range(world)]
        store.wait(keys) if timeout is None else store.wait(keys, timeout)
    except RuntimeError:
        missing = [r for r in range(world) if not store.check([key(str(r))])]
        raise RuntimeError(
            f"quantize_comm (call {n} on rank {rank}): ranks {missing} did not call it within "
            f"{timeout or store.timeout}. Every rank must call quantize_comm on its model, in the same order, before the first "
            f"forward; ranks that do not run FSDP2's own collectives and cannot meet the quantized ones") from None
    theirs = {r: store.get(key(str(r))).decode() for r in range(world)}
    differ = {r: f for r, f in theirs.items() if f != fingerprint}
    if differ:
        first = min(differ)
        raise ValueError(f"quantize_comm (call {n}): ranks {sorted(differ)} passed other arguments or another "
                         f"model than rank {rank}: rank {rank} has {fingerprint}; rank {first} has {differ[first]}")
