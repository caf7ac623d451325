"""``qcoll-bench serve``'s run (:mod:`.serve` has its options and docs): imported only when the
command runs, since it needs the ``serve`` extra (uvicorn, starlette, aiohttp). Progress (stderr;
:mod:`qcoll.bench.progress`): each offline table a run of its configurations, each run of the
trace a run of the trace's seconds."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from ..serve.batcher import BatchConfig
from ..serve.scheduler import serve_space
from . import cli, progress
from .ranks import _free_port
from .serve_load import arrivals, parse_trace, rate_at, run_load
from .serve_model import write_model
from .serve_report import format_replay, format_table, oracle_point, summarize


# ---------------------------------------------------------------------------- the server
class ServerProcess:
    """``qcoll-serve`` in a process of its own (``python -m qcoll.serve.cli``), stopped on exit."""

    def __init__(self, model: str, config: str, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "qcoll.serve.cli", model, "--config", config,
                                      "--port", str(self.port), "--admin", *extra])   # on 127.0.0.1: no token
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qcoll-serve exited with {self.proc.returncode} before it served")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("qcoll-serve did not answer /health within 120 s")

    def get(self, path: str) -> dict:
        return json.load(urllib.request.urlopen(self.url + path, timeout=10))

    def put_config(self, config: dict) -> None:
        req = urllib.request.Request(self.url + "/admin/config", data=json.dumps(config).encode(), method="PUT")
        urllib.request.urlopen(req, timeout=10).read()

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------- runs
def _body(args) -> bytes:
    rng = np.random.default_rng(args.seed + 2)
    prompt = rng.integers(2, args.vocab, args.prompt_len).tolist()
    return json.dumps({"prompt": prompt, "max_new_tokens": args.new_tokens}).encode()


def _rates(trace) -> list[float]:
    rates = set()
    for seg in trace:
        rates.update({seg.rate_from, seg.rate_to, seg.mean_rate})
    return sorted(r for r in rates if r > 0)


def offline_tables(args, files, space, body, prog: progress.Steps | None = None) -> dict:
    """Per rate: every configuration's client-side p95 (s) and violation rate, static, one server;
    ``prog``: the command's progress (each rate a run of the space's configurations)."""
    prog = prog if prog is not None else progress.Steps(args.command, enabled=False)
    tables = {}
    prog.begin("offline tables: starting qcoll-serve")
    with ServerProcess(*files, "--tuner", "none", "--slo-ms", str(args.slo_ms)) as server:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else _rates(args.trace_segments)
        for k, rate in enumerate(rates, 1):
            prog.begin(f"offline table at {rate:g}/s ({k}/{len(rates)})", len(space), unit="configuration")
            rows = []
            for n, point in enumerate(space.points()):
                config = space.config(point)
                server.put_config(config)
                times = arrivals(parse_trace(f"{rate}:{args.oracle_seconds}"), args.load_seed + 100 + n)
                out = run_load(server.url + "/v1/generate", times, body)
                keep = times >= args.settle_seconds
                lat, ok = out["latency"][keep], out["status"][keep] == 200
                p95 = float(np.percentile(np.where(ok, lat, np.inf), 95)) if keep.any() else float("inf")
                rows.append({"point": list(point), "config": BatchConfig(**config).label(), "p95_s": p95,
                             "violations": float(np.mean(~ok | (lat > args.slo_ms / 1e3)))})
                prog.write(f"offline {rate:g}/s {rows[-1]['config']}: p95 {p95 * 1e3:.1f} ms")
                prog.update(n + 1)
            prog.end()
            tables[rate] = rows
    return tables


def load_tables(path: str, space) -> dict:
    """The offline tables of an earlier ``--json`` (ValueError unless they are of this space)."""
    with open(path) as f:
        doc = json.load(f)
    tables = {float(rate): rows for rate, rows in doc.get("tables", {}).items()}
    points = sorted(map(tuple, space.points()))
    for rate, rows in tables.items():
        if sorted(tuple(r["point"]) for r in rows) != points:
            raise ValueError(f"--tables {path}: the table at {rate:g}/s is not of this space ({len(space)} configurations)")
    if not tables:
        raise ValueError(f"--tables {path}: no tables in it")
    return tables


def replay_on_tables(args, space, tables) -> dict:
    """Each tuner replayed on the offline tables along the trace (its segments' mean rates and
    request counts), over ``--replay-seeds`` seeds: requests to near after each segment's start."""
    from ..serve.replay import replay_many
    from .serve_report import _nearest

    segments = [(s.mean_rate, int(s.mean_rate * s.seconds)) for s in args.trace_segments]
    by_point = [{tuple(r["point"]): r["p95_s"] for r in _nearest(tables, rate)} for rate, _ in segments]
    return replay_many(by_point, segments, seeds=args.replay_seeds, within=args.within, slo_s=args.slo_ms / 1e3,
                       space=space, window=args.window)


