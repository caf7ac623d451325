"""The sweep's progress bar: a tqdm bar on stderr, drawn by rank 0 only.

The bar appears only once a sweep has run for ``delay`` seconds (short runs
print nothing), redraws at most every ``mininterval`` seconds on one line, and
erases itself when closed (``leave=False``), so the table printed afterwards
starts on a clean line. It is drawn only on a terminal; ``QCOLL_PROGRESS=1``
forces it (e.g. under a pager or in a log), ``QCOLL_PROGRESS=0`` turns it off.
"""
from __future__ import annotations

import os
import sys
import threading

from tqdm.auto import tqdm

FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"


def wanted(stream) -> bool:
    """Whether to draw on ``stream``: ``QCOLL_PROGRESS`` if set, else whether ``stream`` is a terminal."""
    setting = os.environ.get("QCOLL_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bar(total: float, *, enabled: bool | None = None, file=None, delay: float = 3.0,
        mininterval: float = 0.2) -> tqdm:
    """A bar for ``total`` units of work (any weights: bytes, steps); ``update(amount)`` as they finish.

    ``enabled=None``: draw when :func:`wanted`. The running piece of work is named with
    ``set_postfix_str(note, refresh=False)`` and shown on the next ``update`` (``update(0)``
    redraws now, within ``delay`` and ``mininterval``). Use it as a context manager.
    """
    file = file if file is not None else sys.stderr
    enabled = wanted(file) if enabled is None else bool(enabled)
    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock holds a multiprocessing RLock (a named semaphore); a rank stopped on Ctrl-C leaks
        # it and the resource tracker warns at exit. One process draws, so a thread lock is enough.
        tqdm.set_lock(threading.RLock())
    # miniters=0: every update() may redraw (subject to mininterval), so update(0) shows a new note
    return tqdm(total=total, desc="qcoll-bench", file=file, disable=not enabled, leave=False, delay=delay,
                mininterval=mininterval, miniters=0, bar_format=FORMAT, dynamic_ncols=True)
