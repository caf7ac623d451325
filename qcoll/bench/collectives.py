"""``qcoll-bench collectives``: baseline vs quantized all-gather, replica gather, reduce-scatter.

For every message size of the sweep (``--min``, ``--max``, ``--factor``) it runs:

- ``all_gather``: ``fp32`` and ``bf16`` (unquantized ``all_gather_into_tensor``),
  ``qwZ<b>`` for each ``--bits`` (block 256);
- ``replica_gather``: ``hpZ8``, the node-local backward gather of the secondary
  shard that a ``qwZ8`` forward gather kept;
- ``reduce_scatter``: ``fp32`` and ``bf16`` (``reduce_scatter_tensor``), ``qgZ<b>``
  (``--grad-bits``, block 128) unchunked and ``qgZ<b>x<k>`` with ``--chunks k``.

Each point runs ``--warmup`` untimed iterations, then ``--iters`` timed ones (a
barrier before each); a rank's time is the median of its iterations, the row's
time the maximum of those medians over ranks.

``--header-cost`` adds, after each quantized variant, the same call with the frame
headers off (variant ``<name>-raw``; :func:`qcoll.comm.framing.disabled`: no header
sent, nothing checked on receipt), its iterations alternating with the framed
variant's, so the two rows compare the header's cost in bytes and time in one run.

JSON schema (``--json FILE``)::

    {"schema": "qcoll-bench.collectives/1", "command": "collectives",
     "world": int, "ranks_per_node": int, "num_nodes": int, "backend": "gloo",
     "torch": str, "args": {min, max, factor, iters, warmup, bits, grad_bits, chunks, header_cost},
     "columns": [...COLUMNS...], "rows": [{column: value, ...}, ...]}

Row keys (:data:`COLUMNS`):

- ``op``, ``variant``; ``bits`` and ``block_size`` (null for the unquantized baselines);
- ``size``: bytes of the fp32 tensor (the all-gather output, the reduce-scatter
  input; nccl-tests' size), the same for every variant of a point so rows
  compare at equal size; ``count``: its elements (``size = 4 * count``);
  ``type``: the dtype the caller passes and gets back;
- ``time_us``: the time described above; ``algbw_GBs = size / time`` (for bf16 and the
  quantized variants the effective bandwidth of delivering the fp32-sized tensor);
  ``busbw_GBs = algbw * (g - 1) / g`` with ``g`` the group size (world; ranks per
  node for ``replica_gather``), as nccl-tests does for all-gather and reduce-scatter;
- ``wire_bytes``: bytes this rank hands to other ranks in one call
  (``intra_bytes + inter_bytes``, :mod:`qcoll.comm.stats`), of which ``header_bytes``
  are frame headers (docs/FORMAT.md "Frames"; 0 unquantized and ``-raw``); ``ratio_vs_fp32``:
  ``wire_bytes`` over the same op's fp32 baseline (the fp32 all-gather for ``replica_gather``);
- ``max_err``, ``mean_err``: max and mean of ``|out - ref|`` over all ranks'
  outputs, divided by ``max |ref|`` over all ranks, where ``ref`` is the fp32
  baseline's output (0 for the baselines themselves).

Inputs are ``torch.randn`` from :func:`gather_shard` and :func:`reduce_input`
(seeded by rank), so a test can rebuild them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from .. import comm
from ..comm import framing, stats
from ..quant import DEFAULT_GRAD_BLOCK, DEFAULT_WEIGHT_BLOCK, VALID_BITS
from . import breakeven, cli, linkmeter
from .ranks import run_ranks
from . import progress as progress_bar
from .sizes import format_size, parse_size, sweep

NAME = "collectives"
SCHEMA = "qcoll-bench.collectives/1"
COLUMNS = ("op", "variant", "bits", "block_size", "size", "count", "type", "time_us", "algbw_GBs", "busbw_GBs",
           "wire_bytes", "intra_bytes", "inter_bytes", "header_bytes", "ratio_vs_fp32", "max_err", "mean_err")
BITS = tuple(sorted(VALID_BITS, reverse=True))
HPZ_BITS = 8


# ---------------------------------------------------------------- command line

def register(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser(NAME, help="sweep message sizes for all-gather, replica gather, reduce-scatter",
                              description="Baseline vs quantized all-gather (fp32, bf16, qwZ), replica gather "
                                          "(hpZ) and reduce-scatter (fp32, bf16, qgZ unchunked and chunked) over a "
                                          "sweep of message sizes.",
                              epilog="Sizes take K, M, G suffixes (powers of 1024). The JSON schema is documented "
                                     "in the qcoll.bench.collectives module docstring.")
    # --min-size/--max-size: aliases that survive torchrun, whose own parser takes --max for --max-restarts
    c.add_argument("--min", "--min-size", dest="min", type=parse_size, metavar="SIZE", default=parse_size("1K"),
                   help="smallest size (default 1K)")
    c.add_argument("--max", "--max-size", dest="max", type=parse_size, metavar="SIZE", default=parse_size("1M"),
                   help="largest size (default 1M)")
    c.add_argument("--factor", type=cli.positive_int, default=2, help="size multiplier between points (default 2)")
    c.add_argument("--bits", type=int, nargs="+", default=list(BITS), choices=BITS, metavar="B",
                   help="qwZ weight bits to sweep, of 8 6 4 2 (default all)")
    c.add_argument("--grad-bits", type=int, default=4, choices=BITS, metavar="B", help="qgZ gradient bits (default 4)")
    c.add_argument("--chunks", type=cli.positive_int, default=4,
                   help="qgZ pipeline chunks of the chunked variant (default 4)")
    c.add_argument("--header-cost", action="store_true",
                   help="also time every quantized variant with its frame headers off (rows <variant>-raw), "
                        "alternating iterations with the framed one")
    cli.add_common_options(c)
    c.set_defaults(func=main)
    return c


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    world = cli.check_common(parser, args)
    if args.min > args.max:
        parser.error(f"--min ({format_size(args.min)}) is larger than --max ({format_size(args.max)})")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.min < 4 * world:
        parser.error(f"--min {format_size(args.min)} is below one fp32 element per rank ({4 * world} bytes "
                     f"for {world} ranks)")
    args.bits = list(dict.fromkeys(args.bits))
    with progress_bar.starting(NAME, world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


def _rank_main(args) -> None:
    rows = run(args)
    if dist.get_rank() != 0:
        return
    print(breakeven.LEGEND, flush=True)
    print(format_table(rows), flush=True)
    print(breakeven.format_summary(rows, on_cluster=bool(os.environ.get(linkmeter.ENV))), flush=True)
    world = dist.get_world_size()
    if args.json:
        cli.write_json(args.json, {
            "schema": SCHEMA, "command": NAME, "world": world, "ranks_per_node": args.ranks_per_node,
            "num_nodes": world // args.ranks_per_node, "backend": dist.get_backend(), "torch": torch.__version__,
            "args": {k: getattr(args, k) for k in ("min", "max", "factor", "iters", "warmup", "bits", "grad_bits",
                                                    "chunks", "header_cost")},
            "columns": list(COLUMNS), "rows": rows})
    if args.plot:
        from . import plot

        plot.bandwidth(rows, args.plot, title=f"qcoll-bench collectives: {world} ranks, "
                                              f"{args.ranks_per_node} per node, {dist.get_backend()}")


# ---------------------------------------------------------------- measurement

def gather_shard(rank: int, n: int) -> torch.Tensor:
    """The all-gather input of ``rank`` (``n`` fp32 elements)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(rank))


