"""``qcoll-bench cluster``: run ``train``, ``collectives``, ``tune``, ``generate`` or ``rlhf`` on an emulated low-bandwidth cluster.

One network namespace per node, each node's link to a switch rate-limited with
``tc`` (:mod:`qcoll.bench.netns`), every rank started inside its node's namespace
(``ip netns exec``) with the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` = node 0's
address) and ``GLOO_SOCKET_IFNAME`` set to the node's interface, so ranks of one
node talk over loopback and ranks of different nodes over the shaped link.

For each ``--link`` rate in turn the cluster is built, the command runs, the
veth byte counters are read and the cluster is torn down again, also when the
command fails, on Ctrl-C or on SIGTERM. Example::

    qcoll-bench cluster --nodes 2 --ranks-per-node 2 --link 100mbit 1gbit unlimited \\
        --json cluster.json -- train --modes zero3 zeropp --peer fsdp2 fsdp2-bf16 --steps 20

JSON (``--json FILE``)::

    {"command": "cluster", "nodes", "ranks_per_node", "world", "delay", "inner": [...],
     "runs": [{"link", "rate_bits", "seconds", "cross_node_bytes", "per_node": [...],
               "result": <the inner command's JSON>}],
     "summary": [...]}   # train only: the summary table's rows (summary_rows)

A ``--link`` of the form ``100mbit@0,20mbit@150`` changes the rate while ``train`` runs, at its step 150
(:mod:`qcoll.bench.link_schedule`; each mode's steps count from 0, so each mode sees the same change);
the run's JSON then lists the changes made (``rate_changes``).

``cross_node_bytes`` covers the whole command (start-up and warm-up included);
``train`` also reports per mode the bytes per timed step (``link_bytes_per_step``), ``generate``
the bytes of the first forward and per token after it (``link_bytes_first_forward``,
``link_bytes_per_token_after_first``).
Progress: the ranks' output goes to files; rank 0's plain progress lines (:mod:`qcoll.bench.progress`)
are forwarded to stderr as they appear (``QCOLL_PROGRESS=0`` turns them off).
Needs root and iproute2; refuses with exit code 2 otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from . import cli, link_schedule, netns, progress
from .ranks import RankFailed, _on_sigterm, _restore_signal, _set_signal
from .linkmeter import ENV as METER_ENV

NAME = "cluster"
INNER = ("train", "collectives", "tune", "generate", "rlhf", "diloco")
RESERVED = ("--nproc", "--ranks-per-node", "--json", "--plot")
MASTER_PORT = 29500          # the namespaces are new, so nothing else listens there
GRACE_S = 5.0
# how a rank starts the installed qcoll-bench; -P (Python >= 3.11) keeps the working directory off sys.path, so
# a run from a checkout's root does not import its source tree's qcoll/ over the installed package
PYTHON = (sys.executable, "-P") if sys.version_info >= (3, 11) else (sys.executable,)


class InnerUsageError(Exception):
    """The command run on the cluster rejected its arguments (its ranks exited with code 2)."""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="run train, collectives, tune, generate or rlhf on an emulated cluster of "
                                         "network namespaces",
                              description=__doc__.split("\n\n")[0],
                              usage=f"qcoll-bench cluster [options] -- {{{','.join(INNER)}}} [their options]")
    p.add_argument("--nodes", type=cli.positive_int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=cli.positive_int, default=2, help="ranks in each node (default 2)")
    p.add_argument("--link", nargs="+", default=["100mbit"], metavar="RATE",
                   help="inter-node link rate(s), each run in turn: e.g. 100mbit 1gbit unlimited (default 100mbit); "
                        "a rate that changes mid-run: 100mbit@0,20mbit@150 (20 Mbit/s from the command's step 150 "
                        "on, in each of its runs; train only)")
    p.add_argument("--delay", default=None, help="one-way delay added on each node's link, e.g. 1ms (needs netem)")
    p.add_argument("--timeout", type=cli.positive_int, default=3600,
                   help="seconds one command may run before it is stopped (default 3600)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every run's figures to this JSON file")
    p.add_argument("inner", nargs=argparse.REMAINDER, help=f"-- then the command to run: {', '.join(INNER)}")
    p.set_defaults(func=main)
    return p


def _inner_command(parser, args) -> list[str]:
    inner = list(args.inner)
    if inner[:1] == ["--"]:
        inner = inner[1:]
    if not inner or inner[0] not in INNER:
        parser.error(f"give the command to run after --, one of {', '.join(INNER)} (got {' '.join(inner) or 'none'})")
    for opt in RESERVED:
        if any(a == opt or a.startswith(opt + "=") for a in inner[1:]):
            parser.error(f"{opt} is set by the cluster; leave it out of the {inner[0]} command "
                         f"(use --nodes/--ranks-per-node/--json of cluster)")
    # parse the inner command here, so a typo is reported before any namespace exists
    cli.build_parser().parse_args(inner)
    return inner


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    inner = _inner_command(parser, args)
    try:
        schedules = [link_schedule.parse_schedule(r, netns.parse_rate) for r in args.link]
        delay = netns.parse_delay(args.delay)
    except ValueError as e:
        parser.error(str(e))
    if any(len(s) > 1 for s in schedules) and (inner[0] != "train" or delay is not None):
        parser.error("a --link rate that changes mid-run (RATE@STEP,...) works with train and without --delay")
    if args.json is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: folder does not exist")
    try:
        netns.check_prerequisites()
    except netns.ClusterError as e:
        parser.error(str(e))
    world = args.nodes * args.ranks_per_node
    runs = []
    for schedule in schedules:
        label = ",".join(netns.format_rate(r) + (f"@{step}" if len(schedule) > 1 else "") for step, r in schedule)
        print(f"== {inner[0]} on {args.nodes} nodes x {args.ranks_per_node} ranks, link {label}"
              f"{', delay ' + netns.format_delay(delay) if delay else ''}", flush=True)
        try:
            run = run_on_cluster(inner, args.nodes, args.ranks_per_node, schedule[0][1], delay, args.timeout,
                                 schedule=schedule if len(schedule) > 1 else None, label=label)
        except (netns.ClusterError, InnerUsageError) as e:
            print(f"{cli.PROG} cluster: {e}", file=sys.stderr)
            return 2
        run["link"] = label
        runs.append(run)
        print(run.pop("table"), flush=True)
        print(f"cross-node bytes (veth, whole command): {run['cross_node_bytes']} in {run['seconds']:.1f} s",
              flush=True)
    if inner[0] == "train":
        print(summary_table(runs), flush=True)
    if args.json:
        doc = {"command": NAME, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "world": world,
               "delay": netns.format_delay(delay), "inner": inner, "runs": runs}
        if inner[0] == "train":
            doc["summary"] = summary_rows(runs)
        cli.write_json(args.json, doc)
    return 0


def _rank_preexec() -> None:
    """In each rank (before exec): die with the driver; Ctrl-C is the driver's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_env(net: netns.Network, rank: int, world: int, per_node: int) -> dict:
    env = dict(os.environ)
    for key in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(key, None)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
               LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=net.addresses[0], MASTER_PORT=str(MASTER_PORT),
               GLOO_SOCKET_IFNAME=net.ifname, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
               PYTHONUNBUFFERED="1")
    env[METER_ENV] = net.meter().env_value()
    # the ranks write to files: plain progress lines (forwarded by _Forward), or none when the user turned it off
    env.pop(progress.STARTED_ENV, None)
    if progress.style(sys.stderr) == "off":
        env["QCOLL_PROGRESS"] = "0"
    else:
        env.pop("QCOLL_PROGRESS", None)
    return env


