"""The ``collectives`` sweep: baseline vs quantized all-gather, replica gather, reduce-scatter."""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from .. import comm
from ..comm import stats
from .sizes import format_size, sweep

COLUMNS = ("op", "variant", "size", "count", "type", "time_us", "algbw_GBs", "busbw_GBs", "wire_bytes",
           "ratio_vs_fp32", "max_err", "mean_err")


def _time(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (all ranks start together)."""
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


def _wire(fn) -> int:
    stats.reset()
    fn()
    return stats.stats.intra_bytes + stats.stats.inter_bytes


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max and mean of |got - ref| / max|ref| (normalized to the tensor's range)."""
    denom = float(ref.abs().max()) or 1.0
    err = (got.double() - ref.double()).abs() / denom
    return float(err.max()), float(err.mean())


def _row(op, variant, size, count, dtype, seconds, wire, base_wire, errs, world):
    algbw = size / seconds / 1e9
    return {"op": op, "variant": variant, "size": size, "count": count, "type": str(dtype).removeprefix("torch."),
            "time_us": seconds * 1e6, "algbw_GBs": algbw, "busbw_GBs": algbw * (world - 1) / world,
            "wire_bytes": wire, "ratio_vs_fp32": wire / base_wire if base_wire else 0.0,
            "max_err": errs[0], "mean_err": errs[1]}


def _gather_rows(topo, size, world, warmup, iters, bits_list):
    count = size // 4
    n = max(1, count // world)
    g = torch.Generator().manual_seed(topo.rank)
    shard = torch.randn(n, generator=g)
    ref = torch.empty(world * n)
    rows = []
    base = lambda: comm.all_gather_quantized(ref, shard, bits=None)  # noqa: E731
    base_wire = _wire(base)
    rows.append(_row("all_gather", "fp32", size, world * n, torch.float32, _time(base, warmup, iters), base_wire,
                     base_wire, (0.0, 0.0), world))
    sb, ob = shard.bfloat16(), torch.empty(world * n, dtype=torch.bfloat16)
    bf = lambda: comm.all_gather_quantized(ob, sb, bits=None)  # noqa: E731
    rows.append(_row("all_gather", "bf16", size, world * n, torch.bfloat16, _time(bf, warmup, iters), _wire(bf),
                     base_wire, _errors(ob.float(), ref), world))
    for bits in bits_list:
        out = torch.empty(world * n)
        fn = lambda b=bits: comm.all_gather_quantized(out, shard, bits=b)  # noqa: E731
        rows.append(_row("all_gather", f"qwZ{bits}", size, world * n, torch.float32, _time(fn, warmup, iters),
                         _wire(fn), base_wire, _errors(out, ref), world))
    sec = comm.SecondaryShard(topo)
    fwd = torch.empty(world * n)
    comm.all_gather_quantized(fwd, shard, bits=8, secondary=sec)
    out = torch.empty(world * n)
    fn = lambda: comm.replica_gather(out, sec)  # noqa: E731
    rows.append(_row("replica_gather", "hpZ8", size, world * n, torch.float32, _time(fn, warmup, iters), _wire(fn),
                     base_wire, _errors(out, ref), world))
    return rows


def _reduce_rows(topo, size, world, warmup, iters, grad_bits, chunks):
    count = size // 4
    S = max(1, count // world)
    g = torch.Generator().manual_seed(100 + topo.rank)
    full = torch.randn(world * S, generator=g)
    ref = torch.empty(S)
    base = lambda: comm.reduce_scatter_quantized(ref, full, bits=None, topology=topo)  # noqa: E731
    base_wire = _wire(base)
    rows = [_row("reduce_scatter", "fp32", size, world * S, torch.float32, _time(base, warmup, iters), base_wire,
                 base_wire, (0.0, 0.0), world)]
    for c in sorted({1, chunks}):
        out = torch.empty(S)
        fn = lambda c=c: comm.reduce_scatter_quantized(out, full, bits=grad_bits, topology=topo, num_chunks=c)  # noqa
        rows.append(_row("reduce_scatter", f"qgZ{grad_bits}" + (f"x{c}" if c > 1 else ""), size, world * S,
                         torch.float32, _time(fn, warmup, iters), _wire(fn), base_wire, _errors(out, ref), world))
    return rows


def run(args) -> list[dict]:
    """Run the sweep on this rank; rank 0 prints the table and returns the rows."""
    topo = comm.Topology(args.ranks_per_node)
    world = topo.world_size
    sizes = sweep(args.min, args.max, args.factor)
    rows = []
    started = time.monotonic()
    for i, size in enumerate(sizes):
        rows += _gather_rows(topo, size, world, args.warmup, args.iters, args.bits)
        rows += _reduce_rows(topo, size, world, args.warmup, args.iters, args.grad_bits, args.chunks)
        if topo.rank == 0 and time.monotonic() - started > 3:
            print(f"\r[{i + 1}/{len(sizes)}] {format_size(size)}", end="", file=sys.stderr, flush=True)
    if topo.rank == 0 and time.monotonic() - started > 3:
        print(file=sys.stderr)
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'op':>15} {'variant':>8} {'size':>7} {'count':>10} {'type':>8} {'time(us)':>10} {'algbw':>8} " \
           f"{'busbw':>8} {'wire(B)':>11} {'ratio':>6} {'max_err':>9} {'mean_err':>9}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['op']:>15} {r['variant']:>8} {format_size(r['size']):>7} {r['count']:>10} {r['type']:>8} "
                     f"{r['time_us']:>10.1f} {r['algbw_GBs']:>8.3f} {r['busbw_GBs']:>8.3f} {r['wire_bytes']:>11} "
                     f"{r['ratio_vs_fp32']:>6.3f} {r['max_err']:>9.2e} {r['mean_err']:>9.2e}")
    return "\n".join(lines)