def reduce_input(rank: int, world: int, slice_len: int) -> torch.Tensor:
    """The reduce-scatter input of ``rank`` (``world * slice_len`` fp32 elements)."""
    return torch.randn(world * slice_len, generator=torch.Generator().manual_seed(100 + rank))


def _time(fn, warmup: int, iters: int) -> float:
    """Max over ranks of the median seconds of ``fn`` over ``iters`` runs (a barrier before each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _time_pair(fa, fb, warmup: int, iters: int) -> tuple[float, float]:
    """:func:`_time` of ``fa`` and ``fb`` with their iterations alternating (drift hits both alike)."""
    for _ in range(warmup):
        fa()
        fb()
    times = ([], [])
    for _ in range(iters):
        for fn, acc in ((fa, times[0]), (fb, times[1])):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[0]), statistics.median(times[1])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def _wire(fn) -> tuple[int, int, int]:
    """(intra, inter, header) bytes this rank hands to others in one call of ``fn``."""
    stats.reset()
    fn()
    return stats.stats.intra_bytes, stats.stats.inter_bytes, stats.stats.header_bytes


def unframed(fn):
    """``fn`` run with the frame headers off (the ``-raw`` variants)."""
    def call():
        with framing.disabled():
            return fn()
    return call


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max and mean of |got - ref| over all ranks, divided by max|ref| over all ranks."""
    diff = (got.double() - ref.double()).abs()
    hi = torch.tensor([float(diff.max()), float(ref.abs().max())], dtype=torch.float64)
    total = torch.tensor([float(diff.sum()), float(diff.numel())], dtype=torch.float64)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    denom = float(hi[1]) or 1.0
    return float(hi[0]) / denom, float(total[0]) / float(total[1]) / denom


