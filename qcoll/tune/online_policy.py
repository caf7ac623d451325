"""``OnlinePolicy``: which configuration the next training steps run, from the step times so far.

The decisions of :class:`qcoll.tune.AutoTune`, without ranks or a model (so that a test, or a
replay of recorded step times, drives them with a clock of its own). One process decides (rank
0); the policy says how many steps pass before its next decision (:meth:`OnlinePolicy.due`), so
the other ranks only hear from it then.

Two phases:

- **explore**: each configuration the tuner asks for runs for a window of ``window`` steps and its
  cost is their median (a median: one step disturbed by the machine does not move it). A
  configuration whose first step already takes ``abort`` times the best cost seen in this
  exploration ends its window there, with that step as its cost: it is not the best, and its
  remaining steps would be paid in full (for other observations, e.g. a server's request
  latencies, ``window_cost`` turns a window's observations into its cost, default their median,
  and the early end is judged on the window's first ``abort_after`` observations). Configurations that ``feasible(point)`` rejects (their
  quantization error is over budget) never run: the tuner is told they are infeasible. After
  ``explore`` measured configurations the policy settles on the best.
- **exploit**: the best configuration runs, and the measured ones race: one window is noisy, so the
  best of a dozen single windows is usually one that was lucky (the winner's curse). Every window
  adds to its configuration's mean; a configuration whose optimistic estimate (its mean lowered by
  the windows' noise over the root of its count) beats the running one's mean by 2% runs next, up
  to ``confirm`` windows in all, and the one with the best mean runs from then on. The same windows
  watch for drift: ``drift_patience`` windows in a row more than ``drift_tolerance`` off the running
  configuration's mean (slower or faster: the link changed) restart the tuner (:meth:`Tuner.restart`,
  told the window just measured) and explore again, for ``reexplore`` configurations. A caller
  that sees the workload change itself (a server's request rate) calls :meth:`restart`.
"""
from __future__ import annotations

import enum
import math
import statistics

from ..checks import check_int, check_number
from .tuners import Trial, Tuner

#: the windows' relative noise assumed until two windows of one configuration measure it
DEFAULT_NOISE = 0.05
HYSTERESIS = 0.02


class Phase(enum.Enum):
    EXPLORE = "explore"
    EXPLOIT = "exploit"


