"""Replay: tuners run against a recorded table of measurements, over many seeds, on identical ground."""
from __future__ import annotations

import json
import statistics

from .space import Knob, Space
from .tuners import TUNERS, run, trials_to_within


class Table:
    """Measured ``(cost, feasible)`` of every configuration of ``space`` (a recorded run, or synthetic)."""

    def __init__(self, space: Space, costs: dict):
        missing = [p for p in space.points() if p not in costs]
        if missing:
            raise ValueError(f"the table lacks {len(missing)} configurations, e.g. {missing[0]}")
        self.space, self.costs = space, {tuple(p): (float(c), bool(f)) for p, (c, f) in costs.items()}

    def measure(self, config: dict) -> tuple[float, bool]:
        point = tuple(k.values.index(config[k.name]) for k in self.space.knobs)
        return self.costs[point]

    def optimum(self) -> float:
        return min(c for c, f in self.costs.values() if f)

    def save(self, path: str) -> None:
        doc = {"knobs": [{"name": k.name, "values": list(k.values)} for k in self.space.knobs],
               "rows": [{"point": list(p), "cost": c, "feasible": f} for p, (c, f) in self.costs.items()]}
        with open(path, "w") as fh:
            json.dump(doc, fh)

    @classmethod
    def load(cls, path: str) -> "Table":
        with open(path) as fh:
            doc = json.load(fh)
        space = Space([Knob(k["name"], tuple(k["values"])) for k in doc["knobs"]])
        return cls(space, {tuple(r["point"]): (r["cost"], r["feasible"]) for r in doc["rows"]})


def replay(table: Table, tuners=("rrl", "random", "tpe"), seeds: int = 20, budget: int | None = None,
           tolerance: float = 0.05) -> dict:
    """Per tuner: trials to reach a feasible configuration within ``tolerance`` of the table's best,
    for each seed (``budget`` + 1 when never), their median, and the median over seeds of the best
    cost after each trial (``median_best``; inf before a feasible one)."""
    budget = budget or len(table.space)
    out = {}
    for name in tuners:
        counts, curves = [], []
        for seed in range(seeds):
            history = run(TUNERS[name](table.space, seed=seed), table.measure, budget)
            n = trials_to_within(history, table.optimum(), tolerance)
            counts.append(n if n is not None else budget + 1)
            curves.append([h["best_cost"] if h["best_cost"] is not None else float("inf") for h in history])
        out[name] = {"trials": counts, "median": statistics.median(counts),
                     "median_best": [statistics.median(c[i] for c in curves) for i in range(budget)]}
    return out


def replay_change(before: Table, after: Table, switch_after: int, tuners=("rrl", "random", "tpe"), seeds: int = 20,
                  budget: int | None = None, tolerance: float = 0.05) -> dict:
    """The workload changes: each tuner measures on ``before`` for ``switch_after`` trials, then on
    ``after`` (same space). Per tuner: trials after the change until its best measurement *since
    the change* is within ``tolerance`` of ``after``'s best (``budget`` + 1 when never), and the median."""
    if [(k.name, k.values) for k in before.space.knobs] != [(k.name, k.values) for k in after.space.knobs]:
        raise ValueError("the two tables must cover the same space")
    budget = budget or len(after.space)
    out = {}
    for name in tuners:
        counts = []
        for seed in range(seeds):
            tuner = TUNERS[name](before.space, seed=seed)
            run(tuner, before.measure, switch_after)
            history = run(_Since(tuner), after.measure, budget)
            n = trials_to_within(history, after.optimum(), tolerance)
            counts.append(n if n is not None else budget + 1)
        out[name] = {"trials": counts, "median": statistics.median(counts)}
    return out


class _Since:
    """A tuner whose ``best`` only counts the measurements made through this wrapper."""

    def __init__(self, tuner):
        self.tuner, self.space, self.first = tuner, tuner.space, len(tuner.trials)

    def ask(self):
        return self.tuner.ask()

    def tell(self, point, cost, feasible=True):
        self.tuner.tell(point, cost, feasible)

    def best(self):
        ok = [t for t in self.tuner.trials[self.first:] if t.feasible]
        return min(ok, key=lambda t: t.cost) if ok else None
