"""Progress of the long subcommands, on stderr, drawn by rank 0 only (stdout keeps the tables).

Three styles (:func:`style`): on a terminal a tqdm bar (``bar``); otherwise -- a pipe, a log
file, a CI step -- plain lines (``plain``); ``QCOLL_PROGRESS=1`` forces the bar (e.g. under a
pager), ``QCOLL_PROGRESS=0`` turns progress off.

:class:`Steps` is what every subcommand reports with: ``begin(label, total)`` when a run
starts (a mode, a configuration, a run of a trace), ``update(done)`` / ``step()`` as its units
(steps, iterations, trials) finish, ``end()`` when it is done, ``close()`` at the end. As a
bar: one tqdm bar per run, described by the command and the run (``train zeropp (1/2)``),
erased when the run ends. As plain lines: a line when a run begins, one at most every
``interval`` seconds while it runs (a ticker thread prints one even while a long step or the
start-up runs, so nothing is silent for long), and one when it ends::

    qcoll-bench train: zeropp (1/2) step 0/20
    qcoll-bench train: zeropp (1/2) step 5/20, 12 s
    qcoll-bench train: zeropp (1/2) step 20/20, done in 41 s

:func:`starting` reports the ranks' start-up (``starting 4 ranks``) from the command's process
until rank 0 reports. :func:`bar` is the sweep's bar of ``collectives`` (it appears only
once a sweep has run for ``delay`` seconds, redraws at most every ``mininterval`` seconds on
one line and erases itself when closed); :func:`sweep` is that bar on a terminal and plain
lines elsewhere.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time

from tqdm.auto import tqdm

PROG = "qcoll-bench"
FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"
#: a run of known length: the bar, units done of the total, elapsed and remaining time
STEPS_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} {elapsed}<{remaining}{postfix}"
#: a run of unknown length (start-up, a replay): its name and the time it has taken
OPEN_FORMAT = "{desc}: {elapsed}{postfix}"
INTERVAL_S = 5.0          # plain lines: at most one per run every this many seconds
TICK_S = 1.0              # the ticker's period: a bar's clock redrawn, a plain line checked
STARTED_ENV = "QCOLL_PROGRESS_STARTED"


def style(stream) -> str:
    """``"bar"``, ``"plain"`` or ``"off"`` for ``stream``: ``QCOLL_PROGRESS`` if set (1: bar, 0: off), else
    the bar on a terminal and plain lines elsewhere."""
    setting = os.environ.get("QCOLL_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return "off"
    if setting in ("1", "true", "yes", "on"):
        return "bar"
    try:
        return "bar" if stream.isatty() else "plain"
    except (AttributeError, ValueError):
        return "plain"


_style_of = style


def wanted(stream) -> bool:
    """Whether to draw a bar on ``stream``: ``QCOLL_PROGRESS`` if set, else whether ``stream`` is a terminal."""
    return style(stream) == "bar"


def is_first_rank() -> bool:
    """Whether this process reports for the command: the parent of the spawned ranks, or rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0"


def line(command: str, text: str) -> str:
    """A plain progress line of ``command`` (no newline)."""
    return f"{PROG} {command}: {text}"


def is_line(text: str, command: str) -> bool:
    """Whether ``text`` (one line) is a plain progress line of ``command`` (not its usage error)."""
    prefix = f"{PROG} {command}: "
    return text.startswith(prefix) and not text.startswith(prefix + "error:")


