"""``AdaptiveBatch``: SimiGrad's adaptive batch size, driven by the cosine measured inside qgZ.

After each optimizer step the controller reads the cosine of the two half-batch
gradients that the gradient reduction measured (``reduce_scatter_quantized``'s
``similarity``; one 12-byte all-reduce per step) and moves the batch: below the
target cosine the halves disagree (noise dominates) and the batch grows, above it
the batch shrinks. The batch is counted in micro-batches accumulated per step
(``accumulation_steps``); the learning rate follows ``sqrt(batch / batch0)``.

    ctl = qcoll.zero.AdaptiveBatch(opt, target=0.8)
    for step in range(steps):
        for i in range(ctl.accumulation_steps):
            with model.no_sync() if i < ctl.accumulation_steps - 1 else contextlib.nullcontext():
                (model(x_i, y_i) / ctl.accumulation_steps).backward()
        opt.step(); ctl.update(); opt.zero_grad()

The micro-batches but the last accumulate under ``no_sync``, so the last backward
reduces (and measures) the whole step's gradient: the two halves are halves of the
global batch, as in SimiGrad.
"""
from __future__ import annotations

import math
from collections import deque

from ..checks import check_int, check_number
from .optimizer import Optimizer
from .state import state_of


class AdaptiveBatch:
    """SimiGrad adaptive batching for a model sharded by :func:`qcoll.zero.shard`.

    ``optimizer``: its :class:`qcoll.zero.Optimizer` (the controller scales its learning
    rates). ``target``: the cosine to hold (SimiGrad's scripts use 0.75-0.8).
    ``accumulation``: micro-batches per step at the start (``batch0``); ``min_accumulation``
    / ``max_accumulation``: bounds. When the (smoothed) cosine is below ``target`` the
    batch becomes ``max(b + 1, grow * b)``, else ``max(1, min(b - 1, shrink * b))`` (in
    micro-batches, kept as a float; ``accumulation_steps`` is it rounded). ``window``:
    the mean of the last ``window`` finite measurements is compared (1: the last one).
    ``interval``: adjust every ``interval`` steps. ``lr_scaling``: ``"sqrt"`` (lr0 x
    sqrt(b / b0)), ``"linear"`` or ``None``; the controller owns the learning rate (it sets
    ``param_groups[i]["lr"]`` from the rates the groups had when it was built).
    """

    def __init__(self, optimizer: Optimizer, target: float = 0.8, accumulation: int = 1, min_accumulation: int = 1,
                 max_accumulation: int = 64, grow: float = 1.1, shrink: float = 0.9, window: int = 1,
                 interval: int = 1, lr_scaling: str | None = "sqrt"):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a qcoll.zero.Optimizer, got {type(optimizer).__name__}")
        check_number(target, "target (a cosine)", above=-1.0, below=1.0)
        check_int(accumulation, "accumulation", minimum=1)
        check_int(min_accumulation, "min_accumulation", minimum=1)
        check_int(max_accumulation, "max_accumulation", minimum=1)
        if not min_accumulation <= accumulation <= max_accumulation:
            raise ValueError(f"accumulation must lie in [min_accumulation, max_accumulation] = "
                             f"[{min_accumulation}, {max_accumulation}], got {accumulation}")
        check_number(grow, "grow", above=1)
        check_number(shrink, "shrink", above=0, below=1)
        check_int(window, "window", minimum=1)
        check_int(interval, "interval", minimum=1)
        if lr_scaling not in ("sqrt", "linear", None):
            raise ValueError(f"lr_scaling must be 'sqrt', 'linear' or None, got {lr_scaling!r}")
        self.optimizer = optimizer
        self.target, self.grow, self.shrink = float(target), float(grow), float(shrink)
        self.accumulation0 = accumulation
        self.min_accumulation, self.max_accumulation = min_accumulation, max_accumulation
        self.window, self.interval, self.lr_scaling = window, interval, lr_scaling
        self.batch = float(accumulation)            # in micro-batches
        self.history: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.last_cosine = math.nan
        self.base_lrs = [pg["lr"] for pg in optimizer.param_groups]
        state_of(optimizer.model).engine.measure_similarity = True

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches to accumulate in the next step."""
        return min(self.max_accumulation, max(self.min_accumulation, round(self.batch)))

    def lr_factor(self) -> float:
        ratio = self.accumulation_steps / self.accumulation0
        return {"sqrt": math.sqrt(ratio), "linear": ratio, None: 1.0}[self.lr_scaling]

    def update(self, cosine: float | None = None) -> int:
        """Take the step's cosine (default: what the last reduction measured), adjust the
        batch every ``interval`` steps, set the learning rates; returns the new
        ``accumulation_steps``. A non-finite cosine (a skipped step) changes nothing."""
        if cosine is None:
            cosine = state_of(self.optimizer.model).engine.last_similarity
            state_of(self.optimizer.model).engine.last_similarity = None
        self.steps += 1
        self.last_cosine = math.nan if cosine is None else float(cosine)
        finite = math.isfinite(self.last_cosine)
        if finite:
            self.history.append(self.last_cosine)
        if finite and self.steps % self.interval == 0:
            smoothed = sum(self.history) / len(self.history)
            b = self.batch
            b = max(b + 1, self.grow * b) if smoothed < self.target else max(1.0, min(b - 1, self.shrink * b))
            self.batch = min(float(self.max_accumulation), max(float(self.min_accumulation), b))
        factor = self.lr_factor()
        for pg, lr in zip(self.optimizer.param_groups, self.base_lrs):
            pg["lr"] = lr * factor
        return self.accumulation_steps

    def state_dict(self) -> dict:
        return {"batch": self.batch, "steps": self.steps, "history": list(self.history),
                "last_cosine": self.last_cosine, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.batch, self.steps = float(state["batch"]), int(state["steps"])
        self.history = deque((float(c) for c in state["history"]), maxlen=self.window)
        self.last_cosine = float(state["last_cosine"])
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
