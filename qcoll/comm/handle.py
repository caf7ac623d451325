"""Async handles returned by the collectives when ``async_op=True``, and their profiler labels."""
from __future__ import annotations

import functools

import torch.distributed as dist
from torch.autograd.profiler import record_function

from .errors import add_transport_context


class Handle:
    """Completes a collective: ``wait()`` waits for the communication and runs
    the remaining local work (dequantization, reductions). Idempotent."""

    def __init__(self, finish, label: str):
        self._finish = finish
        self._label = label
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            with record_function(self._label):
                self._result = self._finish()
            self._done = True
            self._finish = None
        return self._result

    def is_completed(self) -> bool:
        return self._done


def finish(handle_fn, async_op: bool, label: str):
    """A Handle for async calls; synchronous ones complete now and return None (as
    torch.distributed's do). ``label`` + ``::wait`` names the completion (waiting, checking
    frames, decoding) in a profile."""
    h = Handle(handle_fn, label + "::wait")
    if async_op:
        return h
    h.wait()
    return None


def finish_with_result(handle_fn, async_op: bool, label: str):
    """Like :func:`finish`, but a synchronous call returns its result (the all-gather's)."""
    h = Handle(handle_fn, label + "::wait")
    return h if async_op else h.wait()


def labelled(label: str):
    """Run the decorated collective's launch inside ``record_function(label)`` (FSDP2 labels
    its phases the same way), so a user's profile shows where the time goes."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return run
    return wrap


def wait_work(work, op: str, sent) -> None:
    """Wait for a c10d work; a transport error gets a note naming ``op``, this rank and
    ``sent()`` (a description of what this rank sent, built only on failure)."""
    try:
        work.wait()
    except RuntimeError as e:
        add_transport_context(e, op, dist.get_rank(), sent())
        raise
