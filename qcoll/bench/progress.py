"""A dependency-free progress bar on stderr for long sweeps (rank 0 only).

The bar appears only once a sweep has run for ``delay`` seconds (short runs
print nothing), redraws at most every ``interval`` seconds on one line, and
erases itself on :meth:`Progress.close`, so the table printed afterwards starts
on a clean line. It is drawn only on a terminal; ``QCOLL_PROGRESS=1`` forces it
(e.g. under a pager or in a log), ``QCOLL_PROGRESS=0`` turns it off.
"""
from __future__ import annotations

import os
import sys
import time


def wanted(stream) -> bool:
    setting = os.environ.get("QCOLL_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``total`` units of work (any weights: bytes, steps); :meth:`advance` as they finish."""

    def __init__(self, total: float, *, enabled: bool | None = None, stream=None, label: str = "qcoll-bench",
                 delay: float = 3.0, interval: float = 0.2, width: int = 24):
        """``enabled=None``: draw when :func:`wanted` (a terminal, or ``QCOLL_PROGRESS``)."""
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = wanted(self.stream) if enabled is None else bool(enabled)
        self.total = max(float(total), 1e-12)
        self.label, self.delay, self.interval, self.width = label, delay, interval, width
        self.done = 0.0
        self.note = ""
        self.started = time.monotonic()
        self._last_draw = float("-inf")
        self._drawn = 0   # length of the line on screen

    def start(self, note: str) -> None:
        """Name the piece of work now running (shown on the next redraw)."""
        self.note = note
        self._draw()

    def advance(self, amount: float) -> None:
        self.done = min(self.total, self.done + amount)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = now - self.started
        if elapsed < self.delay or (not force and now - self._last_draw < self.interval):
            return
        self._last_draw = now
        frac = self.done / self.total
        fill = int(frac * self.width)
        eta = f"ETA {_eta(elapsed * (1 - frac) / frac)}" if frac > 0 else "ETA ?"
        line = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:3.0f}% {eta} {self.note}"
        line = line[:100]
        self.stream.write("\r" + line + " " * max(0, self._drawn - len(line)))
        self.stream.flush()
        self._drawn = len(line)

    def close(self) -> None:
        """Erase the bar (if it was ever drawn)."""
        if self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
