"""``qcoll-bench train``: the char transformer trained with ZeRO-3, ZeRO++ and (``--peer``) FSDP2.

Every mode trains the same model (same initial values), on the same batches of
the Python standard library's sources, with the same AdamW, for ``--steps``
steps. Printed per mode: median step time (after ``--warmup`` steps), tokens/s,
first and final loss, bytes per step handed to intra- and inter-node groups
(qcoll's byte counters; FSDP2's are its all-gathers and reduce-scatter over the
world, counted by the same rule at 4 bytes per element, 2 for ``fsdp2-bf16``),
collectives per step, and ratios against ZeRO-3 and against the fastest peer. Inside
``qcoll-bench cluster`` also the bytes per timed step that really crossed the
node links (veth counters, :mod:`qcoll.bench.linkmeter`; frames with headers).

Peers (``--peer``): ``fsdp2`` is ``fully_shard`` on each block and the root in fp32;
``fsdp2-bf16`` adds ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``
(bf16 all-gathers, forward, backward and reduce-scatter; fp32 sharded parameters and
AdamW), as users run it; ``hsdp`` / ``hsdp-bf16`` are the same on FSDP2's 2-D mesh
(replicate across nodes, shard inside). qcoll inside FSDP2 (``--modes fsdp2-qcoll
fsdp2-qcoll-bf16 hsdp-qcoll``): :mod:`qcoll.bench.fsdp_runs`. Memory per rank
(``state_KiB``, ``peak_KiB``): :func:`qcoll.bench.train_report.memory_kib` (the table, the
profile and the plot are :mod:`qcoll.bench.train_report`'s). qcoll's ``zero3-bf16`` /
``zeropp-bf16`` are ``zero3`` / ``zeropp`` with ``compute_dtype=torch.bfloat16``: ZeRO-3
then gathers 2-byte elements (its gradient reduce-scatter stays fp32), ZeRO++ quantizes
and gathers bf16 (the same wire bytes as in fp32). The *best peer* is the fastest run of
an FSDP2 peer or of qcoll's unquantized ``zero3`` / ``zero3-bf16``: the configurations
ZeRO++ is measured against.

``--prefetch N`` overrides the qcoll modes' ``ZeroConfig.prefetch``; ``--units linears`` makes every
Linear layer its own unit (smaller units: earlier first gradient reductions, more collectives).
Under the table, *where the time goes*: per mode the forward, backward and optimizer milliseconds
and the milliseconds qcoll's collectives waited for their transport (``where_time_goes`` in the JSON).

Collectives per step (``coll/step``): every collective this rank issues from the
forward to ``zero_grad`` of the last timed step, counted at torch.distributed's
``ProcessGroup`` methods (:mod:`qcoll.bench.collcount`), the same rule for qcoll and
FSDP2; the benchmark's own barrier before the step and the all-reduce of the logged
loss after it are not counted. The JSON also splits them by operation and counts
those on groups that span nodes.

JSON (``--json FILE``): ``{"command": "train", "world", "ranks_per_node", "args",
"runs": [{"mode", "step_time_s", "tokens_per_s", "losses": [...], "first_loss",
"final_loss", "intra_bytes_per_step", "inter_bytes_per_step", "link_bytes_per_step"
(null outside a cluster), "collectives_per_step", "inter_collectives_per_step",
"collectives_by_op": {op: calls}, "speedup_vs_zero3", "inter_ratio_vs_zero3", "link_ratio_vs_zero3",
"best_peer", "speedup_vs_best_peer", "memory": {...}, "samples_to_target", "time_to_target_s",
"steps_to_target"}]}``. ``--plot FILE.png``:
loss curves (with ``--adaptive-batch`` also the batch and the cosine per step).
Progress (stderr, rank 0; :mod:`qcoll.bench.progress`): each mode a run of ``--steps`` steps.

``--adaptive-batch TARGET`` trains each mode with SimiGrad's adaptive batch
(:mod:`qcoll.bench.adaptive`): ``--batch`` is then the global micro-batch, the
step's batch is a number of them chosen by the cosine the gradient reduction
measures; per step it prints the loss, cosine, batch and learning rate, and each run
gets ``cosines``, ``batches``, ``lrs``, ``step_seconds`` in the JSON. ``--target-loss``
(any run) reports the samples and wall time until the mean of the last
``--loss-window`` step losses reaches it.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from . import adaptive, cli, fsdp_runs, progress, train_auto
from .collcount import CollectiveCounter
from .link_schedule import ProgressWriter
from .linkmeter import LinkMeter
from .ranks import run_ranks
from .train_modes import MODES, PEERS, best_peer, is_peer, mode_config  # noqa: F401  (re-exported)
from .train_report import format_adaptive, format_profile, format_table, memory_kib, plot_losses  # noqa: F401

NAME = "train"


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The char transformer's size, the global batch and AdamW's learning rate (train and tune)."""
    p.add_argument("--batch", type=cli.positive_int, default=16, help="global batch, sequences (default 16)")
    p.add_argument("--context", type=cli.positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--d-model", type=cli.positive_int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=cli.positive_int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=cli.positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    if args.batch % world:
        parser.error(f"--batch {args.batch} is not divisible by the world size {world}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="train the char transformer with ZeRO-3, ZeRO++ and FSDP2 side by side",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["zero3", "zeropp"], choices=list(MODES) + list(fsdp_runs.QCOLL_MODES),
                   metavar="MODE", help=f"qcoll configurations to run, of {' '.join(MODES)}; and qcoll's comms "
                                        f"inside FSDP2 (quantize_comm's defaults: 8-bit weights, 4-bit gradients, "
                                        f"hpZ): fsdp2-qcoll (fp32, 1-D mesh, blocks reshard_after_forward=ranks per "
                                        f"node), fsdp2-qcoll-bf16 (the same with the bf16 MixedPrecisionPolicy), "
                                        f"hsdp-qcoll (hsdp-bf16 with its cross-node gradient all-reduce at 4 bits) "
                                        f"(default zero3 zeropp)")
    p.add_argument("--peer", nargs="*", default=[], choices=PEERS, metavar="PEER",
                   help="also run PyTorch FSDP2 (fully_shard): fsdp2 (fp32), fsdp2-bf16 (MixedPrecisionPolicy "
                        "param_dtype=reduce_dtype=bf16), hsdp, hsdp-bf16 (the same on a 2-D mesh: replicate "
                        "across nodes, shard inside)")
    p.add_argument("--steps", type=cli.positive_int, default=20, help="training steps per mode (default 20)")
    add_model_options(p)
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--prefetch", type=cli.nonnegative_int, default=None,
                   help="qcoll modes: units gathered ahead (ZeroConfig.prefetch; default: its default, 1)")
    p.add_argument("--units", choices=("blocks", "linears"), default="blocks",
                   help="qcoll modes: the units gathered together: the embedding, each block and the final norm "
                        "(blocks, the default), or the embedding, each Linear layer and the final norm (linears: "
                        "smaller units, so the first gradients are reduced earlier in the backward)")
    g = p.add_argument_group("adaptive batch (SimiGrad) and time to a target loss")
    g.add_argument("--adaptive-batch", type=float, default=None, metavar="TARGET",
                   help="adapt the batch to hold this half-batch gradient cosine (e.g. 0.8)")
    g.add_argument("--max-accumulation", type=cli.positive_int, default=16,
                   help="most micro-batches of --batch per adaptive step (default 16)")
    g.add_argument("--accumulate", action="store_true",
                   help="adaptive: run a step's micro-batches one by one under no_sync (default: as one batch)")
    g.add_argument("--keep-gathered", action="store_true",
                   help="adaptive with --accumulate: keep the gathered weights across a step's micro-batches "
                        "(ZeroConfig(reshard_after_backward=False)): each weight crosses the link once per step")
    g.add_argument("--similarity-window", type=cli.positive_int, default=5,
                   help="adaptive: mean of the last N cosines is compared with the target (default 5)")
    g.add_argument("--target-loss", type=float, default=None,
                   help="report samples and wall time until the running training loss reaches this")
    g.add_argument("--loss-window", type=cli.positive_int, default=10,
                   help="steps in the running mean of --target-loss (default 10)")
    g.add_argument("--stop-at-target", action="store_true",
                   help="end each run once its running loss reaches --target-loss (--steps is then a cap)")
    train_auto.add_options(p)
    cli.add_common_options(p, iters=1, warmup=2)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    world = cli.check_common(parser, args)
    check_model_options(parser, args, world)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    if args.adaptive_batch is not None and not 0 < args.adaptive_batch < 1:
        parser.error(f"--adaptive-batch must be a cosine in (0, 1), got {args.adaptive_batch}")
    if args.adaptive_batch is not None and (args.peer or set(args.modes) & set(fsdp_runs.RUNS)):
        parser.error("--adaptive-batch runs qcoll.zero's modes only (no --peer, no FSDP2 modes)")
    if args.keep_gathered and not args.accumulate:
        parser.error("--keep-gathered needs --accumulate (it keeps the weights across the micro-batches of a step)")
    train_auto.check(parser, args)
    if args.stop_at_target and args.target_loss is None:
        parser.error("--stop-at-target needs --target-loss")
    if args.target_loss is not None and args.loss_window > args.steps:
        parser.error(f"--loss-window {args.loss_window} must not exceed --steps {args.steps}")
    with progress.starting(NAME, world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


def reporter(args) -> progress.Steps | None:
    """The command's progress (:class:`qcoll.bench.progress.Steps`, set by ``_rank_main``), or None."""
    return getattr(args, "reporter", None)


def build_model(args):
    """The char transformer of the model options, seeded by ``--seed``."""
    from ..testing import TransformerConfig, char_transformer

    return char_transformer(TransformerConfig(context=args.context, d_model=args.d_model, n_layers=args.layers,
                                              n_heads=args.heads), args.seed)


def _steps(args, model, optimizer, rank, world, loss_fn=None):
    """``--steps`` timed steps of :func:`qcoll.testing.train_steps`: (losses, the slowest rank's median
    step seconds after ``--warmup``, the last step's (intra, inter) bytes, link bytes per timed step, times,
    the last step's collectives (total, inter-node, by op), where the time goes (:func:`_where_time_goes`))."""
    from ..comm import stats
    from ..testing import Batches, stdlib_bytes, train_steps

    batches = Batches(stdlib_bytes(), args.batch, args.context, args.seed + 1)
    meter = LinkMeter.from_env() if rank == 0 else None
    progress = args.link_progress   # a link rate that changes at a step (qcoll-bench cluster --link R@0,R@S)
    progress.begin_run()
    times, traffic = [], []
    link_start = None
    counter = CollectiveCounter()
    step_start, collectives = [], []
    phases, blocked = [], []

    def before_step(i):
        nonlocal link_start
        if meter is not None and i == args.warmup:
            link_start = meter.read()   # every rank is past step i-1's loss all-reduce or waits in the barrier
        progress.step(i)
        dist.barrier()
        stats.reset()
        step_start.append(counter.snapshot())

    def after_step(i, losses):
        if reporter(args) is not None:
            reporter(args).update(i + 1)
        traffic.append((stats.stats.intra_bytes, stats.stats.inter_bytes))
        blocked.append(dict(stats.stats.blocked_seconds))
        # every rank holds the same losses: the same decision
        return args.stop_at_target and i > args.warmup and adaptive.reached(losses, args.target_loss, args.loss_window)

    # a step's collectives: from its clock's start (after the barrier) to the end of zero_grad, where its
    # clock stops; the all-reduce of the logged loss after it is the benchmark's, not the mode's
    zero_grad = optimizer.zero_grad

    def counted_zero_grad(*a, **kw):
        out = zero_grad(*a, **kw)
        collectives.append(counter.delta(counter.snapshot(), step_start[-1]))
        return out

    optimizer.zero_grad = counted_zero_grad
    try:
        with counter:
            losses = train_steps(model, optimizer, batches, args.steps, rank=rank, world=world, loss_fn=loss_fn,
                                 before_step=before_step, after_step=after_step, step_seconds=times,
                                 phase_seconds=phases)
    finally:
        del optimizer.zero_grad
    dist.barrier()
    timed = len(losses) - args.warmup
    link = (meter.read() - link_start) / timed if meter is not None and link_start is not None else None
    slowest = torch.tensor([statistics.median(times[args.warmup:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    profile = _where_time_goes(phases[args.warmup:], blocked[args.warmup:])
    return losses, float(slowest), traffic[-1], link, times, collectives[-1], profile


def _where_time_goes(phases: list[dict], blocked: list[dict]) -> dict:
    """The mean over ranks of each rank's median seconds per timed step: ``forward``, ``backward``
    (to the end of the gradient reductions), ``optimizer`` (step and zero_grad), and
    ``blocked``: per qcoll operation, the seconds the rank's thread waited for the transport
    (``qcoll.comm.stats``' ``blocked_seconds``: communication not hidden behind compute; FSDP2's
    waits are not seen)."""
    ops = sorted({op for b in blocked for op in b})
    keys = ["forward", "backward", "optimizer"]
    mine = [statistics.median(p[k] for p in phases) for k in keys]
    mine += [statistics.median(b.get(op, 0.0) for b in blocked) for op in ops]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    mean = [statistics.fmean(col) for col in zip(*every)]
    out = {f"{k}_s": v for k, v in zip(keys, mean)}
    out["blocked_s"] = dict(zip(ops, mean[len(keys):]))
    return out


def model_units(args, model) -> list:
    """The units of ``--units``: the model's own (:meth:`CharTransformer.units`) or every Linear layer
    with the embedding and the final norm (the LayerNorms of the blocks and the positions go to the root)."""
    if args.units == "blocks":
        return model.units()
    linears = [m for block in model.blocks for m in block.modules() if isinstance(m, torch.nn.Linear)]
    return [model.embed, *linears, model.ln_f]


def _run_qcoll(args, mode, topo, attach=None):
    """Train qcoll mode ``mode``; ``attach(model, optimizer)`` (optional) runs once the model is sharded and
    its optimizer built, after the memory hook is registered, and may return a callable run before each
    forward (``train --auto`` attaches its AutoTune)."""
    from .. import zero

    model = build_model(args)
    m = zero.shard(model, topo, zero.ZeroConfig(**mode_config(args, mode)), units=model_units(args, model))
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=args.lr, weight_decay=0.0)
    memory = {}
    # after each step, before zero_grad (the gradients count)
    opt.register_step_post_hook(lambda *_: memory.update(zero.memory_report(m, opt)))
    before_forward = attach(m, opt) if attach is not None else None

    def forward(m, x, y):
        if before_forward is not None:
            before_forward()
        loss = m(x, y)
        memory.update(secondary_peak=zero.memory_report(m)["secondary"])
        return loss

    losses, seconds, (intra, inter), link, times, colls, profile = _steps(args, m, opt, topo.rank, topo.world_size,
                                                                          forward)
    return losses, seconds, intra, inter, link, memory, times, colls, profile


def _rank_main(args) -> None:
    from ..comm import Topology

    topo = Topology(args.ranks_per_node)
    args.link_progress = ProgressWriter(topo.rank)
    modes = list(args.modes) + list(args.peer) + train_auto.modes(args)
    with progress.Steps(NAME, enabled=topo.rank == 0) as prog:
        args.reporter = prog
        try:
            runs = _run_modes(args, modes, topo, prog)
        finally:
            del args.reporter
    _report(args, runs, topo)


def _run_modes(args, modes: list[str], topo, prog: progress.Steps) -> list[dict]:
    """Every mode in turn (its progress reported as a run of ``--steps`` steps); the runs' records."""
    tokens = args.batch * args.context
    runs = []
    for k, mode in enumerate(modes, 1):
        prog.begin(f"{mode} ({k}/{len(modes)})" if len(modes) > 1 else mode, args.steps)
        if args.adaptive_batch is not None:
            runs.append(_adaptive_run(args, mode, topo))
            prog.end()
            continue
        record = None
        if mode in fsdp_runs.RUNS:
            run = fsdp_runs.run(args, mode, topo, build_model, _steps)
        elif train_auto.is_auto(mode):
            run, record = train_auto.run(args, mode, topo, _run_qcoll,
                                         lambda a, m, t, attach: fsdp_runs.run(a, m, t, build_model, _steps, attach))
        else:
            run = _run_qcoll(args, mode, topo)
        prog.end()
        losses, seconds, intra, inter, link, memory, times, colls, profile = run
        samples, wall, steps = adaptive.to_target(losses, [args.batch] * len(losses), times, args.target_loss,
                                                  args.loss_window)
        runs.append({"mode": mode, "step_time_s": seconds, "tokens_per_s": tokens / seconds, "losses": losses,
                     "first_loss": losses[0], "final_loss": losses[-1], "intra_bytes_per_step": intra,
                     "inter_bytes_per_step": inter, "link_bytes_per_step": link, "memory": memory,
                     "samples_to_target": samples, "time_to_target_s": wall, "steps_to_target": steps,
                     "collectives_per_step": colls[0], "inter_collectives_per_step": colls[1],
                     "collectives_by_op": colls[2], "where_time_goes": profile, "step_seconds": times})
        if record is not None:
            runs[-1]["auto"] = record
    return runs


def _report(args, runs: list[dict], topo) -> None:
    """The comparisons between the runs (every rank), then rank 0's tables, JSON and plot."""
    if args.auto or args.auto_fsdp2:
        train_auto.summarize(runs, args.settle)
    base = next((r for r in runs if r["mode"] == "zero3"), None)
    best = best_peer(runs)
    for r in runs:
        r["best_peer"] = best["mode"] if best else None
        r["speedup_vs_best_peer"] = best["step_time_s"] / r["step_time_s"] if best else None
        r["speedup_vs_zero3"] = base["step_time_s"] / r["step_time_s"] if base else None
        r["inter_ratio_vs_zero3"] = (r["inter_bytes_per_step"] / base["inter_bytes_per_step"]
                                     if base and base["inter_bytes_per_step"] else None)
        r["link_ratio_vs_zero3"] = (r["link_bytes_per_step"] / base["link_bytes_per_step"]
                                    if base and base["link_bytes_per_step"] else None)
    if topo.rank != 0:
        return
    for r in runs:
        if "cosines" in r:
            print(format_adaptive(r), flush=True)
    print(format_table(runs), flush=True)
    print(format_profile(runs), flush=True)
    if args.auto or args.auto_fsdp2:
        print(train_auto.format_auto(runs, args.settle), flush=True)
        emitted = train_auto.emit_config(args, runs)
        if emitted:
            print(emitted, flush=True)
    if args.json:
        cli.write_json(args.json, {"command": NAME, "world": topo.world_size, "ranks_per_node": topo.ranks_per_node,
                                   "args": {k: getattr(args, k) for k in ("modes", "peer", "steps", "batch",
                                                                           "context", "d_model", "layers", "heads",
                                                                           "lr", "seed", "prefetch", "units",
                                                                           "warmup", "adaptive_batch",
                                                                           "max_accumulation", "accumulate", "keep_gathered",
                                                                           "similarity_window",
                                                                           "target_loss", "loss_window", "stop_at_target", "auto", "auto_fsdp2",
                                                                           "auto_window", "auto_explore",
                                                                           "auto_reexplore", "settle")},
                                   "runs": runs})
    if args.plot:
        plot_losses(runs, args.plot)


def _adaptive_run(args, mode, topo) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = build_model(args)
    config = {**mode_config(args, mode), "reshard_after_backward": not args.keep_gathered}
    # adaptive.run's loop has no hook: its steps are counted at the optimizer's step (one per adaptive step)
    counted = register_optimizer_step_post_hook(
        lambda *_: reporter(args).step() if reporter(args) is not None else None)
    try:
        rec = adaptive.run(args, config, topo, model, model_units(args, model))
    finally:
        counted.remove()
    seconds = statistics.median(rec["seconds"][args.warmup:] or rec["seconds"])
    samples, wall, steps = adaptive.to_target(rec["losses"], rec["batches"], rec["seconds"], args.target_loss,
                                              args.loss_window)
    tokens = statistics.mean(rec["batches"][args.warmup:] or rec["batches"]) * args.context
    return {"mode": f"{mode}+adaptive", "step_time_s": seconds, "tokens_per_s": tokens / seconds,
            "losses": rec["losses"], "first_loss": rec["losses"][0], "final_loss": rec["losses"][-1],
            "intra_bytes_per_step": None, "inter_bytes_per_step": rec["inter_bytes"][-1], "link_bytes_per_step": None,
            "memory": {"gathered_peak_kib": rec["gathered_peak"] / 1024}, "samples_to_target": samples, "time_to_target_s": wall, "steps_to_target": steps,
            "collectives_per_step": None, "inter_collectives_per_step": None, "collectives_by_op": None,
            "cosines": rec["cosines"], "batches": rec["batches"], "lrs": rec["lrs"], "step_seconds": rec["seconds"]}
