"""``qcoll-serve MODEL_FILE --config CONFIG``: serve an exported quantized model over HTTP (uvicorn).

    qcoll-serve model.safetensors --config config.json --slo-ms 100            # RRL tunes the batching
    qcoll-serve model.onnx --tuner none --max-batch-size 8 --batch-wait-ms 5    # a static configuration
    qcoll-serve model.onnx --tuner none --admin     # ... that PUT /admin/config may change (loopback)

Start-up prints each stage to stderr (loading the model, its warm-up forward, then
``listening on http://HOST:PORT`` once the socket is bound: from then on ``/health`` answers).
A model that cannot be loaded ends it with one line on stderr and exit status 2. ``--admin``
turns ``PUT /admin/config`` on (:mod:`.admin`); on an address beyond loopback it needs a token
(``--admin-token``, or the environment variable ``QCOLL_SERVE_ADMIN_TOKEN``, which other users of
the machine cannot read from the process list).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from ..checks import int_option
from .admin import TOKEN_ENV, config_bounds, is_loopback
from .app import Server, build_app
from .batcher import BatchConfig
from .body import MAX_BODY
from .runner import load_runner
from .scheduler import BATCH_SIZES, TIMEOUTS_S, SloScheduler, serve_space


def positive_int(text: str) -> int:
    return int_option(text, 1)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def int_list(text: str) -> tuple:
    return tuple(positive_int(t) for t in text.split(","))


def float_list(text: str) -> tuple:
    return tuple(nonnegative_float(t) for t in text.split(","))


def nonnegative_float(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return positive_float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcoll-serve", description="Serve an exported weight-quantized model over HTTP, "
                                "its batching tuned online under a latency SLO (RRL).")
    p.add_argument("model_file", help="qcoll.zero.export_quantized's .safetensors file, or an .onnx export")
    p.add_argument("--config", default=None, help="the model's Hugging Face config.json (or its folder); required "
                   "for a .safetensors file, which holds no architecture")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=lambda t: int_option(t, 0), default=8000,
                   help="port (default 8000; 0: a free port, printed when listening)")
    p.add_argument("--slo-ms", type=positive_float, default=100.0, help="latency SLO in ms (default 100)")
    p.add_argument("--percentile", type=positive_float, default=95.0, help="the SLO's percentile (default 95)")
    p.add_argument("--tuner", default="rrl", choices=("rrl", "random", "tpe", "none"),
                   help="online tuner of the batching knobs (default rrl; none: the static configuration below)")
    d = BatchConfig()
    p.add_argument("--max-batch-size", type=positive_int, default=d.max_batch_size,
                   help=f"static, or the tuner's start (default {d.max_batch_size}, Ray Serve's)")
    p.add_argument("--batch-wait-ms", type=nonnegative_float, default=d.batch_wait_timeout_s * 1e3,
                   help=f"static, or the tuner's start (default {d.batch_wait_timeout_s * 1e3:g})")
    p.add_argument("--workers", type=positive_int, default=d.workers, help="batches run at once (default 1)")
    p.add_argument("--intra-op-threads", type=positive_int, default=d.intra_op_threads,
                   help=f"threads per forward (default {d.intra_op_threads}, torch's)")
    p.add_argument("--max-queue", type=positive_int, default=256, help="queued requests before 503s (default 256)")
    p.add_argument("--max-body", type=positive_int, default=MAX_BODY, metavar="BYTES",
                   help=f"the largest request body; 413 above it (default {MAX_BODY})")
    p.add_argument("--window", type=positive_int, default=60, help="requests per measured window (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the tuner's seed (default 0)")
    p.add_argument("--batch-sizes", type=int_list, default=BATCH_SIZES, metavar="N,N,...",
                   help="the tuner's max_batch_size values (default %s)" % ",".join(map(str, BATCH_SIZES)))
    p.add_argument("--timeouts-ms", type=float_list, default=tuple(t * 1e3 for t in TIMEOUTS_S), metavar="MS,MS,...",
                   help="the tuner's batch_wait_timeout values (default %s)" % ",".join(f"{t * 1e3:g}" for t in TIMEOUTS_S))
    p.add_argument("--admin", action="store_true", help="turn PUT /admin/config on (off by default; beyond "
                   "loopback it needs a token)")
    p.add_argument("--admin-token", default=None, metavar="TOKEN", help="the bearer token PUT /admin/config then "
                   f"needs (default: the environment variable {TOKEN_ENV}, which the process list does not show)")
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """What argparse alone cannot check: the percentile, the admin options, the knobs' bounds."""
    if args.percentile >= 100:
        parser.error(f"--percentile must be below 100, got {args.percentile:g}")
    if args.admin_token is None:
        args.admin_token = os.environ.get(TOKEN_ENV, "").strip() or None
    elif not args.admin_token.strip():
        parser.error("--admin-token is empty")
    elif not args.admin:
        parser.error("--admin-token is for the admin API, which only --admin turns on")
    if args.admin and args.admin_token is None and not is_loopback(args.host):
        parser.error(f"--admin on --host {args.host} (beyond loopback) needs a token: --admin-token TOKEN or the "
                     f"environment variable {TOKEN_ENV}; without one anyone who reaches the port could reconfigure "
                     "the server")
    bounds = config_bounds(args.max_queue)
    for option, name, value in [("--max-batch-size", "max_batch_size", args.max_batch_size),
                                ("--batch-wait-ms", "batch_wait_timeout_s", args.batch_wait_ms / 1e3),
                                ("--workers", "workers", args.workers),
                                ("--intra-op-threads", "intra_op_threads", args.intra_op_threads)]:
        _, high, why = bounds[name]
        if value > high:
            shown = f"{high * 1e3:g}" if option == "--batch-wait-ms" else f"{high}"
            parser.error(f"{option} must be at most {shown} ({why})")


