"""Tuners over a :class:`~qcoll.tune.space.Space`: RRL (region-based reinforcement learning) and the
baselines (exhaustive, random, optuna's TPE), one ask/tell interface.

Every tuner minimises a measured cost (step time) subject to a constraint the objective
reports (``feasible``); an infeasible configuration is never returned as the best.

RRL (Qin et al., SC'19; notes in shared/RESEARCH.md): a table ``Q`` of predicted cost for every
configuration starts filled with the first measurement; the next configuration is drawn by a
softmax over ``1 / Q`` (unmeasured ones only, while any is left); after each measurement a
small regression model (ridge on quadratic features of the ordinal coordinates) is fitted on
all measurements so far and every configuration within the region radius of the measured one
moves toward its estimate, ``Q <- 0.7 Q + 0.3 estimate``; measured configurations hold their
measured cost. The radius adapts (the BO variant's trade of speed against optimality): it
grows while the model predicts new measurements well and shrinks when it does not. When the
workload changes (measurements drift from the predictions ``drift_patience`` times in a row by
more than ``drift_tolerance`` and 3x the recent median error), the tuner keeps only the recent
measurements and re-fills the table from them. ``log_cost=True`` fits the regression on the
logarithm of the cost: for costs that grow by orders of magnitude across the space, like a
server's tail latency, which explodes as a configuration's throughput nears the request rate
(a quadratic in the cost itself would be dragged by the few huge ones).
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..checks import check_int
from .space import Space


@dataclass
class Trial:
    point: tuple
    cost: float
    feasible: bool


class Tuner:
    """Ask/tell: ``ask()`` a configuration, ``tell(point, cost, feasible)`` its measurement."""

    def __init__(self, space: Space, seed: int = 0):
        if not isinstance(space, Space):
            raise TypeError(f"space must be a qcoll.tune.Space, got {type(space).__name__}")
        check_int(seed, "seed")
        self.space, self.seed = space, seed
        self.trials: list[Trial] = []
        self.restarts = 0                 # restart() calls: each draws with another seed

    def ask(self) -> tuple:
        raise NotImplementedError

    def tell(self, point, cost: float, feasible: bool = True) -> None:
        point = self.space.check(point)
        cost = float(cost)
        if math.isnan(cost):
            raise ValueError(f"cost of {point} is NaN")
        self.trials.append(Trial(point, cost, bool(feasible)))
        self._observe(self.trials[-1])

    def _observe(self, trial: Trial) -> None:
        pass

    def restart(self, keep: list[Trial] = ()) -> None:
        """The workload changed (a link, a model): forget every measurement and start over, told
        only ``keep`` (measurements made since the change). Each restart draws anew (seeded)."""
        keep = list(keep)
        self.restarts += 1
        self.trials = []
        self._forget()
        for t in keep:
            self.tell(t.point, t.cost, t.feasible)

    def _forget(self) -> None:
        pass

    def best(self) -> Trial | None:
        """The cheapest feasible measurement so far (None if none is feasible)."""
        ok = [t for t in self.trials if t.feasible]
        return min(ok, key=lambda t: t.cost) if ok else None

    def _unmeasured(self) -> list[tuple]:
        seen = {t.point for t in self.trials}
        return [p for p in self.space.points() if p not in seen]


class Exhaustive(Tuner):
    """Every configuration once, in lexicographic order."""

    def ask(self) -> tuple:
        left = self._unmeasured()
        return left[0] if left else self.space.points()[0]


class RandomSearch(Tuner):
    """Configurations in a seeded random order, each once."""

    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        self._forget()

    def _forget(self) -> None:
        self._order = self.space.points()
        random.Random(self.seed + 7919 * self.restarts).shuffle(self._order)

    def ask(self) -> tuple:
        seen = {t.point for t in self.trials}
        return next((p for p in self._order if p not in seen), self._order[0])


class TPE(Tuner):
    """optuna's TPE sampler over the knobs' indices (categorical), seeded."""

    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._forget()

    def _forget(self) -> None:
        seed = self.seed + 7919 * self.restarts
        self._study = self._optuna.create_study(sampler=self._optuna.samplers.TPESampler(seed=seed),
                                                direction="minimize")
        self._pending = {}

    def ask(self) -> tuple:
        trial = self._study.ask()
        point = tuple(trial.suggest_categorical(k.name, list(range(len(k.values)))) for k in self.space.knobs)
        self._pending.setdefault(point, []).append(trial)
        return point

    def _observe(self, t: Trial) -> None:
        waiting = self._pending.get(t.point)
        fail = self._optuna.trial.TrialState.FAIL
        if waiting:
            # an infeasible point is a failed trial for TPE, never a good one
            self._study.tell(waiting.pop(0), t.cost if t.feasible else None, state=None if t.feasible else fail)
            return
        # a measurement TPE did not ask for (the configuration the run started with, one kept across a restart)
        dist = {k.name: self._optuna.distributions.CategoricalDistribution(list(range(len(k.values))))
                for k in self.space.knobs}
        self._study.add_trial(self._optuna.trial.create_trial(
            params={k.name: i for k, i in zip(self.space.knobs, t.point)}, distributions=dist,
            value=t.cost if t.feasible else None, state=self._optuna.trial.TrialState.COMPLETE if t.feasible else fail))


def _features(points: np.ndarray) -> np.ndarray:
    """Quadratic features of ordinal coordinates: 1, x_i, x_i^2, x_i x_j."""
    n, d = points.shape
    cols = [np.ones(n)] + [points[:, i] for i in range(d)] + [points[:, i] ** 2 for i in range(d)]
    cols += [points[:, i] * points[:, j] for i in range(d) for j in range(i + 1, d)]
    return np.stack(cols, axis=1)


def fit_predict(measured: np.ndarray, costs: np.ndarray, query: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Ridge regression on quadratic features, fitted on (``measured``, ``costs``), at ``query``."""
    X, Q = _features(measured.astype(float)), _features(query.astype(float))
    w = np.linalg.solve(X.T @ X + ridge * np.eye(X.shape[1]), X.T @ costs)
    return Q @ w


