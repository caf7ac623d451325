"""Sharded training against its single-process oracle: the same steps, the same data, compared."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .data import BatchList
from .training import train_steps


@dataclass
class Parity:
    """What :func:`check_parity` compared: the losses and the full state dicts of both runs, and the
    trained single-process ``reference`` model (for further checks of the caller's own)."""

    losses: list[float]
    reference_losses: list[float]
    state: dict
    reference_state: dict
    reference: torch.nn.Module


def _close(got: float, want: float, rtol: float, atol: float) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


def check_parity(model, optimizer, reference, reference_optimizer, batches, steps: int, *, rank: int, world: int,
                 rtol: float, atol: float, loss_rtol: float | None = None, loss_atol: float | None = None,
                 loss_fn: Callable | None = None, max_grad_norm: float | None = None, scheduler=None,
                 reference_scheduler=None) -> Parity:
    """Train a sharded model and its single-process oracle the same ``steps`` steps and compare them.

    ``model``/``optimizer`` (and ``scheduler``): this rank's side of the sharded run, e.g.
    :func:`qcoll.zero.shard` and :class:`qcoll.zero.Optimizer`; ``reference``/``reference_optimizer``
    (and ``reference_scheduler``): a plain module with the same initial values and a torch
    optimizer, trained in this process on the whole global batch. ``batches``: the data source
    (``.next()`` gives a whole global batch, e.g. a :class:`~qcoll.testing.data.Batches`); the
    ``steps`` global batches are drawn once, so both runs see the same tensors, and rank ``rank``
    of ``world`` trains on its rows of each. ``loss_fn``, ``max_grad_norm``: as in
    :func:`~qcoll.testing.training.train_steps`, for both runs.

    Checked (AssertionError naming the step or the state-dict key that differs):

    - the full state dicts have the same keys, and each value matches the reference's within
      ``rtol``/``atol`` (``torch.testing.assert_close``: ``|got - want| <= atol + rtol * |want|``);
    - if ``loss_rtol`` or ``loss_atol`` is given, each step's loss of the global batch (the mean over
      the ranks) matches the reference's within them (by the same rule; an unset one is 0).

    Every rank of the sharded run must call it (the sharded steps are collective).
    """
    drawn = [batches.next() for _ in range(steps)]
    losses = train_steps(model, optimizer, BatchList(drawn), steps, rank=rank, world=world, loss_fn=loss_fn,
                         max_grad_norm=max_grad_norm, scheduler=scheduler)
    reference_losses = train_steps(reference, reference_optimizer, BatchList(drawn), steps, loss_fn=loss_fn,
                                   max_grad_norm=max_grad_norm, scheduler=reference_scheduler)
    if loss_rtol is not None or loss_atol is not None:
        lr, la = loss_rtol or 0.0, loss_atol or 0.0
        for i, (got, want) in enumerate(zip(losses, reference_losses)):
            if not _close(got, want, lr, la):
                raise AssertionError(
                    f"step {i + 1} of {steps}: sharded loss {got!r} vs single-process {want!r} (difference "
                    f"{abs(got - want):.3g} > atol {la:g} + rtol {lr:g} x |want|); sharded losses {losses}, "
                    f"single-process {reference_losses}")
    state, reference_state = model.state_dict(), reference.state_dict()
    if set(state) != set(reference_state):
        raise AssertionError(f"state dict keys differ: only sharded {sorted(set(state) - set(reference_state))}, "
                             f"only single-process {sorted(set(reference_state) - set(state))}")
    for k, want in reference_state.items():
        torch.testing.assert_close(state[k], want, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{k} after {steps} steps, sharded vs single-process: {m}")
    return Parity(losses, reference_losses, state, reference_state, reference)
