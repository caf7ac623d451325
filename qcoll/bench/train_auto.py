"""``qcoll-bench train --auto rrl random tpe``: the online configuration search in the training loop.

Each tuner's run trains the same model on the same batches as the static modes of the command,
starting from ZeRO++'s defaults (``zeropp``, with ``--prefetch``), while :class:`qcoll.tune.AutoTune`
switches the wire format between steps (its ``update()`` is the optimizer's step post-hook). The
run is named ``auto-<tuner>``.

Reported for every run of the command, static or auto (so that they compare on the same steps):
``mean_after_s``, the mean step time after the first ``--settle`` steps, and ``wall_s``, the sum
of all step times (the slowest rank's), with the ratios to the best static run (the fastest
``mean_after_s`` among the static modes and peers). For an auto run also, per step, the
configuration it ran (``labels``), the tuner's phase and the decisions' bytes. Inside
``qcoll-bench cluster`` with a rate that changes mid-run (``--link 100mbit@0,20mbit@150``), per
change: the best static run's mean step time on the new rate (its steps from the change + 10 to
the next change), and how many steps after the change the auto run's steps are within 5% of it
(``steps_to_within_5pct``: the first step from which the median of 4 consecutive steps is).

The configuration each auto run settled on (its ZeroConfig at the end: the mode's fields with the
tuner's knobs) is printed in the forms usable as printed (:func:`qcoll.tune.config_lines`: a
``ZeroConfig(...)`` line, the DeepSpeed config as JSON alone on its line with the run's ranks per
node, the ``quantize_comm(...)`` call) and recorded as ``auto.final_config`` in the JSON.
``--emit-config FILE`` writes the DeepSpeed JSON (``ZeroConfig.from_deepspeed(json.load(open(FILE)),
ranks_per_node)`` gives it back exactly) of the auto run with the lowest ``mean_after_s`` (the
fastest settled run, as the comparison table ranks them; the first of equals), atomically.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from . import cli
from .link_schedule import SCHEDULE_ENV, change_steps

TUNERS = ("rrl", "random", "tpe")
PREFIX = "auto-"
#: the auto runs on the FSDP2 path (``--auto-fsdp2``): ``auto-fsdp2-<tuner>``, from ``fsdp2-qcoll``
FSDP2_PREFIX = "auto-fsdp2-"


def add_options(p) -> None:
    g = p.add_argument_group("online configuration search (qcoll.tune.AutoTune)")
    g.add_argument("--auto", nargs="*", default=[], choices=TUNERS, metavar="TUNER",
                   help="also train with AutoTune switching the wire format between steps, one run per tuner "
                        "(rrl, random, tpe), starting from zeropp")
    g.add_argument("--auto-fsdp2", nargs="*", default=[], choices=TUNERS, metavar="TUNER",
                   help="the same on the FSDP2 path: AutoTune switching quantize_comm's settings "
                        "(qcoll.fsdp.reconfigure_comm), one run per tuner, starting from fsdp2-qcoll")
    g.add_argument("--auto-window", type=cli.positive_int, default=4,
                   help="steps per measured configuration (default 4; see bench/RESULTS.md for why)")
    g.add_argument("--auto-explore", type=cli.positive_int, default=12,
                   help="configurations measured before settling (default 12)")
    g.add_argument("--auto-reexplore", type=cli.positive_int, default=8,
                   help="configurations measured after a drift restart (default 8)")
    g.add_argument("--emit-config", default=None, metavar="FILE",
                   help="write the configuration the fastest auto run (lowest mean step after --settle) settled on "
                        "to FILE as DeepSpeed JSON (zero_optimization, and a \"qcoll\" section "
                        "ZeroConfig.from_deepspeed reads)")
    g.add_argument("--settle", type=cli.nonnegative_int, default=60,
                   help="every run's mean_after_s leaves out its first SETTLE steps (default 60)")


def check(parser, args) -> None:
    auto = args.auto or args.auto_fsdp2
    if args.settle >= args.steps and (auto or args.settle != 60):
        parser.error(f"--settle {args.settle} must be smaller than --steps {args.steps}")
    if auto and args.adaptive_batch is not None:
        parser.error("--auto (or --auto-fsdp2) does not combine with --adaptive-batch")
    if args.emit_config is not None and not auto:
        parser.error("--emit-config writes the configuration an --auto run settled on: it needs --auto")
    cli.check_output(parser, "--emit-config", args.emit_config)   # before the runs, not after them


def is_auto(mode: str) -> bool:
    return mode.startswith(PREFIX)


def modes(args) -> list[str]:
    """The auto runs of the command, in order."""
    return [PREFIX + t for t in args.auto] + [FSDP2_PREFIX + t for t in args.auto_fsdp2]


def run(args, mode: str, topo, run_qcoll, run_fsdp2):
    """Train ``args.steps`` steps with AutoTune (``mode``: ``auto-<tuner>`` from ``zeropp`` through
    ``run_qcoll``, train's ``_run_qcoll``; ``auto-fsdp2-<tuner>`` from ``fsdp2-qcoll`` through
    ``run_fsdp2(args, mode, topo, attach)``). Returns train's run tuple and the auto record."""
    from .. import tune
    from ..tune import AutoTune

    labels, phases, tuners = [], [], []

    def attach(m, opt):
        tuner = mode[len(FSDP2_PREFIX if mode.startswith(FSDP2_PREFIX) else PREFIX):]
        auto = AutoTune(m, tuner=tuner, window=args.auto_window, explore=args.auto_explore,
                        reexplore=args.auto_reexplore, seed=args.seed)
        tuners.append(auto)
        # after train's memory hook: both before zero_grad (the gradients count in the error budget)
        opt.register_step_post_hook(lambda *_: auto.update())
        return lambda: (labels.append(auto.label), phases.append(auto.phase), _show(args, auto))

    if mode.startswith(FSDP2_PREFIX):
        result = run_fsdp2(args, "fsdp2-qcoll", topo, attach)
    else:
        result = run_qcoll(args, "zeropp", topo, attach)
    (auto,) = tuners
    record = {"labels": labels, "phases": phases, "switches": auto.switches, "decision_bytes": auto.decision_bytes,
              "final": auto.label, "explorations": auto.policy.explorations if auto.policy else None,
              "final_config": {"ranks_per_node": topo.ranks_per_node,
                               "zero_config": tune.zero_config_line(auto.config),
                               "deepspeed": tune.deepspeed_json(auto.config, topo.ranks_per_node),
                               "quantize_comm": tune.quantize_comm_line(auto.config)}}
    return result, record


