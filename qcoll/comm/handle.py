"""Async handles returned by the collectives when ``async_op=True``, and their profiler labels."""
from __future__ import annotations

import functools
import time

from torch.autograd.profiler import record_function

from . import liveness
from .c10d import group_ranks, is_bare, my_rank
from .errors import add_transport_context
from .stats import stats


class Handle:
    """Completes a collective: ``wait()`` waits for the communication and runs
    the remaining local work (dequantization, reductions). Idempotent.

    A collective of dependent stages (the hierarchical all-gather, qgZ's two hops) launches a
    later stage once the earlier one's data has arrived. ``advance()`` launches the stages that
    are still due now, waiting for the transport of the ones they depend on, and returns
    without waiting for them; ``wait()`` launches whatever is left. A caller that has other
    work calls ``advance()`` some time after the launch (the ZeRO layer does at its next
    hook), so that the first stage's transport overlaps that work and the next stage's the
    work after it. ``advance()`` can launch collectives: like the collectives themselves,
    every rank must call it at the same point of its sequence of collectives (matching is by
    order; a call that depends on timing, e.g. on ``is_completed()``, would mismatch)."""

    def __init__(self, finish, label: str, advance=None):
        self._finish = finish
        self._advance = advance
        self._label = label
        self._done = False
        self._result = None

    def advance(self) -> None:
        """Launch the stages still due (waiting for the data they depend on); a no-op once
        they are all launched or the handle is done."""
        if not self._done and self._advance is not None:
            self._advance()

    def wait(self):
        if not self._done:
            with record_function(self._label):
                self._result = self._finish()
            self._done = True
            self._finish = self._advance = None
        return self._result

    def is_completed(self) -> bool:
        return self._done


def finish(handle_fn, async_op: bool, label: str, advance=None):
    """A Handle for async calls; synchronous ones complete now and return None (as
    torch.distributed's do). ``label`` + ``::wait`` names the completion (waiting, checking
    frames, decoding) in a profile; ``advance``: what the handle's ``advance()`` runs."""
    h = Handle(handle_fn, label + "::wait", advance)
    if async_op:
        return h
    h.wait()
    return None


def finish_with_result(handle_fn, async_op: bool, label: str, advance=None):
    """Like :func:`finish`, but a synchronous call returns its result (the all-gather's)."""
    h = Handle(handle_fn, label + "::wait", advance)
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


def wait_work(work, op: str, sent, group=None) -> None:
    """Wait for a c10d work over ``group`` (None: the default group); a transport error gets a
    note naming ``op``, this rank, ``sent()`` (a description of what this rank sent, built only
    on failure) and which of the group's ranks are no longer running (:mod:`.liveness`). The
    seconds blocked here count in ``stats.blocked_seconds[op]`` (communication not hidden)."""
    t0 = time.perf_counter()
    try:
        work.wait()
    except RuntimeError as e:
        bare = is_bare(group)
        ranks = group_ranks(group)
        add_transport_context(e, op, my_rank(group), sent(),
                              "The group is a bare replica group (torchft's): ask its manager which replica "
                              "left." if bare else liveness.describe(ranks))
        raise
    finally:
        stats.add_blocked(op, time.perf_counter() - t0)