class _Point:
    """One sweep point: measures variants and builds their rows."""

    def __init__(self, args, topo, size: int, progress):
        self.args, self.topo, self.progress = args, topo, progress
        self.world = topo.world_size
        self.n = size // (4 * self.world)           # elements per shard (all-gather) / slice (reduce-scatter)
        self.count = self.n * self.world
        self.size = 4 * self.count
        self.base_wire = 0

    def measure(self, op, variant, fn, out=None, ref=None, *, dtype=torch.float32, bits=None, block_size=None,
                group_size=None, raw=None) -> list[dict]:
        """The row of ``fn``; with ``--header-cost`` and a ``raw`` twin (``fn`` without frame
        headers), its ``-raw`` row too, timed alternately with ``fn``."""
        self.progress.set_postfix_str(f"{format_size(self.size)} {op} {variant}", refresh=False)
        self.progress.update(0)                    # redraw (after the bar's delay) with the variant now running
        variants = [(variant, fn)]
        if raw is not None and self.args.header_cost:
            variants.append((f"{variant}-raw", raw))
        measured = []
        for name, f in variants:
            intra, inter, header = _wire(f)            # also the first call: fills ``out``
            if name == "fp32":
                self.base_wire = intra + inter
            measured.append((name, intra, inter, header, _errors(out, ref) if ref is not None else (0.0, 0.0)))
        if len(variants) == 1:
            seconds = (_time(fn, self.args.warmup, self.args.iters),)
        else:
            seconds = _time_pair(fn, raw, self.args.warmup, self.args.iters)
        self.progress.update(step_weight(self.size) * len(variants))
        g = group_size or self.world
        return [self._row(op, m, sec, g, dtype, bits, block_size) for m, sec in zip(measured, seconds)]

    def _row(self, op, measured, seconds, g, dtype, bits, block_size) -> dict:
        variant, intra, inter, header, (max_err, mean_err) = measured
        wire = intra + inter
        algbw = self.size / seconds / 1e9
        return {"op": op, "variant": variant, "bits": bits, "block_size": block_size, "size": self.size,
                "count": self.count, "type": str(dtype).removeprefix("torch."), "time_us": seconds * 1e6,
                "algbw_GBs": algbw, "busbw_GBs": algbw * (g - 1) / g, "wire_bytes": wire, "intra_bytes": intra,
                "inter_bytes": inter, "header_bytes": header,
                "ratio_vs_fp32": wire / self.base_wire if self.base_wire else 0.0, "max_err": max_err,
                "mean_err": mean_err}

    def gather_rows(self) -> list[dict]:
        n, W, B = self.n, self.world, DEFAULT_WEIGHT_BLOCK
        shard = gather_shard(self.topo.rank, n)
        ref = torch.empty(W * n)
        rows = self.measure("all_gather", "fp32", lambda: comm.all_gather_quantized(ref, shard, bits=None))
        sb, ob = shard.bfloat16(), torch.empty(W * n, dtype=torch.bfloat16)
        rows += self.measure("all_gather", "bf16", lambda: comm.all_gather_quantized(ob, sb, bits=None),
                             ob, ref, dtype=torch.bfloat16)
        for b in self.args.bits:
            out = torch.empty(W * n)
            fn = lambda b=b, out=out: comm.all_gather_quantized(out, shard, bits=b, block_size=B)  # noqa: E731
            rows += self.measure("all_gather", f"qwZ{b}", fn, out, ref, bits=b, block_size=B, raw=unframed(fn))

        def keep():
            gathered = comm.all_gather_quantized(torch.empty(W * n), shard, bits=HPZ_BITS, block_size=B)
            return comm.SecondaryShard.keep(gathered, self.topo)
        sec = keep()
        sec_raw = unframed(keep)()   # a raw replica gather needs a secondary kept without headers
        out = torch.empty(W * n)   # ratio_vs_fp32 stays relative to the fp32 all-gather
        rows += self.measure("replica_gather", f"hpZ{HPZ_BITS}", lambda: comm.replica_gather(out, sec), out, ref,
                             bits=HPZ_BITS, block_size=B, group_size=self.topo.ranks_per_node,
                             raw=unframed(lambda: comm.replica_gather(out, sec_raw)))
        return rows

    def reduce_rows(self) -> list[dict]:
        S, W, B, gb = self.n, self.world, DEFAULT_GRAD_BLOCK, self.args.grad_bits
        full = reduce_input(self.topo.rank, W, S)
        ref = torch.empty(S)
        topo = self.topo
        rows = self.measure("reduce_scatter", "fp32",
                            lambda: comm.reduce_scatter_quantized(ref, full, bits=None, topology=topo))
        fb, ob = full.bfloat16(), torch.empty(S, dtype=torch.bfloat16)
        rows += self.measure("reduce_scatter", "bf16",
                             lambda: comm.reduce_scatter_quantized(ob, fb, bits=None, topology=topo),
                             ob, ref, dtype=torch.bfloat16)
        for c in sorted({1, self.args.chunks}):
            out = torch.empty(S)
            fn = lambda c=c, out=out: comm.reduce_scatter_quantized(  # noqa: E731
                out, full, bits=gb, block_size=B, topology=topo, num_chunks=c)
            rows += self.measure("reduce_scatter", f"qgZ{gb}" + (f"x{c}" if c > 1 else ""), fn, out, ref,
                                 bits=gb, block_size=B, raw=unframed(fn))
        return rows