@contextlib.contextmanager
def starting(command: str, ranks: int, file=None, **steps_options):
    """Around ``run_ranks`` in the command's process: ``starting N ranks`` at once (the ranks' start-up,
    torch imported in each, takes seconds), as a run of its own until rank 0's first :class:`Steps`
    exists (a marker file named by ``QCOLL_PROGRESS_STARTED``, which the ranks inherit, is removed
    then). Under torchrun (``RANK`` set) rank 0 prints the line once; other ranks nothing."""
    file = file if file is not None else sys.stderr
    chosen = steps_options.pop("style", None) or _style_of(file)
    if chosen == "off" or not is_first_rank():
        yield
        return
    text = f"starting {ranks} ranks"
    if "RANK" in os.environ:
        if chosen == "plain":
            print(line(command, text), file=file, flush=True)
        yield
        return
    # created before the marker (a Steps removes it); ticked by the watcher, after it has seen the marker
    steps = Steps(command, style=chosen, file=file, **steps_options, ticker=False)
    steps.begin(text)
    fd, marker = tempfile.mkstemp(prefix="qcoll-progress-")
    os.close(fd)
    previous = os.environ.get(STARTED_ENV)
    os.environ[STARTED_ENV] = marker
    stop = threading.Event()

    def watch():
        while not stop.wait(0.2):
            if not os.path.exists(marker):
                steps.close()
                return
            with contextlib.suppress(Exception):   # a redraw must never take the command down
                steps.tick()

    watcher = threading.Thread(target=watch, name="qcoll-bench-starting", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(5)
        steps.close()
        if previous is None:
            os.environ.pop(STARTED_ENV, None)
        else:
            os.environ[STARTED_ENV] = previous
        with contextlib.suppress(OSError):
            os.unlink(marker)


def _mark_started() -> None:
    """Rank 0 reports now: end :func:`starting`'s run in the parent (remove its marker)."""
    marker = os.environ.pop(STARTED_ENV, None)
    if marker:
        with contextlib.suppress(OSError):
            os.unlink(marker)


def _tqdm(**kwargs) -> tqdm:
    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock holds a multiprocessing RLock (a named semaphore); a rank stopped on Ctrl-C leaks
        # it and the resource tracker warns at exit. One process draws, so a thread lock is enough.
        tqdm.set_lock(threading.RLock())
    return tqdm(**kwargs)


def bar(total: float, *, enabled: bool | None = None, file=None, delay: float = 3.0,
        mininterval: float = 0.2) -> tqdm:
    """A bar for ``total`` units of work (any weights: bytes, steps); ``update(amount)`` as they finish.

    ``enabled=None``: draw when :func:`wanted`. The running piece of work is named with
    ``set_postfix_str(note, refresh=False)`` and shown on the next ``update`` (``update(0)``
    redraws now, within ``delay`` and ``mininterval``). Use it as a context manager.
    """
    file = file if file is not None else sys.stderr
    enabled = wanted(file) if enabled is None else bool(enabled)
    # miniters=0: every update() may redraw (subject to mininterval), so update(0) shows a new note
    return _tqdm(total=total, desc=PROG, file=file, disable=not enabled, leave=False, delay=delay,
                 mininterval=mininterval, miniters=0, bar_format=FORMAT, dynamic_ncols=True)


class Steps:
    """A command's progress: runs (``begin``/``end``) of units (``update``/``step``); see the module docstring.

    ``enabled=False`` (ranks other than 0) reports nothing. ``style`` (``"bar"``, ``"plain"``,
    ``"off"``) overrides :func:`style` of ``file`` (default stderr). ``interval``: the plain
    lines' spacing in seconds; ``clock``: seconds, monotonic (tests pass a fake one);
    ``ticker=False``: no thread (tests call :meth:`tick` themselves). Thread-safe; a context manager.
    """

    def __init__(self, command: str, *, enabled: bool = True, style: str | None = None, file=None,
                 interval: float = INTERVAL_S, clock=time.monotonic, ticker: bool = True, mininterval: float = 0.2):
        self.command = command
        self.file = file if file is not None else sys.stderr
        chosen = _style_of(self.file) if style is None else style
        if chosen not in ("bar", "plain", "off"):
            raise ValueError(f"style must be bar, plain or off, got {chosen!r}")
        self.style = chosen if enabled else "off"
        if enabled:
            _mark_started()
        self.interval, self.clock, self.mininterval = float(interval), clock, mininterval
        self._lock = threading.RLock()
        self._run = None         # the current run: dict(label, total, unit, done, note, start, timed)
        self._bar = None
        self._last_line = None   # clock time of the last plain line
        self._stop = threading.Event()
        self._thread = None
        if ticker and self.style != "off":
            self._thread = threading.Thread(target=self._tick_loop, name="qcoll-bench-progress", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the runs
    def begin(self, label: str, total: float | None = None, unit: str = "step", *, timed: bool = False) -> None:
        """A new run ``label`` of ``total`` units (None: unknown; only its time is shown); ends the current one.
        ``timed``: the units are the seconds since it began (``unit="s"``; e.g. a trace being played)."""
        if self.style == "off":
            return
        with self._lock:
            self._end()
            now = self.clock()
            self._run = {"label": label, "total": total, "unit": unit, "done": 0, "note": "", "start": now,
                         "timed": timed}
            if self.style == "bar":
                counted = total is not None
                self._bar = _tqdm(total=total, desc=f"{self.command} {label}", unit=unit, file=self.file,
                                  leave=False, delay=0, mininterval=self.mininterval, miniters=0,
                                  bar_format=STEPS_FORMAT if counted else OPEN_FORMAT, dynamic_ncols=True)
            else:
                self._print(self._state(now, begun=True), now)

    def update(self, done: float, note: str | None = None) -> None:
        """``done`` units of the current run are done (absolute); ``note``: what runs now (shown after the count)."""
        if self.style == "off":
            return
        with self._lock:
            if self._run is None:
                return
            if note is not None:
                self._run["note"] = note
            self._set(done)
            now = self.clock()
            run = self._run
            last = run["total"] is not None and run["done"] >= run["total"]   # end() prints that one
            if self.style == "plain" and not last and now - self._last_line >= self.interval:
                self._print(self._state(now), now)

    def step(self, n: float = 1) -> None:
        """``n`` more units of the current run are done."""
        with self._lock:
            if self._run is not None:
                self.update(self._run["done"] + n)

    def note(self, text: str) -> None:
        """Name what runs now in the current run (shown with the next line or redraw)."""
        with self._lock:
            if self._run is not None:
                self.update(self._run["done"], note=text)

    def end(self) -> None:
        """The current run is done: its bar is erased, or its last line printed (runs of a known total)."""
        with self._lock:
            self._end()

    def write(self, text: str) -> None:
        """Print ``text`` (a line of results, not progress) on the progress stream, above a bar if one is drawn
        (in every style: it is output, which ``QCOLL_PROGRESS`` does not turn off)."""
        with self._lock:
            try:
                if self._bar is not None:
                    self._bar.write(text, file=self.file)
                else:
                    print(text, file=self.file, flush=True)
            except (OSError, ValueError):
                pass

    def tick(self) -> None:
        """What the ticker does every second: a bar's clock redrawn; a plain line if ``interval`` has passed."""
        with self._lock:
            if self._run is None:
                return
            now = self.clock()
            if self._run["timed"]:
                self._set(int(now - self._run["start"]))
            if self._bar is not None:
                self._bar.refresh()
            elif self.style == "plain" and now - self._last_line >= self.interval:
                self._print(self._state(now), now)

    def close(self, *, finished: bool = True) -> None:
        """End the current run and stop the ticker (call it before the tables are printed); ``finished=False``
        (the command failed): no last line claims the run is done."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._lock:
            self._end(finished)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(finished=exc_type is None)

    # ------------------------------------------------------------------ inside
    def _set(self, done: float) -> None:
        run = self._run
        if run["total"] is not None:
            done = min(done, run["total"])
        run["done"] = done
        if self._bar is not None:
            self._bar.set_postfix_str(run["note"], refresh=False)
            self._bar.update(done - self._bar.n)   # redraws within mininterval

    def _end(self, finished: bool = True) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.style == "plain" and run["total"] is not None and finished:
            self._run = run
            now = self.clock()
            if run["timed"]:
                run["done"] = min(int(now - run["start"]), run["total"])
            self._print(self._state(now, ended=True), now)
            self._run = None

    def _state(self, now: float, *, begun: bool = False, ended: bool = False) -> str:
        run = self._run
        text = run["label"]
        if run["total"] is not None:
            done, total = run["done"], run["total"]
            if run["unit"] == "s":
                text += f" {done:.0f}/{total:.0f} s"
            elif run["unit"] == "%":
                text += f" {done:.0f}%"
            else:
                text += f" {run['unit']} {_num(done)}/{_num(total)}"
        if not begun:
            elapsed = now - run["start"]
            text += f", done in {elapsed:.0f} s" if ended else f", {elapsed:.0f} s"
        if run["note"] and not ended:
            text += f" ({run['note']})"
        return text

    def _print(self, text: str, now: float) -> None:
        self._last_line = now
        try:
            print(line(self.command, text), file=self.file, flush=True)
        except (OSError, ValueError):   # a closed or broken stderr: progress is not worth failing the run for
            pass

    def _tick_loop(self) -> None:
        while not self._stop.wait(min(TICK_S, self.interval)):
            try:
                self.tick()
            except Exception:   # a redraw must never take the command down
                pass


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}"


class _PlainSweep:
    """:func:`bar`'s interface (``set_postfix_str``, ``update``, a context manager) as :class:`Steps` plain lines,
    for a sweep weighted by bytes: its share done in percent."""

    def __init__(self, steps: Steps, total: float, label: str):
        self.steps, self.total = steps, float(total) or 1.0
        self.n = 0.0
        steps.begin(label, 100, unit="%")

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.steps.note(s)

    def update(self, n: float = 1) -> None:
        self.n += n
        self.steps.update(round(100 * self.n / self.total))

    def close(self, *, finished: bool = True) -> None:
        self.steps.close(finished=finished)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(finished=exc_type is None)


def sweep(total: float, command: str, *, enabled: bool = True, file=None, label: str = "sweep", **steps_options):
    """The progress of a sweep of ``total`` weighted units: :func:`bar` on a terminal (or with
    ``QCOLL_PROGRESS=1``), plain lines of :class:`Steps` (``<label> 45%, 12 s (<note>)``) in the plain
    style, nothing with ``QCOLL_PROGRESS=0`` or ``enabled=False``. The same interface either way."""
    file = file if file is not None else sys.stderr
    chosen = steps_options.pop("style", None) or _style_of(file)
    if enabled:
        _mark_started()
    if not enabled or chosen != "plain":
        return bar(total, enabled=enabled and chosen == "bar", file=file)
    return _PlainSweep(Steps(command, style="plain", file=file, **steps_options), total, label)