def _switcher(server, space, tables, trace, start_time):
    """A thread that applies the oracle's configuration for the rate of the moment (the table
    rate nearest it), checked every 0.5 s: at each step's start, and along a ramp."""
    import threading

    def run():
        applied, end = None, sum(s.seconds for s in trace)
        for t in np.arange(0.0, end, 0.5):
            delay = start_time + t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            point = oracle_point(tables, rate_at(trace, t))
            if point != applied:
                server.put_config(space.config(point))
                applied = point

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_trace(args, files, space, body, name: str, tables: dict | None, prog: progress.Steps | None = None,
              label: str | None = None) -> dict:
    """Run ``name`` on the trace; ``prog``: the command's progress (the run: the trace's seconds, as played)."""
    prog = prog if prog is not None else progress.Steps(args.command, enabled=False)
    label = label or name
    times = arrivals(args.trace_segments, args.load_seed)
    d = BatchConfig()
    common = ["--slo-ms", str(args.slo_ms), "--window", str(args.window), "--batch-sizes", args.batch_sizes,
              "--timeouts-ms", args.timeouts_ms, "--max-batch-size", str(d.max_batch_size),
              "--batch-wait-ms", str(d.batch_wait_timeout_s * 1e3)]
    tuner = name if name in ("rrl", "random", "tpe") else "none"
    prog.begin(f"{label}: starting qcoll-serve")
    with ServerProcess(*files, "--tuner", tuner, *common) as server:
        cpu0 = server.cpu_seconds()
        if name == "oracle":
            _switcher(server, space, tables, args.trace_segments, time.monotonic() + 0.2)
        prog.begin(f"{label}: trace", round(sum(s.seconds for s in args.trace_segments)), unit="s", timed=True)
        out = run_load(server.url + "/v1/generate", times, body)
        prog.end()
        out["server_cpu_s"] = server.cpu_seconds() - cpu0
        metrics = server.get("/metrics")
    return summarize(name, args, times, out, metrics, tables, space)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        args.trace_segments = parse_trace(args.trace)
        batch_sizes = tuple(int(v) for v in args.batch_sizes.split(","))
        timeouts = tuple(float(v) / 1e3 for v in args.timeouts_ms.split(","))
        space = serve_space(batch_sizes=batch_sizes, timeouts_s=timeouts)
    except ValueError as e:
        parser.error(str(e))
    cli.check_output(parser, "--json", args.json)
    if args.tables and not os.path.isfile(args.tables):
        parser.error(f"--tables {args.tables}: no such file")
    body = _body(args)
    with progress.Steps(args.command) as prog, tempfile.TemporaryDirectory(prefix="qcoll-serve-bench-") as folder:
        prog.begin("writing the model")
        positions = args.prompt_len + args.new_tokens + 8
        files = write_model(folder, args, positions)
        tables = load_tables(args.tables, space) if args.tables else offline_tables(args, files, space, body, prog)
        results = []
        for k, name in enumerate(args.runs, 1):
            label = f"{name} ({k}/{len(args.runs)})" if len(args.runs) > 1 else name
            results.append(run_trace(args, files, space, body, name, tables, prog, label))
        if args.replay_seeds:
            prog.begin(f"replay on the offline tables, {args.replay_seeds} seeds")
        replayed = replay_on_tables(args, space, tables) if args.replay_seeds else None
    print(format_table(results, args))
    if replayed:
        print(format_replay(replayed, args))
    if args.json:
        cli.write_json(args.json, {"command": args.command, "args": {k: v for k, v in vars(args).items()
                                                             if k not in ("func", "trace_segments")},
                                   "space": len(space), "tables": {str(k): v for k, v in (tables or {}).items()},
                                   "runs": results, "replay": replayed})
    return 0