def variants_per_point(args) -> int:
    quantized = len(args.bits) + 1 + len({1, args.chunks})
    return 2 + 2 + quantized * (2 if args.header_cost else 1)   # fp32 and bf16 baselines of both ops


def step_weight(size: int) -> float:
    """Progress weight of one variant at ``size``: bytes plus a fixed per-call latency floor."""
    return size + 64 * 1024


def run(args) -> list[dict]:
    """Run the sweep on this rank (all ranks together); returns the rows (the same on every rank)."""
    topo = comm.Topology(args.ranks_per_node)
    sizes = sweep(args.min, args.max, args.factor)
    total = sum(step_weight(4 * (s // (4 * topo.world_size)) * topo.world_size) for s in sizes)
    rows = []
    # rank 0's progress: a bar on a terminal, plain lines elsewhere (qcoll.bench.progress.sweep)
    with progress_bar.sweep(total * variants_per_point(args), NAME, enabled=topo.rank == 0) as progress:
        for size in sizes:
            point = _Point(args, topo, size, progress)
            rows += point.gather_rows()
            rows += point.reduce_rows()
    return rows


def format_table(rows: list[dict]) -> str:
    """nccl-tests-like table: size, count, type, time, algbw, busbw, then bytes and errors."""
    head = (f"{'op':>14} {'variant':>10} {'size':>7} {'count':>10} {'type':>8} {'time(us)':>10} {'algbw':>8} "
            f"{'busbw':>8} {'wire(B)':>11} {'hdr(B)':>6} {'ratio':>6} {'max_err':>9} {'mean_err':>9}")
    units = (f"{'':>14} {'':>10} {'(B)':>7} {'(elems)':>10} {'':>8} {'':>10} {'(GB/s)':>8} {'(GB/s)':>8} "
             f"{'':>11} {'':>6} {'vs fp32':>6} {'rel':>9} {'rel':>9}")
    lines = [head, units]
    for r in rows:
        lines.append(f"{r['op']:>14} {r['variant']:>10} {format_size(r['size']):>7} {r['count']:>10} {r['type']:>8} "
                     f"{r['time_us']:>10.1f} {r['algbw_GBs']:>8.3f} {r['busbw_GBs']:>8.3f} {r['wire_bytes']:>11} "
                     f"{r['header_bytes']:>6} {r['ratio_vs_fp32']:>6.3f} {r['max_err']:>9.2e} {r['mean_err']:>9.2e}")
    return "\n".join(lines)