def _final_config(record: dict):
    """The ZeroConfig an auto run settled on, from its record's DeepSpeed JSON (exact: :mod:`qcoll.tune.emit`)."""
    from ..zero import ZeroConfig

    final = record["final_config"]
    return ZeroConfig.from_deepspeed(final["deepspeed"], final["ranks_per_node"])


def fastest_auto(runs: list[dict]) -> dict | None:
    """The auto run ``--emit-config`` writes: the lowest ``mean_after_s`` (the first of equals), or None."""
    auto = [r for r in runs if "auto" in r and "mean_after_s" in r]
    return min(auto, key=lambda r: r["mean_after_s"]) if auto else None


def emit_config(args, runs: list[dict]) -> str | None:
    """``--emit-config``: write :func:`fastest_auto`'s configuration (rank 0, after the runs); the line saying so."""
    run = fastest_auto(runs)
    if args.emit_config is None or run is None:
        return None
    cli.write_json(args.emit_config, run["auto"]["final_config"]["deepspeed"])
    return (f"wrote {args.emit_config}: the configuration {run['mode']} settled on (the auto run with the lowest "
            f"mean step after step {args.settle})")


def _show(args, auto) -> None:
    """Name the configuration the step runs in the command's progress (rank 0's; ``train``'s ``args.reporter``)."""
    reporter = getattr(args, "reporter", None)
    if reporter is not None:
        reporter.note(f"{auto.label}, {auto.phase}")


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def summarize(runs: list[dict], settle: int) -> None:
    """Add ``mean_after_s``, ``wall_s`` and the ratios to the best static run, and per rate change
    ``changes`` (see the module docstring). Every rank calls it (an all-reduce per run)."""
    for r in runs:
        r["step_seconds"] = _slowest(r["step_seconds"])
        r["mean_after_s"] = statistics.fmean(r["step_seconds"][settle:])
        r["wall_s"] = sum(r["step_seconds"])
    static = [r for r in runs if not is_auto(r["mode"])]
    if not static:
        return
    best = min(static, key=lambda r: r["mean_after_s"])
    best_wall = min(static, key=lambda r: r["wall_s"])
    changes = change_steps(os.environ.get(SCHEDULE_ENV))
    for r in runs:
        r["best_static"] = best["mode"]
        r["mean_after_vs_best_static"] = r["mean_after_s"] / best["mean_after_s"]
        r["wall_vs_best_static"] = r["wall_s"] / best_wall["wall_s"]
        if changes:
            r["changes"] = [_after_change(r, static, c, (changes + [len(r["step_seconds"])])[k + 1])
                            for k, c in enumerate(changes)]


