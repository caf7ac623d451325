"""Cross-node byte counters of the emulated cluster, readable from inside a rank.

``qcoll-bench cluster`` (:mod:`qcoll.bench.cluster`) tells its ranks where the
counters are through the environment variable ``QCOLL_LINK_METER=<hub namespace>:<nodes>``.
A benchmark that finds it (:meth:`LinkMeter.from_env`) reads the hub-side veth
statistics of every node's link around the region it times, so its figures
carry the bytes that really crossed the node links (frames with their headers,
as a switch port counts them), not only qcoll's own accounting. ``ip -n`` reaches
the hub namespace from any namespace, so no privilege beyond the cluster's own is needed.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist

ENV = "QCOLL_LINK_METER"


def hub_link_stats(hub: str, nodes: int) -> list[dict]:
    """``[{"node", "sent", "received"}]``: bytes each node sent into / got from the switch.

    ``sent`` is the ``rx`` counter of the hub-side veth ``v<node>``, ``received`` its ``tx``.
    Raises ``RuntimeError`` when ``ip`` fails or an interface is missing.
    """
    r = subprocess.run(["ip", "-n", hub, "-s", "-j", "link", "show"], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"`ip -n {hub} -s -j link show` failed: {r.stderr.strip() or r.returncode}")
    by_name = {link["ifname"]: link.get("stats64", link.get("stats", {})) for link in json.loads(r.stdout or "[]")}
    out = []
    for i in range(nodes):
        s = by_name.get(f"v{i}")
        if s is None:
            raise RuntimeError(f"interface v{i} is missing in network namespace {hub}")
        out.append({"node": i, "sent": int(s["rx"]["bytes"]), "received": int(s["tx"]["bytes"])})
    return out


class LinkMeter:
    """Total bytes sent across all node links of one emulated cluster (:func:`hub_link_stats`)."""

    def __init__(self, hub: str, nodes: int):
        self.hub = hub
        self.nodes = nodes

    @classmethod
    def from_env(cls) -> "LinkMeter | None":
        """The meter named by ``QCOLL_LINK_METER``, or ``None`` outside an emulated cluster."""
        spec = os.environ.get(ENV)
        if not spec:
            return None
        hub, _, nodes = spec.rpartition(":")
        if not hub or not nodes.isdigit():
            raise ValueError(f"{ENV} must be '<hub namespace>:<nodes>', got {spec!r}")
        return cls(hub, int(nodes))

    def env_value(self) -> str:
        return f"{self.hub}:{self.nodes}"

    def read(self) -> int:
        """Bytes all nodes have sent across their links so far."""
        return sum(s["sent"] for s in hub_link_stats(self.hub, self.nodes))


class LinkWindow:
    """Rank 0's reading of the node links' byte counters around a window (None outside a cluster).

    A barrier first lets what earlier collectives still had on the wire arrive (a rank leaves
    a collective once its own part is done, while a peer's data may still queue at a shaped
    link); the counters are then read before the barrier that opens the window and after the
    one that closes it, so nothing of the window escapes; the two barriers' own bytes,
    measured alone once, are subtracted. TCP acknowledgements that trail a window by a few
    milliseconds may still land in the next one (tens of bytes)."""

    def __init__(self, rank: int):
        self.meter = LinkMeter.from_env() if rank == 0 else None
        self.overhead = 0
        dist.barrier()
        start = self.meter.read() if self.meter is not None else None
        dist.barrier()
        dist.barrier()
        if self.meter is not None:
            self.overhead = self.meter.read() - start

    @contextlib.contextmanager
    def window(self):
        box = {"bytes": None, "seconds": None}
        dist.barrier()   # earlier traffic has arrived
        start = self.meter.read() if self.meter is not None else None
        dist.barrier()
        t0 = time.perf_counter()
        yield box
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.barrier()
        if self.meter is not None:
            box["bytes"] = self.meter.read() - start - self.overhead
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)   # the slowest rank's
        box["seconds"] = float(seconds)


def summed(values: list[int]) -> list[int]:
    """``values`` summed element-wise over the ranks (a collective)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]