class OnlinePolicy:
    """Rank 0's side of :class:`~qcoll.tune.AutoTune` (see the module docstring).

    ``tuner``: a :class:`~qcoll.tune.Tuner` over the space; ``start``: the configuration running
    now (a point of the space), measured first. ``feasible``: ``point -> bool``, called before a
    configuration is run (default: every one is). ``confirm``: windows a challenger may run while
    exploiting (racing; 1: none). ``window_cost``: ``list of observations -> cost`` (default the
    median); ``abort_after``: observations after which a window may end early.
    """

    def __init__(self, tuner: Tuner, start, window: int = 4, explore: int = 12, reexplore: int | None = None,
                 abort: float = 1.5, drift_tolerance: float = 0.2, drift_patience: int = 2, confirm: int = 3,
                 feasible=None, window_cost=None, abort_after: int = 1):
        if not isinstance(tuner, Tuner):
            raise TypeError(f"tuner must be a qcoll.tune.Tuner, got {type(tuner).__name__}")
        check_int(window, "window", minimum=1)
        check_int(explore, "explore", minimum=1)
        reexplore = explore if reexplore is None else check_int(reexplore, "reexplore", minimum=1)
        check_int(drift_patience, "drift_patience", minimum=1)
        check_int(confirm, "confirm", minimum=1)
        check_int(abort_after, "abort_after", minimum=1)
        if abort_after > window:
            raise ValueError(f"abort_after ({abort_after}) must be <= window ({window})")
        check_number(abort, "abort", above=1.0)
        check_number(drift_tolerance, "drift_tolerance", above=0.0)
        self.tuner, self.space = tuner, tuner.space
        self.window, self.explore, self.reexplore, self.abort = window, explore, reexplore, float(abort)
        self.drift_tolerance, self.drift_patience, self.confirm = float(drift_tolerance), drift_patience, confirm
        self.feasible = feasible or (lambda point: True)
        self.window_cost = window_cost or statistics.median
        self.abort_after = abort_after
        self.current = self.space.check(start)
        self.phase = Phase.EXPLORE
        self.times: list[float] = []       # the current window's step seconds
        self.first = len(tuner.trials)     # this exploration's first trial in tuner.trials
        self.budget = explore              # configurations this exploration measures
        self.samples: dict[tuple, list[float]] = {}   # this exploration's window costs of feasible configurations
        self.strikes = 0                   # exploit: windows in a row off the running configuration's mean
        self.explorations = 1
        self.aborted = 0

    # ------------------------------------------------------------------ schedule
    def due(self) -> int:
        """Steps (>= 1) until the next :meth:`decide`: up to ``abort_after`` while they may end a
        configuration's window (exploring, with a best cost to compare with), else the rest of the window."""
        if self.phase is Phase.EXPLORE and len(self.times) < self.abort_after and self.samples:
            return self.abort_after - len(self.times)
        return max(1, self.window - len(self.times))

    def observe(self, seconds: float) -> None:
        """One step of the current configuration took ``seconds``."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a step's seconds must be finite and >= 0, got {seconds!r}")
        self.times.append(seconds)

    def decide(self):
        """After :meth:`due` steps: the configuration to switch to, or None to keep the current one."""
        if self.phase is Phase.EXPLORE:
            return self._decide_explore()
        return self._decide_exploit()

    # ------------------------------------------------------------------ estimates
    def mean(self, point) -> float:
        """The mean of ``point``'s window costs in this exploration (inf: none)."""
        got = self.samples.get(point)
        return statistics.fmean(got) if got else math.inf

    def best(self):
        """The configuration with the lowest mean window cost in this exploration (None: none yet)."""
        return min(self.samples, key=self.mean) if self.samples else None

    def noise(self) -> float:
        """The windows' relative standard deviation, pooled over configurations with two or more
        (``DEFAULT_NOISE`` until there are some), kept within [0.01, 0.3]."""
        devs = [statistics.stdev(v) / statistics.fmean(v) for v in self.samples.values() if len(v) >= 2]
        return min(0.3, max(0.01, statistics.fmean(devs))) if devs else DEFAULT_NOISE

    # ------------------------------------------------------------------ explore
    def _decide_explore(self):
        best = self.best()
        early = (len(self.times) == self.abort_after and best is not None
                 and self.window_cost(self.times) > self.abort * self.mean(best))
        if len(self.times) < self.window and not early:
            return None
        self.aborted += early and len(self.times) < self.window
        cost, self.times = self.window_cost(self.times), []
        if self.current in self.samples:     # a configuration met again (kept across a restart)
            self.samples[self.current].append(cost)
        else:   # its first window: told the tuner (checked: the start ran unchecked; AutoTune caches the answer)
            feasible = self.feasible(self.current)
            self.tuner.tell(self.current, cost, feasible)
            if feasible:
                self.samples[self.current] = [cost]
        if len(self.tuner.trials) - self.first < self.budget:
            nxt = self._ask()
            if nxt is not None:
                return self._switch(nxt)
        best = self.best()
        if best is None:  # nothing feasible was measured: keep exploring what is left
            nxt = self._ask()
            return self._switch(nxt) if nxt is not None else None
        self.phase = Phase.EXPLOIT
        return self._switch(best)

    def _ask(self):
        """The tuner's next feasible configuration not measured in this exploration (None: it has
        none left; an infeasible one is told so and another asked for)."""
        measured = {t.point: t for t in self.tuner.trials[self.first:]}
        for _ in range(2 * len(self.space)):
            point = self.space.check(self.tuner.ask())
            if point in measured:   # asked again (TPE may): it keeps its measurement
                t = measured[point]
                self.tuner.tell(point, t.cost, t.feasible)
                if len(measured) == len(self.space):
                    return None
                continue
            if self.feasible(point):
                return point
            self.tuner.tell(point, math.inf, False)
            measured[point] = self.tuner.trials[-1]
        return None

    def _switch(self, point):
        self.strikes = 0
        if point == self.current:
            return None
        self.current = point
        return point

    # ------------------------------------------------------------------ exploit
    def _decide_exploit(self):
        cost, self.times = self.window_cost(self.times), []
        before = self.samples.setdefault(self.current, [])
        reference = statistics.fmean(before) if len(before) >= 2 else None
        before.append(cost)
        off = reference is not None and abs(cost / reference - 1) > self.drift_tolerance
        self.strikes = self.strikes + 1 if off else 0
        if self.strikes >= self.drift_patience:
            return self.restart(cost)
        if off:
            return None
        return self._switch(self._challenger())

    def _challenger(self):
        """What runs next: the configuration whose optimistic estimate beats the running one's mean
        by ``HYSTERESIS`` and that has run fewer than ``confirm`` windows, else the best mean."""
        noise, running = self.noise(), self.mean(self.current)
        optimistic = {p: self.mean(p) * (1 - noise / math.sqrt(len(v))) for p, v in self.samples.items()
                      if p != self.current and len(v) < self.confirm}
        if optimistic:
            p = min(optimistic, key=optimistic.get)
            if optimistic[p] < running * (1 - HYSTERESIS):
                return p
        best = self.best()
        return best if self.mean(best) < running * (1 - HYSTERESIS) else self.current

    def restart(self, cost: float | None = None):
        """The step time moved and stayed: the link (or the load) changed; what was measured is stale.
        The tuner is told only ``cost`` (the running configuration's latest window; None: its next
        window is measured first) and explores ``reexplore`` configurations; returns the
        configuration to switch to (None: keep)."""
        self.tuner.restart([Trial(self.current, cost, True)] if cost is not None else [])
        self.times = []
        self.first, self.budget = 0, self.reexplore
        self.samples = {self.current: [cost]} if cost is not None else {}
        self.phase, self.strikes = Phase.EXPLORE, 0
        self.explorations += 1
        if cost is None:   # the running configuration's next window is this exploration's first measurement
            return None
        if self.budget > 1:
            nxt = self._ask()
            if nxt is not None:
                return self._switch(nxt)
        self.phase = Phase.EXPLOIT
        return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-able: the phase, the window so far, every measurement the tuner holds and the windows'
        costs per configuration."""
        return {"current": list(self.current), "phase": self.phase.value, "times": list(self.times),
                "first": self.first, "budget": self.budget, "strikes": self.strikes,
                "explorations": self.explorations, "aborted": self.aborted, "restarts": self.tuner.restarts,
                "samples": [[list(p), list(v)] for p, v in self.samples.items()],
                "trials": [[list(t.point), t.cost if math.isfinite(t.cost) else None, t.feasible]
                           for t in self.tuner.trials]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a policy over a fresh tuner of the same kind and space:
        the tuner is told the saved measurements again (its restarts replayed), so it goes on
        where it stopped instead of exploring from scratch. Every field is checked before anything
        changes: a ``ValueError`` naming the field for anything :meth:`state_dict` could not have
        written (a missing field, a point that is not a list of the space's indices, a non-finite
        or negative cost or step time, a feasible trial without a cost, an empty list of window
        costs); ``TypeError`` when ``state`` is not a dict."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        missing = [k for k in _STATE_FIELDS if k not in state]
        if missing:
            raise ValueError(f"not an OnlinePolicy state: no {', '.join(map(repr, missing))}")
        trials = [self._trial(t, f"trials[{i}]") for i, t in enumerate(_list(state["trials"], "trials"))]
        samples = {}
        for i, entry in enumerate(_list(state["samples"], "samples")):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ValueError(f"samples[{i}] must be [point, window costs], got {entry!r:.80}")
            p = point_of(self.space, entry[0], f"samples[{i}] point")
            costs = [_seconds(c, f"samples[{i}] cost") for c in _list(entry[1], f"samples[{i}] costs")]
            if not costs or p in samples:
                raise ValueError(f"samples[{i}]: {'no window costs' if not costs else 'a point listed twice'}")
            samples[p] = costs
        current = point_of(self.space, state["current"], "current")
        if state["phase"] not in [p.value for p in Phase]:
            raise ValueError(f"phase must be one of {[p.value for p in Phase]}, got {state['phase']!r:.80}")
        restarts = check_int(state["restarts"], "restarts", minimum=0)
        first = check_int(state["first"], "first", minimum=0, maximum=len(trials))
        budget = check_int(state["budget"], "budget", minimum=1)
        times = [_seconds(t, "times") for t in _list(state["times"], "times")]
        counts = [check_int(state[k], k, minimum=m) for k, m in (("strikes", 0), ("explorations", 1), ("aborted", 0))]
        self.tuner.restarts = restarts - 1 if restarts else 0
        if restarts:
            self.tuner.restart(trials)
        else:
            for t in trials:
                self.tuner.tell(t.point, t.cost, t.feasible)
        self.current, self.phase, self.first, self.budget = current, Phase(state["phase"]), first, budget
        self.samples, self.times = samples, times
        self.strikes, self.explorations, self.aborted = counts

    def _trial(self, entry, name: str) -> Trial:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"{name} must be [point, cost, feasible], got {entry!r:.80}")
        point, cost, feasible = entry
        if not isinstance(feasible, bool):
            raise ValueError(f"{name} feasible must be a bool, got {feasible!r:.80}")
        if cost is None and feasible:
            raise ValueError(f"{name}: a feasible trial needs a cost, got None")
        return Trial(point_of(self.space, point, f"{name} point"), math.inf if cost is None else
                     _seconds(cost, f"{name} cost"), feasible)


#: the fields of :meth:`OnlinePolicy.state_dict`
_STATE_FIELDS = ("current", "phase", "times", "first", "budget", "strikes", "explorations", "aborted", "restarts",
                 "samples", "trials")


def point_of(space, value, name: str) -> tuple:
    """``value`` (a saved configuration) as a point of ``space``: a list of ints (not bools), one
    per knob, each an index of its knob's values; else ``ValueError`` naming ``name``."""
    if (not isinstance(value, (list, tuple)) or len(value) != len(space.knobs)
            or any(isinstance(i, bool) or not isinstance(i, int) for i in value)):
        raise ValueError(f"{name} must be a list of {len(space.knobs)} ints (indices of the knobs' values), "
                         f"got {value!r:.80}")
    try:
        return space.check(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _list(value, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return value


def _seconds(value, name: str) -> float:
    """A saved step time or cost: a finite number >= 0."""
    return check_number(value, name, minimum=0)


