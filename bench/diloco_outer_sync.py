"""DiLoCo's outer sync through torchft: fp32 (torchft's ProcessGroupGloo) against qcoll's
QuantizedProcessGroup at 4 and 2 bits, with and without error feedback. The measure is the
final held-out loss at a fixed token budget (the last 10% of the text, which no step trains on),
and the outer bytes each replica sends.

Two replica groups of one rank each (processes), torchft's in-process lighthouse, the char
transformer of qcoll.testing (4 blocks, d=128), AdamW 2e-3 inside with 8 x 64 tokens per replica
per step, SGD lr 0.7 Nesterov 0.9 outside, H inner steps per sync.

    python bench/diloco_outer_sync.py --steps 100 --sync-every 10 --seeds 0 1 2 --out bench/diloco_outer_sync.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback
from datetime import timedelta

import torch

MODES = {"fp32": None, "q4": (4, False), "q4-ef": (4, True), "q2": (2, False), "q2-ef": (2, True)}
BATCH, CONTEXT, HELD_OUT_BATCHES = 8, 64, 16


def _split():
    from qcoll.testing.data import corpus
    text = corpus()
    cut = int(text.numel() * 0.9)
    return text[:cut], text[cut:]


def _held_out_loss(model, held_out) -> float:
    from qcoll.testing.data import Batches
    batches = Batches(held_out, BATCH, CONTEXT, seed=12345)
    with torch.no_grad():
        return statistics.fmean(model(*batches.next()).item() for _ in range(HELD_OUT_BATCHES))


def replica(replica_id: int, lighthouse: str, mode: str, seed: int, steps: int, sync_every: int,
            block_size: int) -> dict:
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    import qcoll
    from qcoll.integrations.torchft import QuantizedProcessGroup
    from qcoll.testing.data import Batches
    from qcoll.testing.models import char_transformer

    torch.set_num_threads(1)
    train, held_out = _split()
    model = char_transformer(seed=seed)
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    setting = MODES[mode]
    pg = (ProcessGroupGloo(timeout=timedelta(seconds=60)) if setting is None else
          QuantizedProcessGroup(bits=setting[0], error_feedback=setting[1], block_size=block_size, timeout=timedelta(seconds=60)))
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=f"replica{replica_id}", store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60))
    if setting is not None:
        pg.attach(manager)
    batches = Batches(train, BATCH * 2, CONTEXT, seed=1000 + seed)
    qcoll.stats.reset()
    t0 = time.perf_counter()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=sync_every) as diloco:
            for _ in range(steps):
                x, y = batches.next(replica_id, 2)
                loss = model(x, y)
                inner.zero_grad()
                loss.backward()
                inner.step()
            anchor = diloco._fragments[0].original_parameters
            model.load_state_dict({k: v for k, v in anchor.items()}, strict=False)   # the global model
        wall = time.perf_counter() - t0
        numel = sum(p.numel() for p in model.parameters())
        syncs = manager.current_step()
        outer_bytes = (qcoll.stats.stats.total_inter_bytes if setting is not None
                       else syncs * numel * 4)   # a 2-replica ring all-reduce sends the tensor once
        return {"held_out": _held_out_loss(model, held_out), "wall_s": wall, "syncs": syncs,
                "outer_bytes": outer_bytes, "residual_bytes": getattr(pg, "residual_bytes", 0), "numel": numel}
    finally:
        manager.shutdown(wait=False)


def _child(args, out):
    try:
        out.put(("ok", replica(*args)))
    except BaseException:
        out.put(("error", traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)


def run(mode: str, seed: int, steps: int, sync_every: int, block_size: int) -> list[dict]:
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_child, args=((r, lighthouse.address(), mode, seed, steps, sync_every, block_size),
                                                      queues[r]))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = []
        for q in queues:
            status, value = q.get(timeout=1800)
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--block-size", type=int, default=128, help="elements per fp32 scale (qcoll modes)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import logging
    logging.disable(logging.INFO)
    rows = {}
    for mode in args.modes:
        for seed in args.seeds:
            r = run(mode, seed, args.steps, args.sync_every, args.block_size)
            assert abs(r[0]["held_out"] - r[1]["held_out"]) < 1e-4, r   # both replicas hold the same global model
            rows.setdefault(mode, []).append(r[0])
            print(f"{mode:6s} seed {seed}: held-out {r[0]['held_out']:.4f}  outer bytes {r[0]['outer_bytes']:,}  "
                  f"wall {r[0]['wall_s']:.1f} s", flush=True)
    base = statistics.fmean(x["outer_bytes"] for x in rows.get("fp32", rows[args.modes[0]]))
    print(f"\n| outer sync | held-out loss (mean of {len(args.seeds)} seeds) | spread (min-max) | outer bytes / fp32 |"
          f" residual bytes per rank |\n|---|---|---|---|---|")
    for mode, xs in rows.items():
        losses = [x["held_out"] for x in xs]
        print(f"| {mode} | {statistics.fmean(losses):.4f} | {min(losses):.4f}-{max(losses):.4f} | "
              f"{statistics.fmean(x['outer_bytes'] for x in xs) / base:.4f} | {xs[0]['residual_bytes']:,} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