def stage(message: str) -> None:
    """One start-up stage on stderr."""
    print(f"qcoll-serve: {message}", file=sys.stderr, flush=True)


def _describe(path: str) -> str:
    try:
        return f"{path} ({os.path.getsize(path):,} bytes)"
    except OSError:
        return path


def build_server(args) -> Server:
    t0 = time.monotonic()
    stage(f"loading the model: {_describe(args.model_file)}" + (f" with config {args.config}" if args.config else ""))
    runner = load_runner(args.model_file, args.config)
    stage(f"model loaded in {time.monotonic() - t0:.1f} s: {type(runner).__name__}, vocabulary {runner.vocab_size}, "
          f"{runner.max_positions} positions")
    config = BatchConfig(args.max_batch_size, args.batch_wait_ms / 1e3, args.workers, args.intra_op_threads)
    t0 = time.monotonic()
    runner.set_threads(config.intra_op_threads)
    runner.logits([[0]])   # the first forward's one-time costs (allocations, kernels) paid before serving
    stage(f"warm-up: one forward in {time.monotonic() - t0:.2f} s")
    scheduler = None
    if args.tuner != "none":
        space = serve_space(batch_sizes=sorted(set(args.batch_sizes)),
                            timeouts_s=sorted({t / 1e3 for t in args.timeouts_ms}))
        scheduler = SloScheduler(args.slo_ms / 1e3, args.tuner, space=space, start=config,
                                 percentile=args.percentile, window=args.window, seed=args.seed)
    return Server(runner, config, scheduler, max_queue=args.max_queue, slo_s=args.slo_ms / 1e3,
                  max_body=args.max_body, admin=args.admin, admin_token=args.admin_token)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def serve(app, host: str, port: int, admin: str) -> None:
    """uvicorn on ``host:port``; ``listening on ...`` on stderr once the socket is bound."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and self.servers and self.servers[0].sockets:
                bound = self.servers[0].sockets[0].getsockname()[1]
                shown = f"[{host}]" if ":" in host else host
                stage(f"listening on http://{shown}:{bound} (admin API {admin}; Ctrl+C stops)")

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("qcoll-serve: %(message)s"))
    serve_log = logging.getLogger("qcoll.serve")   # the app's lines (a client that hung up) as start-up's
    serve_log.addHandler(handler)
    serve_log.propagate = False
    stage("starting the HTTP server")
    Announcing(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)).run()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        server = build_server(args)
    except Exception as e:   # a model that cannot be served: one line, never a traceback
        print(f"qcoll-serve: {_first_line(e)}" if isinstance(e, (ValueError, TypeError, OSError)) else
              f"qcoll-serve: cannot serve {args.model_file}: {type(e).__name__}: {_first_line(e)}",
              file=sys.stderr, flush=True)
        return 2
    admin = ("on, token required" if args.admin_token else "on") if args.admin else "off (--admin turns it on)"
    serve(build_app(server), args.host, args.port, admin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