def run_on_cluster(inner: list[str], nodes: int, per_node: int, rate: int | None, delay: float | None,
                   timeout: float, schedule=None, label: str | None = None) -> dict:
    """Build the cluster, run ``inner`` on ``nodes * per_node`` ranks, read the counters, tear down.

    Returns ``{"rate_bits", "seconds", "cross_node_bytes", "per_node", "result", "table"}``
    (``table``: rank 0's stdout). ``schedule``: ``[(step, rate), ...]`` from
    :func:`~qcoll.bench.link_schedule.parse_schedule` (``label`` its text), followed while the command
    runs; the result then has ``rate_changes`` (:class:`~qcoll.bench.link_schedule.RateFollower`). Raises :class:`~qcoll.bench.ranks.RankFailed` when a
    rank fails (the others are stopped first), :class:`~qcoll.bench.netns.ClusterError`
    when the cluster cannot be built; the namespaces are gone in every case.
    """
    world = nodes * per_node
    net = netns.Network(nodes, rate, delay)
    previous_term = _set_signal(signal.SIGTERM, _on_sigterm)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="qcoll-cluster-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        progress = os.path.join(tmp, "progress")
        follower = None
        try:
            net.create()
            if schedule is not None:
                follower = link_schedule.RateFollower(progress, schedule, net.set_rate)
                follower.start()
            before = net.counters()
            t0 = time.perf_counter()
            for rank in range(world):
                out = open(os.path.join(tmp, f"rank{rank}.out"), "w")
                err = open(os.path.join(tmp, f"rank{rank}.err"), "w")
                cmd = ["ip", "netns", "exec", net.namespaces[rank // per_node], *PYTHON, "-m", "qcoll.bench",
                       *inner, "--json", result_path]
                env = _rank_env(net, rank, world, per_node)
                if schedule is not None:
                    env.update({link_schedule.PROGRESS_ENV: progress, link_schedule.SCHEDULE_ENV: label})
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, preexec_fn=_rank_preexec,
                                              start_new_session=True))
                out.close()
                err.close()
            forward = _Forward(os.path.join(tmp, "rank0.err"), inner[0], world)
            try:
                _wait(procs, tmp, timeout, forward.poll)
            finally:
                forward.poll()
            seconds = time.perf_counter() - t0
            total, per = netns.counter_delta(before, net.counters())
            with open(result_path) as f:
                result = json.load(f)
            with open(os.path.join(tmp, "rank0.out")) as f:
                table = f.read().rstrip()
            out = {"rate_bits": rate, "seconds": seconds, "cross_node_bytes": total, "per_node": per,
                   "result": result, "table": table}
            if follower is not None:
                out["rate_changes"] = follower.stop()
            return out
        finally:
            if follower is not None and follower.is_alive():
                follower.stop()
            _stop(procs)
            errors = net.destroy()
            _restore_signal(signal.SIGTERM, previous_term)
            for e in errors:
                print(f"{cli.PROG} cluster: {e}", file=sys.stderr)


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path) as f:
            text = f.read().strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class _Forward:
    """Rank 0's progress lines of ``command`` (:func:`qcoll.bench.progress.is_line`), read from its stderr file
    as they are written and printed on this process's stderr; its other output stays in the file. Until the
    first one, a line of this command's every ``interval`` seconds (the ranks' start-up takes seconds)."""

    def __init__(self, path: str, command: str, ranks: int = 0, interval: float = progress.INTERVAL_S,
                 clock=time.monotonic):
        self.path, self.command, self.ranks = path, command, ranks
        self.offset, self.partial = 0, b""
        self.quiet = progress.style(sys.stderr) == "off"
        self.interval, self.clock = interval, clock
        self.start = self.last = clock()
        self.seen = False

    def poll(self) -> None:
        if not self.seen and not self.quiet and self.clock() - self.last >= self.interval:
            self.last = self.clock()
            print(progress.line(NAME, f"{self.command} starting on {self.ranks} ranks, {self.last - self.start:.0f} s"),
                  file=sys.stderr, flush=True)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            text = raw.decode(errors="replace").rstrip("\r")
            if progress.is_line(text, self.command):
                self.seen = True
                print(text, file=sys.stderr, flush=True)


