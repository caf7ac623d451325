"""``qcoll-bench``: benchmarks of qcoll's collectives against the unquantized baseline.

Each subcommand is a module of :mod:`qcoll.bench` named in :data:`SUBCOMMANDS`
(adding one is a one-line change there). The module exposes::

    register(subparsers) -> argparse.ArgumentParser

which adds its parser (``subparsers.add_parser(name, ...)``), calls
:func:`add_common_options` on it for the shared options if it starts ranks
(``cluster`` has its own, and runs one of those that do), and sets
``func=<callable(args, parser) -> int>`` as a default. ``func`` validates its
arguments (``parser.error`` for a one-line message and exit code 2; start with
:func:`check_common`), runs, and returns the exit code. :func:`main` turns
Ctrl-C into exit code 130, SIGTERM into 143 and a failed rank into 1, after
:mod:`qcoll.bench.ranks` has stopped every worker.

The ``python -m qcoll.bench`` form is the same as the console script.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .. import files
from ..checks import int_option

SUBCOMMANDS = ("collectives", "train", "cluster", "tune", "generate", "rlhf", "serve", "diloco")

PROG = "qcoll-bench"


class ArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit code 2), no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    return int_option(text, 1)


def nonnegative_int(text: str) -> int:
    return int_option(text, 0)


def add_common_options(p: argparse.ArgumentParser, *, iters: int = 10, warmup: int = 2) -> argparse.ArgumentParser:
    """The options every subcommand shares: ranks, output files, iteration counts."""
    g = p.add_argument_group("ranks and output")
    g.add_argument("--nproc", type=positive_int, default=None,
                   help="spawn this many local gloo ranks (default: 1, or the ranks torchrun started)")
    g.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="ranks per (emulated) node (default: all ranks, or LOCAL_WORLD_SIZE under torchrun)")
    g.add_argument("--json", default=None, metavar="FILE", help="write all figures to this JSON file")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot bandwidth vs size per variant (needs matplotlib: pip install 'qcoll[plot]')")
    g.add_argument("--iters", type=positive_int, default=iters,
                   help=f"timed iterations per point, median reported (default {iters})")
    g.add_argument("--warmup", type=nonnegative_int, default=warmup,
                   help=f"untimed warm-up iterations per point (default {warmup})")
    return p


def check_common(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validate the shared options; fills ``args.world`` and ``args.ranks_per_node``; returns the world size.

    Under torchrun (``RANK`` set, no ``--nproc``) the world is ``WORLD_SIZE`` and
    the default ranks per node ``LOCAL_WORLD_SIZE``.
    """
    if args.nproc is None and "RANK" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        default_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    else:
        world = args.nproc or 1
        default_per_node = world
    if args.ranks_per_node is None:
        args.ranks_per_node = default_per_node
    if world % args.ranks_per_node:
        parser.error(f"--nproc {world} is not divisible by --ranks-per-node {args.ranks_per_node}")
    args.world = world
    check_outputs(parser, args)
    return world


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` unless ``--json`` and ``--plot`` (where given) can be written: see :func:`check_output`;
    ``--plot`` also needs matplotlib and a file type it writes. Call it before anything is measured."""
    check_output(parser, "--json", args.json)
    check_output(parser, "--plot", args.plot)
    if args.plot is not None:
        from . import plot

        problem = plot.check(args.plot)
        if problem:
            parser.error(problem)


def check_output(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """``parser.error`` (a one-line message naming ``option`` and ``path``) unless :func:`qcoll.files.write_atomic` can
    write ``path``: its folder exists and takes a new file (tried: a temporary file is created and removed),
    and ``path`` is not a folder. A symlink at ``path`` is fine: it is replaced, never followed. Nothing
    is left behind; ``path`` itself is not touched."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.lexists(folder) else "does not exist"
        parser.error(f"{option} {path}: folder {folder} {what}")
    if os.path.isdir(path) and not os.path.islink(path):
        parser.error(f"{option} {path}: is a folder, not a file")
    try:
        fd, tmp = files.create_temp(folder, files.TEMP_PREFIX, files.TEMP_SUFFIX)
    except OSError as e:
        parser.error(f"{option} {path}: cannot create a file in folder {folder} ({e.strerror or e})")
    os.close(fd)
    os.unlink(tmp)


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` as indented JSON to ``path`` through :func:`qcoll.files.write_atomic` (an interrupted
    run never leaves half a file at ``path``; a symlink there is replaced, never followed)."""
    files.write_atomic(path, lambda f: f.write((json.dumps(doc, indent=1) + "\n").encode()))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Benchmarks of qcoll's collectives against the unquantized baseline.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    p.subcommands = dict(sub.choices)   # command name -> its parser
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    subparser = parser.subcommands[args.command]
    from .ranks import RankFailed, Terminated

    try:
        return int(args.func(args, subparser) or 0)
    except KeyboardInterrupt:
        _stopped("interrupted")
        return 130
    except Terminated:
        _stopped("terminated")
        return 143
    except RankFailed as e:
        _stopped(f"rank {e.rank} failed:\n{e.detail}")
        return 1


def _stopped(message: str) -> None:
    from .progress import wanted

    # a stopped rank 0 cannot erase its progress bar: start on a fresh line if one may be on screen
    print(("\n" if wanted(sys.stderr) else "") + f"{PROG}: {message}", file=sys.stderr, flush=True)
