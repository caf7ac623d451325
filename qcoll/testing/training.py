"""One training loop for the tests and the benchmarks: sharded or single-process alike."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def global_loss(local_loss: torch.Tensor) -> float:
    """The mean over the default group's ranks of equal-size micro-batch losses = the global-batch
    loss (one float64 all-reduce; every rank gets the same value)."""
    t = local_loss.detach().double().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def train_steps(model, optimizer, batches, steps: int, *, rank: int = 0, world: int = 1,
                loss_fn: Callable | None = None, max_grad_norm: float | None = None, scheduler=None,
                before_step: Callable[[int], None] | None = None,
                after_step: Callable[[int, list], bool | None] | None = None,
                step_seconds: list | None = None, phase_seconds: list | None = None) -> list[float]:
    """Train ``steps`` steps; returns the loss of each step's global batch.

    A step: ``batch = batches.next(rank, world)`` (a :class:`~qcoll.testing.data.Batches`, a
    :class:`~qcoll.testing.data.BatchList` or anything with that method), ``loss =
    loss_fn(model, *batch)`` (default ``model(*batch)``), ``loss.backward()``, the gradient
    clipped to ``max_grad_norm`` if given (with ``optimizer.clip_grad_norm_`` where the optimizer
    has it, :class:`qcoll.zero.Optimizer`'s over all shards, else
    ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``), ``optimizer.step()``,
    ``scheduler.step()`` if given, ``optimizer.zero_grad()``.

    The same loop trains a model sharded by :func:`qcoll.zero.shard` with its
    :class:`qcoll.zero.Optimizer` on each rank (``rank``/``world``: this rank's rows of each
    global batch) and a plain model with a torch optimizer in one process (``world=1``, the
    default: the whole batch). With ``world > 1`` each loss is :func:`global_loss` (the mean over
    the ranks of the default group, one all-reduce per step), else ``float(loss)``.

    Hooks for benchmarks: ``before_step(i)`` runs after the batch is drawn and before the step's
    clock starts (a barrier, counters reset); ``step_seconds``, when a list, gets each step's
    seconds from the forward to ``zero_grad`` included; ``after_step(i, losses)`` runs after the
    step's loss is appended, and a true return ends the training early. ``phase_seconds``, when
    a list, gets per step a dict of the seconds of ``forward``, ``backward`` (with clipping) and
    ``optimizer`` (``step``, the scheduler and ``zero_grad``), which add up to the step's seconds.
    """
    losses: list[float] = []
    for i in range(steps):
        batch = batches.next(rank, world)
        if before_step is not None:
            before_step(i)
        t0 = time.perf_counter()
        loss = model(*batch) if loss_fn is None else loss_fn(model, *batch)
        t1 = time.perf_counter()
        loss.backward()
        if max_grad_norm is not None:
            if hasattr(optimizer, "clip_grad_norm_"):
                optimizer.clip_grad_norm_(max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        t2 = time.perf_counter()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if step_seconds is not None:
            step_seconds.append(t3 - t0)
        if phase_seconds is not None:
            phase_seconds.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
        losses.append(global_loss(loss) if world > 1 else float(loss.detach()))
        if after_step is not None and after_step(i, losses):
            break
    return losses
