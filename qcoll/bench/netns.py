"""Network-namespace plumbing of the emulated cluster (``ip`` and ``tc`` from iproute2).

Topology: a star, as in a real cluster where every node has one NIC on a switch.
One namespace per node with one interface ``eth0`` (address ``10.213.7.<node+1>/24``),
and a hub namespace holding a Linux bridge ``br0`` with one veth peer ``v<node>``
per node. Nothing is created in the caller's namespace, so the host's network is
never touched and the private subnet exists only inside these namespaces.

Rate limits are token buckets (``tbf``) on the egress of *both* ends of every
node's veth: ``eth0`` (node -> switch) and ``v<node>`` (switch -> node), so each
node's link is full duplex at ``rate`` in each direction. ``delay`` adds a
``netem`` qdisc above the node-side ``tbf`` (one-way delay between two nodes =
``delay``, round trip ``2 x delay``); it needs ``sch_netem`` in the kernel.

Byte counters are the hub-side veth statistics: ``rx`` of ``v<node>`` is what
the node sent across its link, ``tx`` what it received. They count whole frames
(Ethernet/IP/TCP headers included, and gloo's and the TCPStore's control traffic).
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess

from ..checks import check_int
from .linkmeter import LinkMeter, hub_link_stats

SUBNET = "10.213.7"          # /24, used only inside the cluster's namespaces
NODE_IFNAME = "eth0"
MAX_NODES = 250

_counter = itertools.count()

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up (not root, iproute2 missing, a command failed)."""


def parse_rate(text: str | None) -> int | None:
    """``'100mbit'`` -> 100_000_000 bits/s (tc units: bit/kbit/mbit/gbit, bps/kbps/... in bytes).

    ``None``, ``''``, ``'unlimited'`` and ``'none'`` mean no limit (``None``).
    Raises ``ValueError`` on anything else.
    """
    if text is None or text.strip().lower() in ("", "unlimited", "none", "inf"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"not a link rate: {text!r} (use e.g. 100mbit, 1gbit, 10mbps or unlimited)")
    bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits < 8000:
        raise ValueError(f"link rate {text!r} is below 8kbit")
    return bits


def parse_delay(text: str | None) -> float | None:
    """``'1ms'`` -> 0.001 s (units s, ms, us); ``None``/``'0'``/``'none'`` -> ``None``."""
    if text is None or text.strip().lower() in ("", "none", "0"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"not a delay: {text!r} (use e.g. 500us, 1ms, 0.1s)")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if seconds > 10:
        raise ValueError(f"delay {text!r} is more than 10 s")
    return seconds or None


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "unlimited"
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= f and bits % f == 0:
            return f"{bits // f}{unit}"
    return f"{bits}bit"


