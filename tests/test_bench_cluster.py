"""``qcoll-bench cluster``: the emulated low-bandwidth cluster (network namespaces, veth, tc).

Without root only the argument checks and the pure helpers run; the rest needs
root and working ``ip netns`` and skips with the reason otherwise. The oracles
are independent of the code under test: the link test sends a known number of
bytes through a plain TCP socket and checks the veth counters and the transfer
time against the configured rate; the end-to-end test checks the link bytes per
step against qcoll's own byte rule only as an upper bound on what ZeRO++ may
move relative to ZeRO-3 (the issue's goal, <= 0.25x).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from qcoll.bench import cli, cluster, netns
from qcoll.bench.linkmeter import ENV, LinkMeter

slow = pytest.mark.slow


def _can_make_namespaces() -> str | None:
    """None when this process may build a cluster, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs ip and tc (iproute2)"
    name = f"qcprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_NO_NETNS = _can_make_namespaces()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=f"emulated cluster: {_NO_NETNS}")


def _env(**extra):
    """The environment of a ``python -m qcoll.bench cluster`` subprocess (run outside the repository, see
    :func:`_cluster`)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", ENV):
        env.pop(key, None)
    env.update(extra)
    return env


def _cluster_namespaces(pid: int) -> list[str]:
    return [ns for ns in netns.list_namespaces() if ns.startswith(f"qc{pid}x")]


def _run_main(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


# --- pure helpers ------------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("100mbit", 10**8), ("1gbit", 10**9), ("2.5gbit", 25 * 10**8),
                                       ("10mbps", 8 * 10**7), ("64kbit", 64_000), ("unlimited", None),
                                       ("none", None), (None, None)])
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "100", "100mbits", "-1mbit", "1kbit", "mbit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="rate"):
        netns.parse_rate(text)


def test_rate_and_delay_formatting_round_trip():
    for text in ("100mbit", "1gbit", "64kbit", "unlimited"):
        assert netns.format_rate(netns.parse_rate(text)) == text
    assert netns.parse_delay("1ms") == pytest.approx(1e-3)
    assert netns.parse_delay("500us") == pytest.approx(5e-4)
    assert netns.parse_delay(None) is None
    assert netns.format_delay(netns.parse_delay("1ms")) == "1ms"
    assert netns.format_delay(netns.parse_delay("250us")) == "250us"
    for bad in ("soon", "1h", "11s"):
        with pytest.raises(ValueError, match="delay"):
            netns.parse_delay(bad)


def test_network_rejects_bad_node_count():
    for bad in (0, -1, True, 2.0, netns.MAX_NODES + 1):
        with pytest.raises(ValueError, match="nodes"):
            netns.Network(bad)


def test_link_meter_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert LinkMeter.from_env() is None
    monkeypatch.setenv(ENV, "qc1x0h:3")
    m = LinkMeter.from_env()
    assert (m.hub, m.nodes) == ("qc1x0h", 3) and m.env_value() == "qc1x0h:3"
    for bad in ("nocolon", "hub:", ":2", "hub:two"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            LinkMeter.from_env()


def test_counter_delta():
    before = [{"node": 0, "sent": 100, "received": 50}, {"node": 1, "sent": 10, "received": 20}]
    after = [{"node": 0, "sent": 1100, "received": 350}, {"node": 1, "sent": 310, "received": 1020}]
    total, per = netns.counter_delta(before, after)
    assert total == 1300
    assert per == [{"node": 0, "sent": 1000, "received": 300}, {"node": 1, "sent": 300, "received": 1000}]


def test_summary_table_ratios():
    def mode(name, step, link, colls, memory=None):
        return {"mode": name, "step_time_s": step, "link_bytes_per_step": link, "collectives_per_step": colls,
                "memory": memory or {}}

    # qcoll.zero's report (state: master + grad + optimizer state = 4 KiB; peak adds secondary and gathered = 5 KiB)
    # and FSDP2's (state and peak as measured)
    zero_memory = {"master": 2048, "grad": 1024, "optimizer_state": 1024, "secondary_peak": 512, "gathered_peak": 512}
    runs = [{"link": "100mbit", "result": {"runs": [mode("zero3", 2.0, 4000, 22),
                                                     mode("zeropp", 0.5, 500, 29, zero_memory),
                                                     mode("fsdp2", 2.5, 4400, 14, {"state": 3072, "peak": 4096}),
                                                     mode("fsdp2-bf16", 1.25, 2200, 14)]}},
            {"link": "unlimited", "result": {"runs": [mode("zero3", 0.2, 4000, 22), mode("zeropp", 0.25, 500, 29),
                                                       mode("fsdp2", 0.3, 4400, 14),
                                                       mode("fsdp2-bf16", 0.4, 2200, 14)]}}]
    table = cluster.summary_table(runs).splitlines()
    cols = next(line.split() for line in table if line.split()[:2] == ["link", "mode"])
    assert cols == ["link", "mode", "step(ms)", "link/step", "coll/step", "vs_zero3", "bytes_x", "state_KiB",
                    "peak_KiB", "vs_fsdp2", "vs_fsdp2-bf16", "vs_hsdp", "vs_hsdp-bf16", "vs_best"]
    rows = {(line.split()[0], line.split()[1]): line.split()[2:] for line in table
            if line.split()[:1] in (["100mbit"], ["unlimited"])}
    # at 100mbit the fastest peer is FSDP2-bf16, unlimited ZeRO-3 (ZeRO++ is slower there: vs_best < 1)
    assert rows["100mbit", "zeropp"] == ["500.0", "500", "29", "4.00", "0.125", "4", "5", "5.00", "2.50", "-", "-",
                                         "2.50"]
    assert rows["100mbit", "zero3"] == ["2000.0", "4000", "22", "1.00", "1.000", "-", "-", "1.25", "0.62", "-", "-",
                                        "0.62"]
    assert rows["100mbit", "fsdp2"][5:7] == ["3", "4"]
    assert rows["100mbit", "fsdp2-bf16"] == ["1250.0", "2200", "14", "1.60", "0.550", "-", "-", "2.00", "1.00", "-",
                                             "-", "1.00"]
    assert rows["unlimited", "zeropp"] == ["250.0", "500", "29", "0.80", "0.125", "-", "-", "1.20", "1.60", "-", "-",
                                           "0.80"]
    assert "best peer at 100mbit: fsdp2-bf16 (1250.0 ms)" in table
    assert "best peer at unlimited: zero3 (200.0 ms)" in table
    summary = {(r["link"], r["mode"]): r for r in cluster.summary_rows(runs)}
    assert summary["100mbit", "zeropp"]["best_peer"] == "fsdp2-bf16"
    assert summary["100mbit", "zeropp"]["speedup_vs_best_peer"] == pytest.approx(2.5)
    assert summary["unlimited", "zeropp"]["collectives_per_step"] == 29


def test_summary_table_without_peers():
    """A run without FSDP2 or ZeRO-3 has no best peer: dashes, no 'best peer' line."""
    runs = [{"link": "1gbit", "result": {"runs": [{"mode": "zeropp", "step_time_s": 0.5, "link_bytes_per_step": 9,
                                                   "collectives_per_step": 29}]}}]
    table = cluster.summary_table(runs)
    assert table.splitlines()[-1].split() == ["1gbit", "zeropp", "500.0", "9", "29"] + ["-"] * 9
    assert "best peer" not in table


# --- argument errors (no namespace is built; no root needed) --------------------------------

@pytest.mark.parametrize("argv,message", [
    (["cluster"], "give the command to run"),
    (["cluster", "--", "sleep"], "give the command to run"),
    (["cluster", "--", "train", "--nproc", "4"], "--nproc is set by the cluster"),
    (["cluster", "--", "collectives", "--json=x.json"], "--json is set by the cluster"),
    (["cluster", "--link", "fast", "--", "train"], "not a link rate: 'fast'"),
    (["cluster", "--delay", "soon", "--", "train"], "not a delay"),
    (["cluster", "--json", "/no/such/folder/out.json", "--", "train"], "folder does not exist"),
    (["cluster", "--nodes", "0", "--", "train"], "must be >= 1"),
    (["cluster", "--", "train", "--stepz", "3"], "unrecognized arguments: --stepz"),
    (["cluster", "--", "generate", "--nproc", "4"], "--nproc is set by the cluster"),
    (["cluster", "--", "generate", "--tokenz", "3"], "unrecognized arguments: --tokenz"),
])
def test_argument_errors_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(netns, "Network", None)   # building a cluster here would be a bug
    code, err = _run_main(argv, capsys)
    assert code == 2
    assert message in err


def test_refuses_without_root(capsys, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "Network", None)
    code, err = _run_main(["cluster", "--", "train", "--steps", "3"], capsys)
    assert code == 2
    assert "needs root" in err


# --- the link itself (root) ------------------------------------------------------------------

_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 29611)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""

_SENDER = r"""
import socket, sys, time
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], 29611), timeout=60)
c.sendall(b"\x5a" * n); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


