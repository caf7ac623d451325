"""``qcoll-bench serve``: the exported quantized model behind ``qcoll-serve``, its batching tuned
online under a latency SLO, against static configurations, on a request-rate trace.

A small GPT-2 from the model options is written as a quantized-weights file with its
``config.json`` (:mod:`.serve_model`), and each run starts ``qcoll-serve`` on it as a process of
its own on 127.0.0.1. The load generator (:mod:`.serve_load`) sends open-loop Poisson requests
(``/v1/generate``, a ``--prompt-len`` prompt, ``--new-tokens`` greedy tokens) whose rate follows
``--trace``. Runs (``--runs``):

- ``default``: the engine's defaults (:class:`qcoll.serve.BatchConfig`: Ray Serve's batching);
- ``oracle``: the best static configuration per rate, found offline by measuring every
  configuration of the space at each rate of the trace (``--oracle-seconds`` each, the first
  ``--settle-seconds`` of requests discarded), switched at each segment's start;
- ``rrl``, ``random``, ``tpe``: ``qcoll-serve --tuner`` online, from the defaults.

Reported per run (client-side latencies, to the last byte): p50/p95/p99, the SLO violation rate
(over the SLO or not answered 200), throughput, and per rate change the requests until the
configuration in force has an offline p95 within ``--within`` of the oracle's at that rate
(``first``: the first such request; ``settled``: from then on for 90% of the segment). JSON
(``--json``): everything, with the offline tables and every run's per-request records summary.
"""
from __future__ import annotations

import argparse
import importlib.util

from . import cli
from .hf_decoder import add_model_options

NAME = "serve"
RUNS = ("default", "oracle", "rrl", "random", "tpe")
#: what the run imports beyond the base install (the ``serve`` extra)
NEEDS = ("uvicorn", "starlette", "aiohttp", "transformers")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="qcoll-serve under a request-rate trace: RRL vs TPE, random, defaults, oracle",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="40:60,120:60,40:60", help="RATE:SECONDS or FROM-TO:SECONDS segments "
                   "(requests/s; default 40:60,120:60,40:60)")
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS, metavar="RUN",
                   help=f"of {' '.join(RUNS)} (default all; none: only the offline tables)")
    p.add_argument("--tables", default=None, metavar="FILE", help="take the offline tables from an earlier --json of "
                   "the same model and space (their rates must cover the trace's) instead of measuring them")
    p.add_argument("--replay-seeds", type=cli.nonnegative_int, default=20,
                   help="seeds of the replay of each tuner on the offline tables (default 20; 0: none)")
    p.add_argument("--slo-ms", type=float, default=100.0, help="the p95 latency SLO (default 100 ms)")
    p.add_argument("--within", type=float, default=0.10, help="'near the oracle' tolerance (default 0.10)")
    p.add_argument("--prompt-len", type=cli.positive_int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=cli.positive_int, default=2, help="greedy tokens per request (default 2)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="the space's max_batch_size values")
    p.add_argument("--timeouts-ms", default="0,5,20", help="the space's batch_wait_timeout values (default 0,5,20)")
    p.add_argument("--rates", default=None, metavar="R,R,...", help="rates (requests/s) of the offline tables "
                   "(default: the trace's, and a ramp's middle)")
    p.add_argument("--oracle-seconds", type=float, default=3.0, help="offline seconds per configuration and rate")
    p.add_argument("--settle-seconds", type=float, default=0.5, help="discarded at the start of each offline point")
    p.add_argument("--window", type=cli.positive_int, default=60, help="qcoll-serve --window (default 60)")
    p.add_argument("--load-seed", type=int, default=1, help="seed of the arrival times (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="write all figures to this JSON file")
    add_model_options(p, d_model=128, vocab=4096)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"{parser.prog} needs the serve extra ({', '.join(missing)} missing): pip install 'qcoll[serve]'")
    from .serve_run import run

    return run(args, parser)
