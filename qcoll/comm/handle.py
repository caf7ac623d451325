"""Async handles returned by the collectives when ``async_op=True``."""
from __future__ import annotations

import torch.distributed as dist

from .errors import add_transport_context


class Handle:
    """Completes a collective: ``wait()`` waits for the communication and runs
    the remaining local work (dequantization, reductions). Idempotent."""

    def __init__(self, finish):
        self._finish = finish
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            self._result = self._finish()
            self._done = True
            self._finish = None
        return self._result

    def is_completed(self) -> bool:
        return self._done


def finish(handle_fn, async_op: bool):
    """Return a Handle for async calls, or run it now for synchronous ones."""
    h = Handle(handle_fn)
    if async_op:
        return h
    h.wait()
    return None


def wait_work(work, op: str, sent) -> None:
    """Wait for a c10d work; a transport error gets a note naming ``op``, this rank and
    ``sent()`` (a description of what this rank sent, built only on failure)."""
    try:
        work.wait()
    except RuntimeError as e:
        add_transport_context(e, op, dist.get_rank(), sent())
        raise