@needs_netns
def test_link_is_rate_limited_and_counted():
    """N bytes over TCP from node 0 to node 1: counters >= N (+ headers), time >= N*8/rate."""
    rate = netns.parse_rate("20mbit")
    n = 1_500_000
    net = netns.Network(2, rate)
    try:
        net.create()
        shaped = net.qdiscs()
        assert all("tbf" in q and "rate 20Mbit" in q for q in shaped.values()), shaped
        before = net.counters()
        rx = subprocess.Popen(["ip", "netns", "exec", net.namespaces[1], sys.executable, "-c", _RECEIVER],
                              stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", net.namespaces[0], sys.executable, "-c", _SENDER,
                        net.addresses[1], str(n)], check=True, timeout=60)
        wall = time.perf_counter() - t0
        got, _seconds = rx.communicate(timeout=60)[0].split()
        assert int(got) == n
        total, per = netns.counter_delta(before, net.counters())
    finally:
        errors = net.destroy()
    assert errors == []
    assert not _cluster_namespaces(os.getpid())
    # payload plus Ethernet/IP/TCP headers (~66 B per <=1448 B segment, ~5%) and the ACKs back
    assert n <= per[0]["sent"] <= 1.08 * n + 65536, per
    assert per[1]["received"] >= n and per[1]["sent"] < 0.1 * n, per
    assert total == per[0]["sent"] + per[1]["sent"]
    assert wall >= 0.85 * n * 8 / rate, f"{n} B in {wall:.2f} s is faster than 20mbit"
    assert wall <= 4 * n * 8 / rate + 2, f"{n} B in {wall:.2f} s: the link is far slower than 20mbit"