def format_delay(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    us = round(seconds * 1e6)
    return f"{us // 1000}ms" if us % 1000 == 0 else f"{us}us"


def check_prerequisites() -> None:
    """Raise :class:`ClusterError` (one line) unless root with ``ip`` and ``tc`` available."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces and tc); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the emulated cluster needs `{tool}` from iproute2, which is not on PATH")


def sh(*args: str, timeout: float = 30) -> str:
    """Run one ``ip``/``tc`` command; raise :class:`ClusterError` with its stderr on failure."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"`{' '.join(args)}` failed: {e}") from None
    if r.returncode:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ClusterError(f"`{' '.join(args)}` failed: {msg[-1] if msg else f'exit code {r.returncode}'}")
    return r.stdout


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Network:
    """The namespaces, bridge, veths and qdiscs of one emulated cluster.

    ``create()`` builds everything (removing what it built if a step fails),
    ``destroy()`` kills whatever still runs inside and deletes the namespaces
    (which deletes their veths and the bridge with them). Names carry the pid
    and a per-process counter (``qc<pid>x<k>n<node>``, hub ``qc<pid>x<k>h``), so
    concurrent clusters never collide.
    """

    def __init__(self, nodes: int, rate_bits: int | None = None, delay_s: float | None = None):
        check_int(nodes, "nodes", minimum=1, maximum=MAX_NODES)
        self.nodes = nodes
        self.rate_bits = rate_bits
        self.delay_s = delay_s
        self.tag = f"qc{os.getpid()}x{next(_counter)}"
        self.hub = f"{self.tag}h"
        self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.ifname = NODE_IFNAME
        self._created: list[str] = []

    # --- setup -------------------------------------------------------------------------
    def create(self) -> None:
        check_prerequisites()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _add_ns(self, name: str) -> None:
        try:
            sh("ip", "netns", "add", name)
        except ClusterError as e:
            raise ClusterError(f"cannot create network namespace {name}: {e}") from None
        self._created.append(name)
        self._quiet_ipv6(name)

    @staticmethod
    def _quiet_ipv6(ns: str) -> None:
        """No IPv6 (router solicitations, MLD) in the cluster, so the counters see only our traffic."""
        if shutil.which("sysctl") and os.path.exists("/proc/sys/net/ipv6"):
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                            "net.ipv6.conf.default.disable_ipv6=1"], capture_output=True)

    def _create(self) -> None:
        self._add_ns(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._add_ns(ns)
            hub_if = f"v{i}"
            sh("ip", "-n", self.hub, "link", "add", hub_if, "type", "veth", "peer", "name", self.ifname, "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", hub_if, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", hub_if, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", self.ifname)
            sh("ip", "-n", ns, "link", "set", self.ifname, "up")
            self._shape(ns, self.ifname, self.delay_s)   # node -> switch
            self._shape(self.hub, hub_if, None)          # switch -> node

    def _tbf(self) -> list[str]:
        rate = self.rate_bits
        burst = max(8 * 1514, rate // 8 // 1000)          # >= 8 frames, ~1 ms of traffic at the rate
        return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "20ms"]

    def _shape(self, ns: str, dev: str, delay_s: float | None) -> None:
        if self.rate_bits is None and delay_s is None:
            return
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if delay_s is not None:
            try:
                sh(*tc, "root", "handle", "1:", "netem", "delay", f"{round(delay_s * 1e6)}us", "limit", "100000")
            except ClusterError as e:
                if "unknown" in str(e).lower():
                    raise ClusterError("--delay needs the netem qdisc, which this kernel lacks "
                                       "(CONFIG_NET_SCH_NETEM / sch_netem); run without --delay") from None
                raise
            if self.rate_bits is not None:
                sh(*tc, "parent", "1:1", "handle", "10:", *self._tbf())
        else:
            sh(*tc, "root", "handle", "1:", *self._tbf())

    def set_rate(self, rate_bits: int | None) -> None:
        """Change the rate of every shaped device now (``None``: no limit), as a rate schedule
        (:mod:`qcoll.bench.link_schedule`) does mid-run. Not with a delay (netem)."""
        if self.delay_s is not None:
            raise ClusterError("a link rate that changes mid-run does not combine with --delay")
        self.rate_bits = rate_bits
        devices = [(ns, self.ifname) for ns in self.namespaces] + [(self.hub, f"v{i}") for i in range(self.nodes)]
        for ns, dev in devices:
            if rate_bits is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            else:
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *self._tbf())

    # --- teardown ----------------------------------------------------------------------
    def kill_inside(self) -> None:
        """SIGKILL every process still running in one of this cluster's namespaces."""
        for ns in list(self._created):
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass

    def destroy(self) -> list[str]:
        """Delete everything; returns the error lines (empty when all went away)."""
        self.kill_inside()
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        left = set(list_namespaces())
        self._created = [ns for ns in self._created if ns in left]
        errors = [f"cannot delete network namespace {ns}" for ns in self._created]
        return errors

    # --- counters ----------------------------------------------------------------------
    def counters(self) -> list[dict]:
        """Absolute byte counters per node: ``[{"node", "sent", "received"}]`` (hub-side veth rx/tx)."""
        try:
            return hub_link_stats(self.hub, self.nodes)
        except RuntimeError as e:
            raise ClusterError(str(e)) from None

    def meter(self) -> LinkMeter:
        """The :class:`LinkMeter` of this cluster (what ranks get through ``QCOLL_LINK_METER``)."""
        return LinkMeter(self.hub, self.nodes)

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of every shaped device, keyed ``'<namespace>/<dev>'`` (for checks)."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            out[f"{ns}/{self.ifname}"] = sh("tc", "-n", ns, "qdisc", "show", "dev", self.ifname)
            out[f"{self.hub}/v{i}"] = sh("tc", "-n", self.hub, "qdisc", "show", "dev", f"v{i}")
        return out


def counter_delta(before: list[dict], after: list[dict]) -> tuple[int, list[dict]]:
    """Cross-node bytes between two :meth:`Network.counters` readings: (total sent, per node)."""
    per_node = [{"node": a["node"], "sent": a["sent"] - b["sent"], "received": a["received"] - b["received"]}
                for b, a in zip(before, after)]
    return sum(p["sent"] for p in per_node), per_node
