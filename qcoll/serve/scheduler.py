"""``SloScheduler``: RRL online over a server's batching knobs, under a latency SLO.

The objective is RRL's (Qin et al., SC'19): the lowest latency that meets the SLO, "the
``percentile``-th latency <= ``slo_s``". The cost a configuration is measured by is that same
percentile over a window of requests: minimising it meets the SLO whenever some configuration
can (the one with the lowest tail latency is within the SLO if any is), and misses it by the
least when none can, so the search never stalls on an empty feasible set at a rate no
configuration sustains. A request the server shed (503) counts as ``SHED_PENALTY`` times the SLO.

The decisions are :class:`qcoll.tune.OnlinePolicy`'s (explore ``explore`` configurations a window
each, a window ended early when its first ``abort_after`` requests already show ``abort`` times
the best; then race the best few, and restart when the windows drift), over the tuner's
``ask``/``tell``; RRL fits its region model on the logarithm of the latency (``log_cost``).
The scheduler adds what serving needs:

- a window is ``window`` requests that *arrived* under the running configuration, after its
  first ``settle`` (they queue behind the previous configuration's backlog); requests still
  queued from the previous one are not counted (their wait belongs to that one);
- a latency drift restarts the search only when ``drift_patience`` windows in a row are
  ``drift_tolerance`` off (default 3 windows twice or half as slow: a server's window p95 is
  noisier than a training step, and a load change is caught by the rate, below);
- the request rate is measured at the end of every window, over the last ``rate_horizon_s``
  seconds of arrivals; ``rate_patience`` measurements in a row more than ``rate_tolerance`` off
  the mean rate since this exploration began restart the search (the load changed: what was
  measured is stale), as a latency drift does.

Independent of the engine: the server tells it :meth:`arrived` / :meth:`completed` /
:meth:`shed`, and applies the :class:`~qcoll.serve.batcher.BatchConfig` it returns.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import time

import numpy as np

from ..checks import check_int, check_number
from ..tune import TUNERS, Knob, OnlinePolicy, Space
from .batcher import BatchConfig

SHED_PENALTY = 10.0
#: RRL's options for serving (see the module docstring)
RRL_OPTIONS = {"log_cost": True, "temperature": 0.003}


BATCH_SIZES = (1, 2, 4, 8, 16, 32)
TIMEOUTS_S = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05)


def serve_space(cores: int | None = None, batch_sizes=BATCH_SIZES, timeouts_s=TIMEOUTS_S) -> Space:
    """The knobs: ``max_batch_size`` (default 1-32), ``batch_wait_timeout_s`` (default 0-50 ms),
    ``workers`` and ``intra_op_threads`` in powers of two up to ``cores`` (default: this
    machine's); 144 configurations on 2 cores."""
    cores = check_int(cores if cores is not None else (os.cpu_count() or 1), "cores", minimum=1)
    par = tuple(2 ** i for i in range(int(math.log2(cores)) + 1))
    return Space([Knob("max_batch_size", tuple(batch_sizes)), Knob("batch_wait_timeout_s", tuple(timeouts_s)),
                  Knob("workers", par), Knob("intra_op_threads", par)])


def nearest_point(space: Space, config: BatchConfig) -> tuple:
    """The configuration of ``space`` nearest ``config`` (knob by knob, by value)."""
    return tuple(min(range(len(k.values)), key=lambda i: abs(k.values[i] - getattr(config, k.name)))
                 for k in space.knobs)


def to_config(space: Space, point) -> BatchConfig:
    return BatchConfig(**space.config(point))


class SloScheduler:
    """See the module docstring. ``tuner``: ``"rrl"``, ``"random"`` or ``"tpe"``; ``start``: the
    configuration running first (default: the one nearest the engine's defaults)."""

    def __init__(self, slo_s: float, tuner: str = "rrl", space: Space | None = None, start: BatchConfig | None = None,
                 percentile: float = 95.0, window: int = 60, settle: int = 10, explore: int = 12, reexplore: int = 8,
                 abort: float = 2.0, abort_after: int = 10, drift_tolerance: float = 1.0, drift_patience: int = 3,
                 rate_tolerance: float = 0.3, rate_patience: int = 2, rate_horizon_s: float = 3.0,
                 confirm: int = 3, seed: int = 0, tuner_options: dict | None = None,
                 clock=time.monotonic):
        for name, v in (("slo_s", slo_s), ("rate_tolerance", rate_tolerance), ("rate_horizon_s", rate_horizon_s)):
            check_number(v, name, above=0)
        check_number(percentile, "percentile", above=0, below=100)
        if tuner not in ("rrl", "random", "tpe"):
            raise ValueError(f"tuner must be 'rrl', 'random' or 'tpe', got {tuner!r}")
        check_int(rate_patience, "rate_patience", minimum=1)
        self.settle = check_int(settle, "settle", minimum=0)
        self.settling = self.settle
        self.space = space or serve_space()
        self.slo_s, self.percentile, self.clock = float(slo_s), float(percentile), clock
        options = dict(RRL_OPTIONS) if tuner == "rrl" else {}
        options.update(tuner_options or {})
        self.tuner = TUNERS[tuner](self.space, seed=seed, **options)
        start_point = nearest_point(self.space, start or BatchConfig())
        self.policy = OnlinePolicy(self.tuner, start_point, window=window, explore=explore, reexplore=reexplore,
                                   abort=abort, drift_tolerance=drift_tolerance, drift_patience=drift_patience,
                                   confirm=confirm,
                                   window_cost=self.window_cost, abort_after=min(abort_after, window))
        self.rate_tolerance, self.rate_patience, self.horizon = float(rate_tolerance), rate_patience, rate_horizon_s
        self.config = to_config(self.space, start_point)
        self.epoch = 0                 # +1 at every switch; a request counts for the epoch it arrived in
        self.left = self.policy.due()
        self.started = clock()
        self.recent_arrivals: collections.deque[float] = collections.deque()
        self.reference_since, self.reference_arrivals = self.started, 0   # arrivals since the exploration began
        self.rate_strikes = 0
        self.rate_restarts = 0
        self.switches: collections.deque[tuple[float, str]] = collections.deque(   # (clock, label), the latest
            [(self.started, self.config.label())], maxlen=10_000)

    # ------------------------------------------------------------------ costs
    def window_cost(self, latencies: list[float]) -> float:
        """The window's ``percentile``-th latency (seconds)."""
        return float(np.percentile(np.asarray(latencies, dtype=float), self.percentile))

    # ------------------------------------------------------------------ events
    def arrived(self) -> int:
        """A request arrived now: returns the epoch to pass to :meth:`completed`."""
        self.recent_arrivals.append(self.clock())
        self.reference_arrivals += 1
        return self.epoch

    def completed(self, latency_s: float, epoch: int) -> BatchConfig | None:
        """A request that arrived in ``epoch`` took ``latency_s``: the configuration to apply now, or None."""
        if epoch != self.epoch:
            return None
        if self.settling > 0:
            self.settling -= 1
            return None
        self.policy.observe(latency_s)
        self.left -= 1
        if self.left > 0:
            return None
        point = self.policy.decide()
        if not self.policy.times:   # a window ended (in full, or early)
            point = self._check_rate(point)
        self.left = self.policy.due()
        if point is None:
            return None
        return self._apply(point)

    def shed(self, epoch: int) -> BatchConfig | None:
        """A request that arrived in ``epoch`` was refused (queue full)."""
        return self.completed(SHED_PENALTY * self.slo_s, epoch)

    # ------------------------------------------------------------------ internals
    def rate(self) -> float | None:
        """Requests per second over the last ``rate_horizon_s`` (None until that long has passed)."""
        now = self.clock()
        while self.recent_arrivals and self.recent_arrivals[0] < now - self.horizon:
            self.recent_arrivals.popleft()
        return len(self.recent_arrivals) / self.horizon if now - self.started >= self.horizon else None

    def reference_rate(self) -> float | None:
        """The mean rate since this exploration began (None until ``rate_horizon_s`` has passed)."""
        elapsed = self.clock() - self.reference_since
        return self.reference_arrivals / elapsed if elapsed >= self.horizon else None

    def _check_rate(self, point):
        rate = self.rate()
        if not rate:
            return point
        reference = self.reference_rate()
        if reference is None:
            return point
        off = abs(rate / reference - 1) > self.rate_tolerance
        self.rate_strikes = self.rate_strikes + 1 if off else 0
        if self.rate_strikes < self.rate_patience:
            return point
        # the load changed: measure the running configuration first, then explore again
        self.rate_strikes, self.reference_since, self.reference_arrivals = 0, self.clock(), 0
        self.rate_restarts += 1
        self.policy.restart(None)
        return point

    def _apply(self, point) -> BatchConfig:
        self.config = to_config(self.space, point)
        self.epoch += 1
        self.settling = self.settle
        self.switches.append((self.clock(), self.config.label()))
        return self.config

    def state(self) -> dict:
        """For a metrics endpoint: the running configuration (``config``, its label; ``config_body``, its
        fields, JSON: ``PUT /admin/config``'s body, or ``BatchConfig(**config_body)``), the phase and the
        search's counters."""
        return {"config": self.config.label(), "config_body": dataclasses.asdict(self.config),
                "phase": self.policy.phase.value,
                "explorations": self.policy.explorations, "rate_restarts": self.rate_restarts,
                "switches": len(self.switches) - 1, "measured": len(self.tuner.trials),
                "reference_rate": self.reference_rate()}