@needs_netns
def test_create_failure_leaves_nothing(monkeypatch):
    """A step of create() that fails removes what was already built."""
    real_sh = netns.sh

    def failing_sh(*args, **kw):
        if args[:2] == ("tc", "-n"):
            raise netns.ClusterError("tc refused (injected)")
        return real_sh(*args, **kw)

    monkeypatch.setattr(netns, "sh", failing_sh)
    net = netns.Network(2, netns.parse_rate("10mbit"))
    with pytest.raises(netns.ClusterError, match="injected"):
        net.create()
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(net.tag)]


# --- end to end (root) -----------------------------------------------------------------------

TRAIN = ["train", "--modes", "zero3", "zeropp", "--peer", "fsdp2-bf16", "--steps", "3", "--warmup", "1",
         "--batch", "4", "--layers", "1", "--d-model", "64"]


def _cluster(argv, cwd, **popen):
    """Start ``qcoll-bench cluster`` in ``cwd`` (a test's fresh ``tmp_path``): with the repository root as the
    working directory, ``-m`` would import the source tree's ``qcoll/`` over the installed package."""
    return subprocess.Popen([sys.executable, "-m", "qcoll.bench", "cluster", *argv], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@needs_netns
@slow
def test_train_on_cluster_end_to_end(tmp_path):
    out = tmp_path / "cluster.json"
    p = _cluster(["--link", "50mbit", "--json", str(out), "--", *TRAIN], tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert not _cluster_namespaces(p.pid)
    doc = json.loads(out.read_text())
    assert (doc["nodes"], doc["ranks_per_node"], doc["world"]) == (2, 2, 4)
    (run,) = doc["runs"]
    assert run["link"] == "50mbit" and run["rate_bits"] == 50 * 10**6
    modes = {r["mode"]: r for r in run["result"]["runs"]}
    z3, zpp = modes["zero3"]["link_bytes_per_step"], modes["zeropp"]["link_bytes_per_step"]
    assert z3 > 0 and zpp > 0
    # the timed steps are part of the whole command, whose bytes the driver counted itself
    assert run["cross_node_bytes"] >= 2 * (z3 + zpp)
    # ZeRO-3 moves fp32 weights across nodes twice and fp32 gradients once; ZeRO++ int8 weights once
    # (hpZ keeps the backward gather in the node) and int4 gradients: well under a quarter
    assert zpp / z3 <= 0.25, (zpp, z3)
    assert modes["zeropp"]["link_ratio_vs_zero3"] == pytest.approx(zpp / z3)
    # FSDP2 with bf16 all-gathers and reduce-scatters over gloo's ring (3 crossings of (W-1) half-size shards per
    # link direction) against ZeRO-3's fp32 gathers node by node ((N-1) * L shards each) and ring reduce-scatter
    # (W-1): 4.5 against 7 fp32 shards per direction on the wire; well over ZeRO++'s
    f16 = modes["fsdp2-bf16"]
    assert zpp < f16["link_bytes_per_step"] < 0.75 * z3, (zpp, f16["link_bytes_per_step"], z3)
    summary = {r["mode"]: r for r in doc["summary"]}
    assert set(summary) == {"zero3", "zeropp", "fsdp2-bf16"}
    assert all(summary[m]["collectives_per_step"] == modes[m]["collectives_per_step"] > 0 for m in summary)
    assert summary["zeropp"]["best_peer"] in ("zero3", "fsdp2-bf16")
    head = next(line.split() for line in stdout.splitlines() if line.split()[:2] == ["link", "mode"])
    assert "coll/step" in head and "vs_fsdp2-bf16" in head and "vs_best" in head, head
    assert "summary" in stdout and "best peer at 50mbit" in stdout


GENERATE = ["generate", "--modes", "zero3", "zeropp-gen", "--tokens", "4", "--prompt-len", "4", "--layers", "1",
            "--d-model", "32", "--heads", "2", "--vocab", "256", "--warmup", "0"]


@needs_netns
@slow
@pytest.mark.long   # ~25-40 s; the cluster end to end: the train test above; zeropp-gen's bytes after the first
#                     forward (none across nodes): test_bench_generate.py's byte rule, test_zero_generation.py
def test_generate_on_cluster_end_to_end(tmp_path):
    """Generation mode: after the first forward no byte crosses the node links (veth counters)."""
    out = tmp_path / "cluster.json"
    p = _cluster(["--link", "50mbit", "--json", str(out), "--", *GENERATE], tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert not _cluster_namespaces(p.pid)
    (run,) = json.loads(out.read_text())["runs"]
    modes = {r["mode"]: r for r in run["result"]["runs"]}
    z3, gen = modes["zero3"], modes["zeropp-gen"]
    assert z3["link_bytes_first_forward"] > 0 and z3["link_bytes_per_token_after_first"] > 0
    assert 0 < gen["link_bytes_first_forward"] < z3["link_bytes_first_forward"]
    # no weight crosses nodes after the first forward: what the counters still see is TCP's own noise
    # (acknowledgements trailing a window, retransmissions at the shaped link), far below one qwZ gather
    assert abs(gen["link_bytes_per_token_after_first"]) < 0.1 * gen["link_bytes_first_forward"], gen
    assert z3["tokens_match"] is True and gen["tokens_match"] is True
    assert "zeropp-gen" in stdout


@needs_netns
@slow
def test_failing_command_tears_down(tmp_path):
    """The inner command refuses its arguments on every rank: exit 2 with its message, nothing left."""
    p = _cluster(["--link", "10mbit", "--", "train", "--batch", "6", "--steps", "2", "--warmup", "0"], tmp_path)
    _, stderr = p.communicate(timeout=180)
    assert p.returncode == 2, stderr
    assert "not divisible" in stderr
    assert not _cluster_namespaces(p.pid)


@needs_netns
@slow
def test_ctrl_c_tears_down(tmp_path):
    # SIGINT handled, as from a terminal (a shell's background job, e.g. a CI step run with `&`, inherits it ignored)
    p = _cluster(["--link", "10mbit", "--", "train", "--steps", "200", "--warmup", "1"], tmp_path,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not _cluster_namespaces(p.pid) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert _cluster_namespaces(p.pid), "the cluster never came up"
    time.sleep(3)   # ranks are starting or training
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not _cluster_namespaces(p.pid)


@needs_netns
def test_delay_uses_netem_or_refuses_clearly():
    """--delay needs sch_netem: with it the node side gets netem above tbf, without it a one-line refusal."""
    net = netns.Network(2, netns.parse_rate("10mbit"), 0.002)
    try:
        net.create()
    except netns.ClusterError as e:
        assert "netem" in str(e) and "without --delay" in str(e)
    else:
        shaped = net.qdiscs()
        node_side = shaped[f"{net.namespaces[0]}/{net.ifname}"]
        assert "netem" in node_side and "delay 2ms" in node_side and "tbf" in node_side, node_side
        assert "netem" not in shaped[f"{net.hub}/v0"]
    finally:
        assert net.destroy() == []
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(net.tag)]
