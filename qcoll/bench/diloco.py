"""``qcoll-bench diloco``: time to a held-out loss for low-communication training (torchft's DiLoCo)
and for synchronous FSDP2 / HSDP, each emulated node one replica group.

DiLoCo modes: every node is a torchft replica group (FSDP2 over its ranks when it has several),
trains alone for ``--sync-every`` (H) steps, then the groups average their pseudo-gradients and an
outer SGD (lr 0.7, Nesterov momentum 0.9) applies the average. The outer all-reduce is torchft's
own ``ProcessGroupGloo`` (``diloco``, fp32, as users run it on CPU; ``diloco-bf16``: the same
all-reduce on a bf16 copy of the pseudo-gradients, the cheap outer sync a user tries first) or qcoll's
``QuantizedProcessGroup`` (``diloco-q4``; ``diloco-q2``; ``diloco-q2-ef``: 2 bits with error
feedback). ``--fragments F --fragment-delay D``: Streaming DiLoCo (F fragments, each synced D
steps after it was sent, so the sync overlaps compute). Synchronous modes: ``hsdp-bf16`` and
``fsdp2-bf16`` (the peers as users configure them; ``hsdp`` / ``fsdp2`` in fp32 for CPUs without
bf16 arithmetic, where bf16 compute is emulated and slow), ``hsdp-qcoll`` and ``fsdp2-qcoll``
(qcoll's comms inside FSDP2).

The measure: every mode trains the same token budget (``--steps`` x ``--batch`` x 64 tokens) on the
first 90% of the text; the last 10% is held out (no step trains on it). The held-out loss is
measured every ``--eval-every`` steps (DiLoCo: at each outer sync, on the global model), the
clock stopped meanwhile; reported: the training time until it first reaches ``--target``, the
final held-out loss, outer (cross-node) bytes per rank and memory per rank. Run it under
``qcoll-bench cluster`` for the link rates::

    qcoll-bench cluster --nodes 2 --ranks-per-node 2 --link 20mbit unlimited -- \\
        diloco --modes diloco diloco-q2-ef hsdp-bf16 --sync-every 10 50 --steps 100

Needs the torchft extra for the DiLoCo modes (``pip install 'qcoll[torchft]'``).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import cli, progress
from .ranks import run_ranks

NAME = "diloco"
OUTER = {"diloco": None, "diloco-bf16": "bf16", "diloco-q4": (4, False), "diloco-q2": (2, False),
         "diloco-q2-ef": (2, True)}
SYNC = {m: m for m in ("hsdp-bf16", "fsdp2-bf16", "hsdp", "fsdp2", "hsdp-qcoll", "fsdp2-qcoll")}
MODES = (*OUTER, *SYNC)
HELD_OUT_BATCHES = 4
PORT_OFFSET = 200     # the lighthouse and the replica groups' stores: MASTER_PORT + 200 + ...


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="time to a held-out loss: torchft DiLoCo (fp32 or qcoll outer sync) "
                                         "against synchronous FSDP2 / HSDP", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["diloco", "diloco-q2-ef", "hsdp-bf16"], choices=MODES,
                   metavar="MODE", help=f"of {' '.join(MODES)}")
    p.add_argument("--sync-every", type=cli.positive_int, nargs="+", default=[10], metavar="H",
                   help="DiLoCo's inner steps per outer sync; each DiLoCo mode runs at each H (default 10)")
    p.add_argument("--fragments", type=cli.positive_int, default=1, help="Streaming DiLoCo's fragments (default 1)")
    p.add_argument("--fragment-delay", type=cli.nonnegative_int, default=0,
                   help="steps between sending a fragment and applying it (default 0)")
    p.add_argument("--bucket-mb", type=float, default=0.0,
                   help="torchft's bucketization: the outer all-reduce in flat buffers of this many MB "
                        "(default 0: one all-reduce per parameter, torchft's default)")
    p.add_argument("--steps", type=cli.positive_int, default=100, help="steps (the token budget) per mode")
    p.add_argument("--batch", type=cli.positive_int, default=16, help="global batch, sequences of 64 bytes")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate (inner, or the only one)")
    p.add_argument("--target", type=float, default=3.0, help="held-out loss to reach (default 3.0)")
    p.add_argument("--eval-every", type=cli.positive_int, default=10,
                   help="steps between held-out losses of the synchronous modes (DiLoCo: each sync)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    cli.add_common_options(p, iters=1, warmup=3)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    world = cli.check_common(parser, args)
    if any(m in OUTER for m in args.modes):
        try:
            import torchft  # noqa: F401
        except ImportError:
            parser.error("the DiLoCo modes need torchft: pip install 'qcoll[torchft]'")
    if args.batch % world:
        parser.error(f"--batch {args.batch} is not divisible by the {world} ranks")
    for h in args.sync_every:
        if h % args.fragments or args.fragment_delay >= h // args.fragments:
            parser.error(f"--sync-every {h} must be a multiple of --fragments {args.fragments}, with "
                         f"--fragment-delay below {h // args.fragments}")
    with progress.starting(NAME, world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


# ---------------------------------------------------------------------------- data and evaluation

def _texts():
    from ..testing.data import corpus
    text = corpus()
    cut = int(text.numel() * 0.9)
    return text[:cut], text[cut:]


def _held_out(model, held_out, batch: int) -> float:
    """The mean loss over fixed held-out batches (every rank of a group evaluates the same rows)."""
    from ..testing.data import Batches
    batches = Batches(held_out, batch, 64, seed=4242)
    with torch.no_grad():
        return statistics.fmean(model(*batches.next()).item() for _ in range(HELD_OUT_BATCHES))


class _Clock:
    """Training seconds (evaluation excluded) and the first time the held-out loss reached the target."""

    def __init__(self, target: float):
        self.target, self.elapsed, self.started = target, 0.0, None
        self.reached_s, self.reached_step, self.curve = None, None, []

    def start(self):
        self.started = time.perf_counter()

    def stop(self):
        self.elapsed += time.perf_counter() - self.started

    def record(self, step: int, loss: float):
        self.curve.append((step, self.elapsed, loss))
        if self.reached_s is None and loss <= self.target:
            self.reached_s, self.reached_step = self.elapsed, step


# ---------------------------------------------------------------------------- the runs

def _local_address() -> str:
    """This rank's address as the other nodes reach it (the interface towards MASTER_ADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
        return s.getsockname()[0]


