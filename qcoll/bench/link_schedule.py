"""A link whose rate changes during a run: ``--link 100mbit@0,20mbit@150`` (the rate from step 150 on).

Both sides of ``qcoll-bench cluster``:

- the ranks (``train``): rank 0 writes ``"<run> <step>"`` to the file named by ``QCOLL_LINK_PROGRESS``
  before each step (:class:`ProgressWriter`; atomic, a rename), where ``<run>`` counts the runs of
  the command (each mode's steps start at 0 again, and so does the schedule);
- the driver (``cluster``): :class:`RateFollower`, a thread, reads that file every 10 ms and sets the
  rate the schedule gives for the step (``tc qdisc change`` of every shaped device,
  :meth:`qcoll.bench.netns.Network.set_rate`), recording each change.

The change lands within one poll of the step's start (the step itself takes 100 ms or more on the
emulated cluster). ``QCOLL_LINK_SCHEDULE`` tells the ranks the schedule (``train`` reports against it).
"""
from __future__ import annotations

import os
import threading
import time

PROGRESS_ENV = "QCOLL_LINK_PROGRESS"
SCHEDULE_ENV = "QCOLL_LINK_SCHEDULE"
POLL_S = 0.01


def parse_schedule(text: str, parse_rate) -> list[tuple[int, int | None]]:
    """``'100mbit@0,20mbit@150'`` -> ``[(0, 100_000_000), (150, 20_000_000)]`` (``parse_rate`` reads
    each rate); a plain rate is ``[(0, rate)]``. The first entry must be at step 0 and the steps
    must increase; ``ValueError`` naming the part otherwise."""
    out = []
    for part in text.split(","):
        rate, at, step = part.partition("@")
        if at:
            try:
                step = int(step)
            except ValueError:
                raise ValueError(f"{part!r}: the step after @ must be a whole number, as in 20mbit@150") from None
        else:
            step = 0 if not out else None
        if step is None:
            raise ValueError(f"{part!r}: every rate after the first needs its step, as in 20mbit@150")
        if (not out and step != 0) or (out and step <= out[-1][0]):
            raise ValueError(f"{text!r}: the first rate starts at step 0 (@0) and the steps increase")
        out.append((step, parse_rate(rate)))
    return out


def rate_at(schedule: list[tuple[int, int | None]], step: int) -> int | None:
    """The rate of ``schedule`` at ``step``."""
    rate = schedule[0][1]
    for start, r in schedule:
        if step >= start:
            rate = r
    return rate


def change_steps(schedule_text: str | None) -> list[int]:
    """The steps at which the rate of ``QCOLL_LINK_SCHEDULE``'s schedule changes (empty: none)."""
    if not schedule_text:
        return []
    return [int(part.partition("@")[2]) for part in schedule_text.split(",")[1:]]


class ProgressWriter:
    """Rank 0's side: :meth:`step` before each step (does nothing outside a scheduled cluster)."""

    def __init__(self, rank: int):
        self.path = os.environ.get(PROGRESS_ENV) if rank == 0 else None
        self.run = -1

    def begin_run(self) -> None:
        self.run += 1

    def step(self, i: int) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(f"{self.run} {i}\n")
        os.replace(tmp, self.path)


class RateFollower(threading.Thread):
    """The driver's side: sets the schedule's rate for the step the ranks report (see the module)."""

    def __init__(self, path: str, schedule, set_rate):
        super().__init__(daemon=True)
        self.path, self.schedule, self.set_rate = path, schedule, set_rate
        self.current = schedule[0][1]
        self.changes: list[dict] = []   # {"run", "step", "rate_bits", "seconds"}
        self.error: BaseException | None = None
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(POLL_S):
                try:
                    with open(self.path) as fh:
                        run, step = (int(v) for v in fh.read().split())
                except (OSError, ValueError):
                    continue
                rate = rate_at(self.schedule, step)
                if rate != self.current:
                    self.set_rate(rate)
                    self.current = rate
                    self.changes.append({"run": run, "step": step, "rate_bits": rate,
                                         "seconds": time.perf_counter() - self._t0})
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> list[dict]:
        """Stop following; returns the changes made (raises what failed in the thread)."""
        self._stop_event.set()
        self.join(5)
        if self.error is not None:
            raise self.error
        return self.changes
