"""``qcoll-bench``: microbenchmarks of qcoll's collectives against the unquantized baseline."""
from __future__ import annotations

import argparse
import json
import sys

import torch.distributed as dist

from . import collectives
from .launch import run_ranks
from .sizes import parse_size


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcoll-bench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collectives", help="sweep message sizes for all-gather, replica gather, reduce-scatter")
    c.add_argument("--nproc", type=_positive, default=None, help="spawn this many local gloo ranks")
    c.add_argument("--ranks-per-node", type=_positive, default=None, help="ranks per (emulated) node")
    c.add_argument("--min", type=parse_size, default=parse_size("1K"), help="smallest buffer (default 1K)")
    c.add_argument("--max", type=parse_size, default=parse_size("1M"), help="largest buffer (default 1M)")
    c.add_argument("--factor", type=_positive, default=2, help="size multiplier between steps (default 2)")
    c.add_argument("--iters", type=_positive, default=10, help="timed iterations per point (median reported)")
    c.add_argument("--warmup", type=int, default=2, help="untimed warm-up iterations")
    c.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4, 2], choices=[8, 6, 4, 2],
                   help="qwZ weight bits to sweep")
    c.add_argument("--grad-bits", type=int, default=4, choices=[8, 6, 4, 2], help="qgZ gradient bits")
    c.add_argument("--chunks", type=_positive, default=4, help="qgZ pipeline chunks for the chunked variant")
    c.add_argument("--json", default=None, help="write all figures to this JSON file")
    return p


def _collectives_rank(args) -> None:
    rows = collectives.run(args)
    if dist.get_rank() == 0:
        print(collectives.format_table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "collectives", "world": dist.get_world_size(),
                           "ranks_per_node": args.ranks_per_node, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.min > args.max:
        parser.error(f"--min ({args.min}) is larger than --max ({args.max})")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    world = args.nproc or 1
    if args.ranks_per_node is None:
        args.ranks_per_node = world
    if world % args.ranks_per_node:
        parser.error(f"--nproc {world} is not divisible by --ranks-per-node {args.ranks_per_node}")
    try:
        run_ranks(_collectives_rank, args, args.nproc, args.ranks_per_node)
    except KeyboardInterrupt:
        print("qcoll-bench: interrupted", file=sys.stderr)
        return 130
    return 0