def _wait(procs: list[subprocess.Popen], tmp: str, timeout: float, poll=None) -> None:
    """Wait for every rank; on the first failure (or the timeout) raise :class:`RankFailed`.
    ``poll()``, when given, runs at every check (every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        if poll is not None:
            poll()
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.5)   # let the rank that caused it exit too, then pick the root cause
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            secondary = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
            causes = [r for r in failed if not any(m in _tail(os.path.join(tmp, f"rank{r}.err"), 3)
                                                    for m in secondary)]
            rank = (causes or failed)[0]
            detail = _tail(os.path.join(tmp, f"rank{rank}.err")) or f"exited with code {codes[rank]}"
            if codes[rank] == 2:   # the command refused its arguments (same on every rank)
                raise InnerUsageError(detail.splitlines()[-1])
            raise RankFailed(rank, detail)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RankFailed(0, f"the command did not finish within --timeout {timeout:.0f} s")
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank, SIGKILL after ``GRACE_S``, reap all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def summary_rows(runs: list[dict]) -> list[dict]:
    """Per link and ``train`` mode: step time, link bytes and collectives per step, and the speed-ups (step-time
    ratios) against ZeRO-3, each FSDP2 peer and the fastest peer at that link (:func:`qcoll.bench.train.best_peer`:
    the fastest of the FSDP2 runs and qcoll's unquantized ZeRO-3 runs); None where the run is missing."""
    from .train import PEERS, best_peer, memory_kib

    rows = []
    for run in runs:
        results = run["result"]["runs"]
        modes = {r["mode"]: r for r in results}
        z, best = modes.get("zero3"), best_peer(results)
        for r in results:
            t = r["step_time_s"]
            row = {"link": run["link"], "mode": r["mode"], "step_time_s": t,
                   "link_bytes_per_step": r.get("link_bytes_per_step"),
                   "collectives_per_step": r.get("collectives_per_step"),
                   "inter_collectives_per_step": r.get("inter_collectives_per_step"),
                   "speedup_vs_zero3": z["step_time_s"] / t if z else None,
                   "bytes_vs_zero3": (r["link_bytes_per_step"] / z["link_bytes_per_step"]
                                      if z and z.get("link_bytes_per_step") and r.get("link_bytes_per_step") is not None
                                      else None),
                   "best_peer": best["mode"] if best else None,
                   "speedup_vs_best_peer": best["step_time_s"] / t if best else None}
            row["state_kib"], row["peak_kib"] = memory_kib(r.get("memory"))
            for peer in PEERS:
                row[f"speedup_vs_{peer}"] = modes[peer]["step_time_s"] / t if peer in modes else None
            rows.append(row)
    return rows


def summary_table(runs: list[dict]) -> str:
    """The table of record: per link and mode, step time, link bytes and collectives per step, ratios."""
    from .train import PEERS

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    rows = summary_rows(runs)
    w = max([10] + [len(r["mode"]) for r in rows])
    head = (f"{'link':>10} {'mode':>{w}} {'step(ms)':>9} {'link/step':>11} {'coll/step':>9} {'vs_zero3':>9} "
            f"{'bytes_x':>8} {'state_KiB':>9} {'peak_KiB':>9}" + "".join(f" {'vs_' + p:>13}" for p in PEERS)
            + f" {'vs_best':>8}")
    lines = ["", "summary (speed-ups are step-time ratios; bytes_x: link bytes per step / ZeRO-3's; coll/step: "
                 "collectives per rank per step; state/peak_KiB: memory per rank, see train's table; vs_best: against the "
                 "fastest peer of FSDP2, HSDP and ZeRO-3 at that link)",
             head]
    for r in rows:
        lines.append(f"{r['link']:>10} {r['mode']:>{w}} {r['step_time_s'] * 1e3:>9.1f} "
                     f"{round(r['link_bytes_per_step'] or 0):>11} {f(r['collectives_per_step'], 'd'):>9} "
                     f"{f(r['speedup_vs_zero3'], '.2f'):>9} {f(r['bytes_vs_zero3'], '.3f'):>8} "
                     f"{f(r['state_kib'], '.0f'):>9} {f(r['peak_kib'], '.0f'):>9}"
                     + "".join(f" {f(r['speedup_vs_' + p], '.2f'):>13}" for p in PEERS)
                     + f" {f(r['speedup_vs_best_peer'], '.2f'):>8}")
    for link in dict.fromkeys(r["link"] for r in rows):
        best = next(r for r in rows if r["link"] == link)["best_peer"]
        if best:
            ms = next(r for r in rows if r["link"] == link and r["mode"] == best)["step_time_s"] * 1e3
            lines.append(f"best peer at {link}: {best} ({ms:.1f} ms)")
    return "\n".join(lines)
