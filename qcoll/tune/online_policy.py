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
  remaining steps would be paid in full. Configurations that ``feasible(point)`` rejects (their
  quantization error is over budget) never run: the tuner is told they are infeasible. After
  ``explore`` measured configurations the policy settles on the best.
- **exploit**: the best configuration runs; each window's median is compared with the cost it
  settled on (a moving reference). ``drift_patience`` windows in a row off by more than
  ``drift_tolerance`` (slower or faster: the link changed) restart the tuner
  (:meth:`Tuner.restart`, told the window just measured) and explore again, for
  ``reexplore`` configurations.
"""
from __future__ import annotations

import enum
import math
import statistics

from ..checks import check_int
from .tuners import Trial, Tuner


class Phase(enum.Enum):
    EXPLORE = "explore"
    EXPLOIT = "exploit"


class OnlinePolicy:
    """Rank 0's side of :class:`~qcoll.tune.AutoTune` (see the module docstring).

    ``tuner``: a :class:`~qcoll.tune.Tuner` over the space; ``start``: the configuration running
    now (a point of the space), measured first. ``feasible``: ``point -> bool``, called before a
    configuration is run (default: every one is).
    """

    def __init__(self, tuner: Tuner, start, window: int = 4, explore: int = 12, reexplore: int | None = None,
                 abort: float = 1.5, drift_tolerance: float = 0.2, drift_patience: int = 2, feasible=None):
        if not isinstance(tuner, Tuner):
            raise TypeError(f"tuner must be a qcoll.tune.Tuner, got {type(tuner).__name__}")
        check_int(window, "window", minimum=1)
        check_int(explore, "explore", minimum=1)
        reexplore = explore if reexplore is None else check_int(reexplore, "reexplore", minimum=1)
        check_int(drift_patience, "drift_patience", minimum=1)
        for name, value, low in (("abort", abort, 1.0), ("drift_tolerance", drift_tolerance, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ValueError(f"{name} must be a number > {low}, got {value!r}")
        self.tuner, self.space = tuner, tuner.space
        self.window, self.explore, self.reexplore, self.abort = window, explore, reexplore, float(abort)
        self.drift_tolerance, self.drift_patience = float(drift_tolerance), drift_patience
        self.feasible = feasible or (lambda point: True)
        self.current = self.space.check(start)
        self.phase = Phase.EXPLORE
        self.times: list[float] = []       # the current window's step seconds
        self.first = len(tuner.trials)     # this exploration's first trial in tuner.trials
        self.budget = explore              # configurations this exploration measures
        self.reference: float | None = None  # exploit: the settled configuration's cost
        self.strikes = 0                   # exploit: windows in a row off the reference
        self.explorations = 1
        self.aborted = 0

    # ------------------------------------------------------------------ schedule
    def due(self) -> int:
        """Steps (>= 1) until the next :meth:`decide`: 1 while a configuration's first step may end
        its window (exploring, with a best cost to compare it with), else the rest of the window."""
        if self.phase is Phase.EXPLORE and not self.times and self._best() is not None:
            return 1
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

    # ------------------------------------------------------------------ explore
    def _best(self) -> Trial | None:
        ok = [t for t in self.tuner.trials[self.first:] if t.feasible]
        return min(ok, key=lambda t: t.cost) if ok else None

    def _decide_explore(self):
        best = self._best()
        early = len(self.times) == 1 and best is not None and self.times[0] > self.abort * best.cost
        if len(self.times) < self.window and not early:
            return None
        self.aborted += early and len(self.times) < self.window
        # the configuration the run started with (or kept across a restart) ran unchecked: checked now
        checked = any(t.point == self.current for t in self.tuner.trials[self.first:])
        self.tuner.tell(self.current, statistics.median(self.times), checked or self.feasible(self.current))
        self.times = []
        if len(self.tuner.trials) - self.first < self.budget:
            nxt = self._ask()
            if nxt is not None:
                return self._switch(nxt)
        best = self._best()
        if best is None:  # nothing feasible was measured: keep exploring what is left
            nxt = self._ask()
            return self._switch(nxt) if nxt is not None else None
        self.phase, self.strikes = Phase.EXPLOIT, 0
        self.reference = best.cost
        return self._switch(best.point)

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
        if point == self.current:
            return None
        self.current = point
        return point

    # ------------------------------------------------------------------ exploit
    def _decide_exploit(self):
        cost = statistics.median(self.times)
        self.times = []
        off = abs(cost / self.reference - 1) > self.drift_tolerance if self.reference > 0 else cost > 0
        self.strikes = self.strikes + 1 if off else 0
        if not off:
            self.reference = 0.8 * self.reference + 0.2 * cost
            return None
        if self.strikes < self.drift_patience:
            return None
        # the step time moved and stayed: the link (or the load) changed; what was measured before is stale
        self.tuner.restart([Trial(self.current, cost, True)])
        self.first, self.budget = 0, self.reexplore
        self.phase, self.strikes, self.reference = Phase.EXPLORE, 0, None
        self.explorations += 1
        if self.budget > 1:
            nxt = self._ask()
            if nxt is not None:
                return self._switch(nxt)
        self.phase, self.reference = Phase.EXPLOIT, cost
        return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-able: the phase, the window so far, and every measurement the tuner holds."""
        return {"current": list(self.current), "phase": self.phase.value, "times": list(self.times),
                "first": self.first, "budget": self.budget, "reference": self.reference, "strikes": self.strikes,
                "explorations": self.explorations, "aborted": self.aborted, "restarts": self.tuner.restarts,
                "trials": [[list(t.point), t.cost if math.isfinite(t.cost) else None, t.feasible]
                           for t in self.tuner.trials]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a policy over a fresh tuner of the same kind and space:
        the tuner is told the saved measurements again (its restarts replayed), so it goes on
        where it stopped instead of exploring from scratch."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        try:
            trials = [Trial(self.space.check(p), math.inf if c is None else float(c), bool(f))
                      for p, c, f in state["trials"]]
            current = self.space.check(state["current"])
            phase = Phase(state["phase"])
            restarts = check_int(state["restarts"], "restarts", minimum=0)
            first = check_int(state["first"], "first", minimum=0)
            budget = check_int(state["budget"], "budget", minimum=1)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an OnlinePolicy state: {e!r}") from e
        self.tuner.restarts = restarts - 1 if restarts else 0
        if restarts:
            self.tuner.restart(trials)
        else:
            for t in trials:
                self.tuner.tell(t.point, t.cost, t.feasible)
        self.current, self.phase, self.first, self.budget = current, phase, first, budget
        self.times = [float(t) for t in state["times"]]
        self.reference = None if state["reference"] is None else float(state["reference"])
        self.strikes, self.explorations = int(state["strikes"]), int(state["explorations"])
        self.aborted = int(state["aborted"])
