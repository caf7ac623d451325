"""``qcoll-serve MODEL_FILE --config CONFIG``: serve an exported quantized model over HTTP (uvicorn).

    qcoll-serve model.safetensors --config config.json --slo-ms 100            # RRL tunes the batching
    qcoll-serve model.onnx --tuner none --max-batch-size 8 --batch-wait-ms 5    # a static configuration
"""
from __future__ import annotations

import argparse
import sys

from ..checks import int_option
from .app import Server, build_app
from .batcher import BatchConfig
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
    p.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
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
    p.add_argument("--window", type=positive_int, default=60, help="requests per measured window (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the tuner's seed (default 0)")
    p.add_argument("--batch-sizes", type=int_list, default=BATCH_SIZES, metavar="N,N,...",
                   help="the tuner's max_batch_size values (default %s)" % ",".join(map(str, BATCH_SIZES)))
    p.add_argument("--timeouts-ms", type=float_list, default=tuple(t * 1e3 for t in TIMEOUTS_S), metavar="MS,MS,...",
                   help="the tuner's batch_wait_timeout values (default %s)" % ",".join(f"{t * 1e3:g}" for t in TIMEOUTS_S))
    return p


def build_server(args) -> Server:
    runner = load_runner(args.model_file, args.config)
    config = BatchConfig(args.max_batch_size, args.batch_wait_ms / 1e3, args.workers, args.intra_op_threads)
    scheduler = None
    if args.tuner != "none":
        space = serve_space(batch_sizes=sorted(set(args.batch_sizes)),
                            timeouts_s=sorted({t / 1e3 for t in args.timeouts_ms}))
        scheduler = SloScheduler(args.slo_ms / 1e3, args.tuner, space=space, start=config,
                                 percentile=args.percentile, window=args.window, seed=args.seed)
    return Server(runner, config, scheduler, max_queue=args.max_queue, slo_s=args.slo_ms / 1e3)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.percentile >= 100:
        parser.error(f"--percentile must be below 100, got {args.percentile:g}")
    try:
        server = build_server(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"qcoll-serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