def _model(args, topo, mode):
    from ..testing.fsdp2 import shard_fsdp2
    from ..testing.models import char_transformer
    from torch.distributed.device_mesh import init_device_mesh

    model = char_transformer(seed=args.seed)
    if mode in SYNC:
        from . import fsdp_runs
        return fsdp_runs.build(args, SYNC[mode], topo, model)
    if topo.ranks_per_node > 1:   # FSDP2 inside the node, the replica group
        mesh = init_device_mesh("cpu", (topo.num_nodes, topo.ranks_per_node), mesh_dim_names=("replica", "shard"))
        shard_fsdp2(model, model.blocks, mesh["shard"])
    return model


def _diloco(args, topo, mode: str, H: int, index: int, model, opt, clock, train, held):
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from ..integrations.torchft import QuantizedProcessGroup

    base = int(os.environ.get("MASTER_PORT", "29500")) + PORT_OFFSET + 10 * index
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    lighthouse = LighthouseServer(bind=f"[::]:{base}", min_replicas=topo.num_nodes) if topo.rank == 0 else None
    store = (dist.TCPStore("0.0.0.0", base + 1 + topo.node, is_master=True, wait_for_workers=False)
             if topo.local_rank == 0 else None)
    dist.barrier()
    setting = OUTER[mode]
    if setting is None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=300))
    elif setting == "bf16":
        from .diloco_bf16 import Bf16OuterGroup
        pg = Bf16OuterGroup(timeout=timedelta(seconds=300))
    else:
        pg = QuantizedProcessGroup(bits=setting[0], error_feedback=setting[1], timeout=timedelta(seconds=300))
    addr = _local_address()
    manager = Manager(pg=pg, min_replica_size=topo.num_nodes, load_state_dict=None, state_dict=None,
                      replica_id=f"node{topo.node}", store_addr=addr, store_port=base + 1 + topo.node,
                      rank=topo.local_rank, world_size=topo.ranks_per_node, lighthouse_addr=f"http://{master}:{base}",
                      hostname=addr, use_async_quorum=False, init_sync=False, timeout=timedelta(seconds=300),
                      quorum_timeout=timedelta(seconds=300))
    if isinstance(pg, QuantizedProcessGroup):
        pg.attach(manager, fragments=args.fragments)
    fragments = ([model] if args.fragments == 1 else
                 [torch.nn.ModuleList(list(model.blocks)[i::args.fragments]) for i in range(args.fragments)])
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    try:
        with DiLoCo(manager, fragments, opt, outer if len(outer) > 1 else outer[0], sync_every=H,
                    fragment_sync_delay=args.fragment_delay, use_bucketization=args.bucket_mb > 0,
                    bucket_cap_mb=args.bucket_mb if args.bucket_mb > 0 else None) as diloco:
            synced = [0]

            def after_sync(step: int) -> bool:   # the global model: right after each outer sync
                if manager.current_step() == synced[0]:
                    return False
                synced[0] = manager.current_step()
                return True
            _train(args, topo, model, opt, clock, train, held, after_sync)
            extra = sum(t.numel() * t.element_size() for f in diloco._fragments for t in f.original_parameters.values())
        extra += sum(v.numel() * v.element_size() for o in outer for s in o.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))
        extra += getattr(pg, "residual_bytes", 0)
        return manager.current_step(), extra
    finally:
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()
        del store


