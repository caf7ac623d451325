"""Training helpers for the tests and the benchmarks."""
from __future__ import annotations

import torch
import torch.distributed as dist


def global_loss(local_loss: torch.Tensor) -> float:
    """The mean over the default group's ranks of equal-size micro-batch losses = the global-batch
    loss (one float64 all-reduce; every rank gets the same value)."""
    t = local_loss.detach().double().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()