def _after_change(run: dict, static: list[dict], at: int, end: int) -> dict:
    """The best static mean on the new rate (steps ``at + 10 .. end``) and the steps until ``run``'s
    rolling median of 4 is within 5% of it."""
    means = {r["mode"]: statistics.fmean(r["step_seconds"][at + 10:end]) for r in static if end > at + 10}
    if not means:
        return {"step": at, "best_static": None}
    mode = min(means, key=means.get)
    times = run["step_seconds"]
    within = next((s - at for s in range(at, end - 3) if statistics.median(times[s:s + 4]) <= 1.05 * means[mode]),
                  None)
    return {"step": at, "best_static": mode, "best_static_s": means[mode], "steps_to_within_5pct": within,
            "mean_s": statistics.fmean(times[at + 10:end])}


def format_auto(runs: list[dict], settle: int) -> str:
    """The comparison table and, per auto run, the configurations it ran (segments of equal ones)."""
    if not any("mean_after_s" in r for r in runs):
        return ""
    lines = ["", f"online search: mean step after step {settle} and the whole run's wall time, against the best "
                 f"static run ({runs[0].get('best_static')})",
             f"{'mode':>16} {'mean_after(ms)':>15} {'x best':>7} {'wall(s)':>8} {'x best':>7}  changes"]
    for r in runs:
        ch = "; ".join(f"@{c['step']}: {c.get('steps_to_within_5pct')} steps to 5% of {c.get('best_static')}"
                       for c in r.get("changes", []))
        lines.append(f"{r['mode']:>16} {r['mean_after_s'] * 1e3:>15.1f} {r.get('mean_after_vs_best_static', 0):>7.3f} "
                     f"{r['wall_s']:>8.1f} {r.get('wall_vs_best_static', 0):>7.3f}  {ch}")
    for r in runs:
        if "auto" not in r:
            continue
        segments, start = [], 0
        labels = r["auto"]["labels"]
        for i in range(1, len(labels) + 1):
            if i == len(labels) or labels[i] != labels[start]:
                ms = statistics.median(r["step_seconds"][start:i]) * 1e3
                segments.append(f"  steps {start + 1}-{i}: {labels[start]} ({ms:.0f} ms)")
                start = i
        lines.append(f"{r['mode']}: {r['auto']['switches']} switches, {r['auto']['decision_bytes']} decision bytes "
                     f"(rank 0), settled on {r['auto']['final']}")
        lines += segments
        if "final_config" in r["auto"]:
            from ..tune import config_lines

            lines.append(f"  {r['mode']} settled on, each form usable as printed:")
            lines += config_lines(_final_config(r["auto"]), r["auto"]["final_config"]["ranks_per_node"],
                                  indent="    ")
    return "\n".join(lines)
