"""``qcoll-bench tune``: configuration search over the ZeRO++ knobs (:mod:`qcoll.tune`).

Three ways to run:
- live (default): ``--tuner`` (rrl, random, tpe, exhaustive) picks ``--budget`` configurations; each
  is measured on the ranks (``--steps`` steps of the char transformer, the median step time after
  ``--warmup``); the best feasible one is printed in the forms that are usable as printed
  (:func:`qcoll.tune.config_lines`): a ``ZeroConfig(...)`` line, the DeepSpeed config as JSON alone on
  its line (``zero_optimization`` with the run's ranks per node as ``zero_hpz_partition_size``, and a
  ``"qcoll"`` section of what DeepSpeed has no key for: ``ZeroConfig.from_deepspeed(doc, ranks_per_node)``
  gives the configuration back exactly) and the ``quantize_comm(...)`` call of the FSDP2 path;
  ``--emit-config FILE`` writes that JSON (atomically; its folder checked before the first measurement;
  no file when no configuration is feasible);
- ``--record FILE``: every configuration of the space is measured once into a table (JSON; its folder
  is checked before the first measurement, the file replaced atomically, a symlink there replaced,
  never followed; the same for ``--json`` and ``--plot``);
- ``--replay FILE``: every tuner in ``--tuners`` runs against a recorded table for ``--seeds``
  seeds (no ranks, seconds): the median number of trials to reach a configuration within 5%
  of the table's best.
A configuration is feasible when its mean loss over the last 3 steps is at most
``1 + --max-loss-increase`` times the unquantized configuration's (ZeRO-3, measured first).
Works inside ``qcoll-bench cluster`` (live and ``--record``). Progress (stderr, rank 0;
:mod:`qcoll.bench.progress`): each measurement a run of ``--steps`` steps; a replay a run of its own.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from . import cli, plot, progress, train
from .ranks import run_ranks

NAME = "tune"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="search the ZeRO++ knobs (RRL, random, TPE) live or on a recorded table",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--tuner", default="rrl", choices=["rrl", "random", "tpe", "exhaustive"],
                   help="live: the tuner (default rrl)")
    p.add_argument("--budget", type=cli.positive_int, default=12, help="live: configurations to measure (default 12)")
    p.add_argument("--record", default=None, metavar="FILE", help="measure every configuration into this table")
    p.add_argument("--replay", nargs="+", default=None, metavar="FILE",
                   help="run the tuners on this recorded table; with a second table the workload changes to it "
                        "after --switch-after trials")
    p.add_argument("--switch-after", type=cli.positive_int, default=12,
                   help="replay of two tables: trials on the first before the change (default 12)")
    p.add_argument("--tuners", nargs="+", default=["rrl", "random", "tpe"],
                   choices=["rrl", "random", "tpe", "exhaustive"], help="replay: the tuners to compare")
    p.add_argument("--seeds", type=cli.positive_int, default=20, help="replay: seeds per tuner (default 20)")
    p.add_argument("--seed", type=int, default=0, help="live: the tuner's seed; model and data seed (default 0)")
    p.add_argument("--steps", type=cli.positive_int, default=6, help="steps per measurement (default 6)")
    p.add_argument("--emit-config", default=None, metavar="FILE",
                   help="live: write the best configuration to FILE as DeepSpeed JSON (zero_optimization, and a "
                        "\"qcoll\" section ZeroConfig.from_deepspeed reads)")
    p.add_argument("--max-loss-increase", type=float, default=0.05,
                   help="feasible: final loss at most (1 + this) x ZeRO-3's (default 0.05)")
    train.add_model_options(p)
    cli.add_common_options(p, iters=1, warmup=2)
    p.set_defaults(func=main)
    return p


def space():
    """The searched space: a reduced ZeRO++ space (24 configurations)."""
    from ..tune import Knob, Space

    return Space([Knob("weight_bits", (None, 8, 4)), Knob("grad_bits", (None, 4)), Knob("hpz", (False, True)),
                  Knob("prefetch", (0, 1))])


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.record and args.replay:
        parser.error("--record and --replay exclude each other")
    if args.emit_config and (args.record or args.replay):
        parser.error("--emit-config writes the best configuration of a live search (not with --record or --replay)")
    if args.replay:
        return _replay(args, parser)
    cli.check_output(parser, "--record", args.record)   # before the 24 measurements, not after them
    cli.check_output(parser, "--emit-config", args.emit_config)
    world = cli.check_common(parser, args)
    train.check_model_options(parser, args, world)
    if args.warmup >= args.steps - 2:
        parser.error(f"--warmup {args.warmup} must leave at least 3 timed steps of --steps {args.steps}")
    if not args.max_loss_increase >= 0:
        parser.error(f"--max-loss-increase must be >= 0, got {args.max_loss_increase}")
    with progress.starting(NAME, world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


def _measure(args, topo, config: dict) -> tuple[float, float]:
    """(median step seconds after --warmup, mean loss of the last 3 steps) of one configuration; its steps
    are counted in ``args.reporter`` (the command's progress, set by ``_rank_main``) where there is one."""
    from .. import zero
    from ..testing import Batches, stdlib_bytes, train_steps

    reporter = getattr(args, "reporter", None)

    model = train.build_model(args)
    m = zero.shard(model, topo, zero.ZeroConfig(**config), units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=args.lr, weight_decay=0.0)
    batches = Batches(stdlib_bytes(), args.batch, args.context, args.seed + 1)
    times = []
    losses = train_steps(m, opt, batches, args.steps, rank=topo.rank, world=topo.world_size,
                         before_step=lambda i: dist.barrier(), step_seconds=times,
                         after_step=lambda i, _: reporter.update(i + 1) if reporter is not None else None)
    slowest = torch.tensor([statistics.median(times[args.warmup:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest), sum(losses[-3:]) / 3


def _rank_main(args) -> None:
    from ..comm import Topology

    topo = Topology(args.ranks_per_node)
    with progress.Steps(NAME, enabled=topo.rank == 0) as prog:
        args.reporter = prog
        try:
            _search(args, topo, prog)
        finally:
            del args.reporter


def _search(args, topo, prog: progress.Steps) -> None:
    """ZeRO-3's reference loss, then ``--record``'s every configuration or the live search (each
    measurement a run of ``prog``), then the results (rank 0)."""
    from .. import tune

    sp = space()
    reference_point = tuple(k.values.index(v) for k, v in zip(sp.knobs, (None, None, False, 0)))
    prog.begin("ZeRO-3 (the reference loss)", args.steps)
    _, reference_loss = _measure(args, topo, sp.config(reference_point))
    prog.end()
    limit = reference_loss * (1 + args.max_loss_increase)
    measured, losses = {}, {}

    def measure(config, label):
        point = tuple(k.values.index(config[k.name]) for k in sp.knobs)
        if point not in measured:
            prog.begin(f"{label}: {tune.zero_config_line(config)}", args.steps)
            seconds, loss = _measure(args, topo, config)
            prog.end()
            measured[point], losses[point] = (seconds, loss <= limit), loss
            if topo.rank == 0:
                print(f"{tune.zero_config_line(config)}: {seconds * 1e3:.1f} ms/step, loss {loss:.4f} "
                      f"({'feasible' if loss <= limit else 'over the limit'})", flush=True)
        return measured[point]

    if args.record:
        for k, point in enumerate(sp.points(), 1):
            measure(sp.config(point), f"configuration {k}/{len(sp)}")
        prog.close()
        if topo.rank == 0:
            cli.write_json(args.record, table_doc(tune.Table(sp, measured)))
            if args.json:
                cli.write_json(args.json, {"command": NAME, "record": args.record, "reference_loss": reference_loss,
                                           "rows": [{"config": sp.config(p), "step_time_s": c, "feasible": f}
                                                    for p, (c, f) in measured.items()]})
        return
    tuner = tune.TUNERS[args.tuner](sp, seed=args.seed)
    for trial in range(1, args.budget + 1):
        box = [tuner.ask() if topo.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)   # every rank measures what rank 0's tuner chose
        cost, feasible = measure(sp.config(box[0]), f"trial {trial}/{args.budget}")
        if topo.rank == 0:
            tuner.tell(box[0], cost, feasible)
    default = {"weight_bits": 8, "grad_bits": 4, "hpz": True, "prefetch": 1}   # ZeroConfig()'s values
    prog.begin("ZeroConfig()'s defaults", args.steps)
    default_seconds, default_loss = _measure(args, topo, default)                 # side by side, same run
    prog.close()
    if topo.rank == 0:
        _report_best(sp, tuner, losses, args, (default, default_seconds, default_loss), reference_loss,
                     topo.ranks_per_node)


def _report_best(sp, tuner, losses, args, default, reference_loss, ranks_per_node: int) -> None:
    from .. import tune

    best = tuner.best()
    if best is None:
        print("no feasible configuration found" + (f"; {args.emit_config} not written" if args.emit_config else ""),
              flush=True)
        return
    config = sp.config(best.point)
    d_config, d_seconds, d_loss = default
    print(f"best: {tune.zero_config_line(config)}  ({best.cost * 1e3:.1f} ms/step, loss {losses[best.point]:.4f})")
    print(f"defaults: {tune.zero_config_line(d_config)}  ({d_seconds * 1e3:.1f} ms/step, loss {d_loss:.4f}; "
          f"ZeRO-3 loss {reference_loss:.4f}); speed-up of the best {d_seconds / best.cost:.2f}x")
    print("\n".join(["the best configuration, each form usable as printed:",
                     *tune.config_lines(config, ranks_per_node, indent="  ")]), flush=True)
    if args.emit_config:
        tune.write_config(args.emit_config, config, ranks_per_node)
        print(f"wrote {args.emit_config}", flush=True)
    if args.json:
        cli.write_json(args.json, {"command": NAME, "best": config, "step_time_s": best.cost,
                                   "loss": losses[best.point], "ranks_per_node": ranks_per_node,
                                   "deepspeed": tune.deepspeed_json(config, ranks_per_node),
                                   "zero_config": tune.zero_config_line(config),
                                   "quantize_comm": tune.quantize_comm_line(config), "defaults": d_config,
                                   "defaults_step_time_s": d_seconds, "defaults_loss": d_loss,
                                   "zero3_loss": reference_loss,
                                   "trials": [{"config": sp.config(t.point), "step_time_s": t.cost,
                                               "feasible": t.feasible, "loss": losses[t.point]}
                                              for t in tuner.trials]})
    if args.plot:
        best, curve = float("inf"), []
        for t in tuner.trials:
            best = min(best, t.cost) if t.feasible else best
            curve.append(best)
        _plot({args.tuner: curve}, args.plot, "live search")


def _replay(args, parser) -> int:
    from .. import tune

    cli.check_outputs(parser, args)
    if len(args.replay) > 2:
        parser.error(f"--replay takes one table, or two for a workload change, got {len(args.replay)}")
    tables = []
    for path in args.replay:
        try:
            tables.append(tune.Table.load(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--replay {path}: not a recorded table ({e})")
    with progress.Steps(NAME) as prog:
        prog.begin(f"replay of {args.replay[0]}: {' '.join(args.tuners)}, {args.seeds} seeds each")
        doc = {"command": NAME, "replay": args.replay, "tuners": tune.replay(tables[0], args.tuners, seeds=args.seeds)}
    for name, r in doc["tuners"].items():
        print(f"{name:>10}: median {r['median']} trials to within 5% of the best (seeds: {r['trials']})")
    if len(tables) == 2:
        try:
            with progress.Steps(NAME) as prog:
                prog.begin(f"replay of the change to {args.replay[1]} after {args.switch_after} trials")
                doc["change"] = tune.replay_change(tables[0], tables[1], args.switch_after, args.tuners,
                                                   seeds=args.seeds)
        except ValueError as e:
            parser.error(f"--replay: {e}")
        for name, r in doc["change"].items():
            print(f"{name:>10}: after the change, median {r['median']} trials to within 5% of the new best "
                  f"(seeds: {r['trials']})")
    if args.json:
        cli.write_json(args.json, doc)
    if args.plot:
        _plot({name: r["median_best"] for name, r in doc["tuners"].items()}, args.plot,
              f"replay of {args.replay[0]}: median over {args.seeds} seeds")
    return 0


def table_doc(table) -> dict:
    """``table`` (a :class:`qcoll.tune.Table`) as the JSON document ``Table.save`` writes and
    ``Table.load`` reads, for :func:`qcoll.bench.cli.write_json` (atomic, never through a symlink)."""
    return {"knobs": [{"name": k.name, "values": list(k.values)} for k in table.space.knobs],
            "rows": [{"point": list(p), "cost": c, "feasible": f} for p, (c, f) in table.costs.items()]}


def _plot(curves: dict, path: str, title: str) -> None:
    """Best-so-far step time against trials, one line per tuner."""
    from matplotlib.figure import Figure  # headless

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [c * 1e3 for c in curve], label=name, linewidth=1.2)
    ax.set_xlabel("trial")
    ax.set_ylabel("best step time so far (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    plot.save_figure(fig, path)
