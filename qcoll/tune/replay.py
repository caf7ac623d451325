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
    for each seed (``budget`` + 1 when never), and their median."""
    budget = budget or len(table.space)
    out = {}
    for name in tuners:
        counts = []
        for seed in range(seeds):
            history = run(TUNERS[name](table.space, seed=seed), table.measure, budget)
            n = trials_to_within(history, table.optimum(), tolerance)
            counts.append(n if n is not None else budget + 1)
        out[name] = {"trials": counts, "median": statistics.median(counts)}
    return out