class RRL(Tuner):
    """Region-based reinforcement learning (see the module docstring)."""

    def __init__(self, space: Space, seed: int = 0, radius: float = 2.0, learning_rate: float = 0.3,
                 temperature: float = 0.003, adaptive_radius: bool = True, min_radius: float = 1.0,
                 max_radius: float = 4.0, drift_tolerance: float = 0.25, drift_patience: int = 2,
                 log_cost: bool = False):
        super().__init__(space, seed)
        if not radius > 0 or not 0 < learning_rate <= 1 or not temperature > 0:
            raise ValueError(f"radius and temperature must be positive and learning_rate in (0, 1], got "
                             f"{radius!r}, {temperature!r}, {learning_rate!r}")
        self.radius, self.learning_rate, self.temperature = float(radius), float(learning_rate), float(temperature)
        self.adaptive_radius, self.min_radius, self.max_radius = adaptive_radius, min_radius, max_radius
        self.drift_tolerance, self.drift_patience = drift_tolerance, drift_patience
        self.log_cost = bool(log_cost)
        self._rng = random.Random(seed)
        self._points = np.array(space.points(), dtype=float)
        self._index = {p: i for i, p in enumerate(space.points())}
        self.Q: np.ndarray | None = None
        self.measured: dict[int, float] = {}   # table index -> cost (inf: infeasible), the current workload's
        self.drifts = 0
        self.resets = 0
        self.errors: deque[float] = deque(maxlen=8)   # recent relative prediction errors

    def _forget(self) -> None:
        self._rng = random.Random(self.seed + 7919 * self.restarts)
        self.Q, self.measured, self.drifts = None, {}, 0
        self.errors.clear()

    def ask(self) -> tuple:
        if self.Q is None:
            return tuple(int(v) for v in self._points[self._rng.randrange(len(self._points))])
        candidates = [i for i in range(len(self._points)) if i not in self.measured]
        if not candidates:
            candidates = list(range(len(self._points)))
        q = np.array([self.Q[i] for i in candidates])
        finite = np.isfinite(q)
        if not finite.any():
            return tuple(int(v) for v in self._points[candidates[self._rng.randrange(len(candidates))]])
        speed = np.where(finite, 1.0 / np.maximum(q, 1e-12), 0.0)
        logits = speed / (self.temperature * speed[finite].max())
        weights = np.exp(logits - logits.max()) * finite * self._feasibility(candidates)
        pick = self._rng.choices(range(len(candidates)), weights=weights.tolist())[0]
        return tuple(int(v) for v in self._points[candidates[pick]])

    def _feasibility(self, candidates: list[int], k: int = 3) -> np.ndarray:
        """Chance that each candidate meets the constraint: the share of feasible ones among its
        ``k`` nearest measured configurations (a cliff is learned from the infeasible measurements,
        which the cost model never sees); at least 0.01, so nothing is ruled out for good."""
        if all(math.isfinite(c) for c in self.measured.values()):
            return np.ones(len(candidates))
        idx = np.array(list(self.measured))
        ok = np.array([math.isfinite(self.measured[j]) for j in idx], dtype=float)
        dist = np.linalg.norm(self._points[candidates][:, None, :] - self._points[idx][None, :, :], axis=2)
        nearest = np.argsort(dist, axis=1, kind="stable")[:, :k]
        return np.maximum(ok[nearest].mean(axis=1), 0.01)

    def _observe(self, t: Trial) -> None:
        i = self._index[t.point]
        cost = t.cost if t.feasible else math.inf
        if self.Q is None:
            self.Q = np.full(len(self._points), cost if t.feasible else 1.0)
        elif t.feasible and math.isfinite(self.Q[i]):
            self._track_drift(i, cost)
        self.measured[i] = cost
        self._update_region(i)

    def _track_drift(self, i: int, cost: float) -> None:
        """Adapt the radius to how well the table predicted this measurement, and detect a workload
        change: ``drift_patience`` errors in a row above ``drift_tolerance`` and 3x the recent median
        error (early, while the table still knows little, its errors are large and nothing is reset)."""
        predicted = self.Q[i]
        error = abs(cost - predicted) / max(abs(predicted), 1e-12)
        baseline = statistics.median(self.errors) if len(self.errors) >= 4 else math.inf
        if self.adaptive_radius and math.isfinite(baseline):
            self.radius = (min(self.max_radius, self.radius + 1) if error <= baseline
                           else max(self.min_radius, self.radius - 1))
        drifted = error > max(self.drift_tolerance, 3 * baseline)
        self.errors.append(error)
        self.drifts = self.drifts + 1 if drifted else 0
        if self.drifts >= self.drift_patience:
            recent = {self._index[t.point]: (t.cost if t.feasible else math.inf)
                      for t in self.trials[-self.drift_patience:]}
            self.measured = recent
            finite = [c for c in recent.values() if math.isfinite(c)]
            self.Q = np.full(len(self._points), float(np.mean(finite)) if finite else 1.0)
            self.errors.clear()
            self.drifts = 0
            self.resets += 1

    def _update_region(self, center: int) -> None:
        """Fit on all feasible measurements, move the region toward the estimates, pin measured ones."""
        feasible = {j: c for j, c in self.measured.items() if math.isfinite(c)}
        if len(feasible) >= 2:
            dist = np.linalg.norm(self._points - self._points[center], axis=1)
            region = np.nonzero(dist <= self.radius)[0]
            idx = np.array(list(feasible))
            costs = np.array(list(feasible.values()))
            if self.log_cost:
                logs = np.log(np.maximum(costs, 1e-12))   # extrapolation kept within e^3 of what was measured
                estimate = np.exp(np.clip(fit_predict(self._points[idx], logs, self._points[region]),
                                          logs.min() - 3, logs.max() + 3))
            else:
                estimate = np.maximum(fit_predict(self._points[idx], costs, self._points[region]), 0.0)
            self.Q[region] = (1 - self.learning_rate) * self.Q[region] + self.learning_rate * estimate
        for j, c in self.measured.items():
            self.Q[j] = c


TUNERS = {"rrl": RRL, "random": RandomSearch, "tpe": TPE, "exhaustive": Exhaustive}


def run(tuner: Tuner, measure, budget: int) -> list[dict]:
    """``budget`` rounds of ask, ``measure(config) -> (cost, feasible)``, tell; the history with
    the best feasible cost so far after each trial."""
    check_int(budget, "budget", minimum=1)
    history = []
    for n in range(budget):
        point = tuner.ask()
        cost, feasible = measure(tuner.space.config(point))
        tuner.tell(point, cost, feasible)
        best = tuner.best()
        history.append({"trial": n + 1, "point": point, "cost": float(cost), "feasible": bool(feasible),
                        "best_cost": best.cost if best else None, "best_point": best.point if best else None})
    return history


def trials_to_within(history: list[dict], optimum: float, tolerance: float = 0.05) -> int | None:
    """The first trial whose best feasible cost is within ``tolerance`` of ``optimum`` (None: never)."""
    for h in history:
        if h["best_cost"] is not None and h["best_cost"] <= optimum * (1 + tolerance):
            return h["trial"]
    return None
