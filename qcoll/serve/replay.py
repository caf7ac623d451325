"""Replay: :class:`~qcoll.serve.SloScheduler` driven by a table of latencies instead of a server.

A table maps each configuration (a point of the space) to its p95 latency at one request
rate, e.g. ``qcoll-bench serve``'s offline measurements. Requests arrive as a Poisson process
(a clock of the replay's own), each segment at its rate for its number of requests; a request
served by configuration ``c`` takes ``p95(c) * E / ln 20`` with ``E`` exponential (so ``c``'s
95th percentile is its table value), and completes before the next arrives. The result is the
configuration in force at each request: how many requests the scheduler needs, after each
rate change, to run a configuration within a tolerance of the table's best, over many seeds.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from .scheduler import SloScheduler


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay_requests(tables: list[dict], segments: list[tuple[float, int]], tuner: str = "rrl", seed: int = 0,
                    slo_s: float = 0.1, space=None, **kwargs) -> list[tuple]:
    """The configuration in force at each request. ``segments``: ``(rate, requests)`` in order,
    ``tables[k]``: ``{point: p95 seconds}`` for segment ``k``; ``kwargs`` go to the scheduler."""
    clock = _Clock()
    sched = SloScheduler(slo_s, tuner, space=space, seed=seed, clock=clock, **kwargs)
    rng = np.random.default_rng(seed + 10_007)
    in_force = []
    for (rate, n), table in zip(segments, tables):
        for _ in range(n):
            clock.now += rng.exponential(1.0 / rate)
            point = sched.policy.current
            in_force.append(point)
            epoch = sched.arrived()
            sched.completed(float(table[point] * rng.exponential() / math.log(20)), epoch)
    return in_force


def settled(near, share: float = 0.9) -> int | None:
    """The first index from which at least ``share`` of the rest of ``near`` (booleans) is true and
    the last one is (None: no such index): the tuner has settled near the best, its racing and
    re-checks allowed to take the rest."""
    near = np.asarray(near, dtype=float)
    if not near.size or not near[-1]:
        return None
    rest = np.cumsum(near[::-1])[::-1] / np.arange(near.size, 0, -1)
    ok = np.nonzero(rest >= share)[0]
    return int(ok[0]) if ok.size else None


def requests_to_near(in_force: list[tuple], tables: list[dict], segments: list[tuple[float, int]],
                     within: float = 0.10) -> list[int | None]:
    """Per segment: requests from its start until the configuration in force is within ``within``
    of the table's best for good (:func:`settled`; None: not by the segment's end)."""
    out, start = [], 0
    for (rate, n), table in zip(segments, tables):
        best = min(table.values())
        out.append(settled([table[p] <= best * (1 + within) for p in in_force[start:start + n]]))
        start += n
    return out


def replay_many(tables: list[dict], segments: list[tuple[float, int]], tuners=("rrl", "random", "tpe"),
                seeds: int = 20, within: float = 0.10, **kwargs) -> dict:
    """Per tuner and segment: requests to near (``requests_to_near``; a segment never reached
    counts its length) for each seed, and their median."""
    out = {}
    for name in tuners:
        runs = [requests_to_near(replay_requests(tables, segments, name, seed, **kwargs), tables, segments, within)
                for seed in range(seeds)]
        per_segment = [[r[k] if r[k] is not None else n for r in runs] for k, (_, n) in enumerate(segments)]
        out[name] = {"requests": per_segment, "median": [statistics.median(v) for v in per_segment],
                     "never": [sum(r[k] is None for r in runs) for k in range(len(segments))]}
    return out
