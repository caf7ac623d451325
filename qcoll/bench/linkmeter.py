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

import json
import os
import subprocess

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
