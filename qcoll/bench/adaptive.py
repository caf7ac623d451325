"""``qcoll-bench train --adaptive-batch TARGET``: one mode trained with SimiGrad's adaptive batch.

A step's batch is ``accumulation_steps`` micro-batches of ``--batch`` sequences (the
global micro-batch), run as one forward and backward of that many sequences (one
weight gather and one gradient reduction per step, which is what a larger batch
amortizes on a slow link; ``--accumulate`` runs them one by one under ``no_sync``
instead, as SimiGrad does where memory is short; ``--keep-gathered`` then keeps the gathered
weights across them, ``ZeroConfig(reshard_after_backward=False)``). The reduction measures the
half-batch cosine; the controller (:class:`qcoll.zero.AdaptiveBatch`) then sets the
next step's batch and the learning rate (``--lr`` x sqrt(batch / batch0)). Also :func:`to_target`: samples and
wall time until the running mean of the training loss reaches ``--target-loss``,
for adaptive and static runs alike.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


def reached(losses: list[float], target: float, window: int) -> bool:
    """Whether the mean of the last ``window`` losses is at most ``target``."""
    return len(losses) >= window and sum(losses[-window:]) / window <= target


def to_target(losses: list[float], samples: list[int], seconds: list[float], target: float | None,
              window: int) -> tuple[int | None, float | None, int | None]:
    """``(samples, wall seconds, steps)`` until the mean of the last ``window`` step losses
    first reaches ``target`` (None when it never does or no target is set)."""
    if target is None:
        return None, None, None
    for i in range(window - 1, len(losses)):
        if sum(losses[i - window + 1: i + 1]) / window <= target:
            return sum(samples[: i + 1]), sum(seconds[: i + 1]), i + 1
    return None, None, None


def run(args, mode_config: dict, topo, model, units: list) -> dict:
    """Train ``model`` (fresh, sharded with ``units``) for ``--steps`` adaptive steps; the per-step
    record on every rank."""
    from .. import zero
    from ..comm import stats
    from ..testing import Batches, stdlib_bytes

    rank, world = topo.rank, topo.world_size
    m = zero.shard(model, topo, zero.ZeroConfig(**mode_config), units=units)
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=args.lr, weight_decay=0.0)
    ctl = zero.AdaptiveBatch(opt, target=args.adaptive_batch, max_accumulation=args.max_accumulation,
                             window=args.similarity_window)
    batches = Batches(stdlib_bytes(), args.batch, args.context, args.seed + 1)
    record = {"losses": [], "cosines": [], "batches": [], "lrs": [], "seconds": [], "inter_bytes": []}
    for _ in range(args.steps):
        k = ctl.accumulation_steps
        lr = opt.param_groups[0]["lr"]
        dist.barrier()
        stats.reset()
        t0 = time.perf_counter()
        total = torch.zeros(1, dtype=torch.float64)
        micro = [batches.next(rank, world) for _ in range(k)]
        if not args.accumulate:
            micro = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
        for i, (x, y) in enumerate(micro):
            with m.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss = m(x, y) / len(micro)
                loss.backward()
            total += loss.detach().double()
        opt.step()
        ctl.update()
        opt.zero_grad()
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        record["losses"].append(float(total) / world)
        record["cosines"].append(ctl.last_cosine)
        record["batches"].append(k * args.batch)
        record["lrs"].append(lr)
        record["seconds"].append(float(seconds))
        record["inter_bytes"].append(stats.stats.inter_bytes)
        if args.stop_at_target and reached(record["losses"], args.target_loss, args.loss_window):
            break  # every rank holds the same losses: the same decision
    record["gathered_peak"] = zero.memory_report(m)["gathered_peak"]
    return record
