"""Run a benchmark function on N local gloo ranks, or on the ranks torchrun started."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, ranks_per_node, fn, args, addr):
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        fn(args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, args, nproc: int | None, ranks_per_node: int, addr: str = "127.0.0.1") -> None:
    """Call ``fn(args)`` on every rank with the default group initialized.

    Under torchrun (``RANK`` set) the current process is one rank; otherwise
    ``nproc`` workers are spawned on this host.
    """
    if "RANK" in os.environ and nproc is None:
        dist.init_process_group("gloo")
        try:
            fn(args)
        finally:
            dist.destroy_process_group()
        return
    world = nproc or 1
    mp.start_processes(_entry, args=(world, _free_port(), ranks_per_node, fn, args, addr), nprocs=world,
                       start_method="spawn")