def _train(args, topo, model, opt, clock, train, held, evaluate_after) -> None:
    """``--steps`` timed steps; the held-out loss after each step for which ``evaluate_after(step)``
    holds, the clock stopped meanwhile."""
    clock.start()
    for step in range(1, args.steps + 1):
        x, y = train.next(topo.rank, topo.world_size)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if evaluate_after(step):
            clock.stop()
            clock.record(step, _held_out(model, held, args.batch))
            clock.start()
    clock.stop()


def _run(args, topo, mode: str, H: int | None, index: int) -> dict:
    from ..comm import stats
    from ..testing.data import Batches
    from .fsdp_runs import state_nbytes
    from .linkmeter import LinkWindow

    text, held = _texts()
    train = Batches(text, args.batch, 64, seed=1000 + args.seed)
    model = _model(args, topo, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    clock = _Clock(args.target)
    link = LinkWindow(topo.rank)
    stats.reset()
    inter0 = stats.stats.total_inter_bytes
    syncs, extra = None, 0
    with link.window() as box:
        if mode in OUTER:
            syncs, extra = _diloco(args, topo, mode, H, index, model, opt, clock, train, held)
        else:
            _train(args, topo, model, opt, clock, train, held,
                   lambda step: step % args.eval_every == 0 or step == args.steps)
    link_bytes = box["bytes"]
    numel = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    if mode in SYNC and "qcoll" not in mode:   # FSDP2's own collectives: DESIGN.md's rule (qcoll counts none)
        from ..testing.models import char_transformer
        from .fsdp_runs import rule_bytes
        outer = rule_bytes(args, SYNC[mode], topo, lambda a: char_transformer(seed=a.seed))[1] * args.steps
    elif mode in SYNC:
        outer = stats.stats.total_inter_bytes - inter0
    elif OUTER[mode] in (None, "bf16"):   # gloo's ring all-reduce: 2 (N-1)/N of the local shard per sync
        width = 2 if OUTER[mode] == "bf16" else 4
        outer = syncs * numel * width * 2 * (topo.num_nodes - 1) // topo.num_nodes
    else:
        outer = stats.stats.total_inter_bytes - inter0
    final = clock.curve[-1][2] if clock.curve else None
    dist.barrier()
    label = mode if H is None else (f"{mode} H={H}" + (f" b{args.bucket_mb:g}" if args.bucket_mb else "")
                                    + (f" streaming F={args.fragments} d={args.fragment_delay}" if args.fragments > 1 else ""))
    return {"mode": label, "sync_every": H, "train_s": clock.elapsed,
            "time_to_target_s": clock.reached_s, "step_at_target": clock.reached_step, "final_held_out": final,
            "outer_syncs": syncs, "qcoll_inter_bytes_per_rank": outer, "link_bytes": link_bytes,
            "memory_per_rank": state_nbytes(model, opt) + extra, "curve": clock.curve}


def _rank_main(args) -> None:
    from ..comm import Topology

    import logging
    logging.getLogger("torchft").setLevel(logging.WARNING)
    topo = Topology(args.ranks_per_node)
    torch.manual_seed(args.seed)
    plan = [(m, h) for m in args.modes for h in (args.sync_every if m in OUTER else [None])]
    runs = []
    with progress.Steps(NAME, enabled=topo.rank == 0) as prog:
        if args.warmup:   # untimed: the first run in a process pays for start-up (groups, caches)
            prog.begin("warm-up")
            _run(argparse.Namespace(**{**vars(args), "steps": args.warmup}), topo, plan[0][0], plan[0][1], len(plan))
            prog.end()
        for index, (mode, H) in enumerate(plan):
            prog.begin(mode if H is None else f"{mode} H={H}")
            runs.append(_run(args, topo, mode, H, index))
            prog.end()
    if topo.rank != 0:
        return
    print(format_table(runs, args), flush=True)
    if args.json:
        cli.write_json(args.json, {"command": NAME, "world": topo.world_size, "ranks_per_node": topo.ranks_per_node,
                                   "args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs})


def format_table(runs: list[dict], args) -> str:
    lines = [f"held-out target {args.target}, {args.steps} steps of {args.batch} x 64 tokens",
             f"{'mode':34s} {'train s':>8s} {'to target s':>12s} {'at step':>8s} {'final held-out':>15s} "
             f"{'outer MB/rank':>14s} {'link MB':>8s} {'MiB/rank':>9s}"]
    for r in runs:
        to = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        at = "-" if r["step_at_target"] is None else str(r["step_at_target"])
        link = r["link_bytes"]
        lines.append(f"{r['mode']:34s} {r['train_s']:8.1f} {to:>12s} {at:>8s} {r['final_held_out'] or 0:15.4f} "
                     f"{r['qcoll_inter_bytes_per_rank'] / 1e6:14.2f} "
                     f"{'-' if link is None else f'{link / 1e6:.1f}':>8s} {r['memory_per_rank'] / 2**20:9.1f}")
    return "\n".join(lines)
