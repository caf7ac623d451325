"""qcoll-bench serve: the trace and its arrivals, the report's arithmetic, and a short run end to end."""
import argparse
import json

import numpy as np
import pytest

from qcoll.bench.serve_load import arrivals, parse_trace, segment_starts
from qcoll.bench.serve_report import _changes, oracle_point


def test_trace_parsing():
    segs = parse_trace("20:60,10-50:30")
    assert [(s.rate_from, s.rate_to, s.seconds) for s in segs] == [(20, 20, 60), (10, 50, 30)]
    assert segment_starts(segs) == [0.0, 60.0]
    assert segs[1].rate(15) == 30
    for bad in ["", "20", "20:0", "-5:10", "0:10", "a:b", "20:10,", "nan:5"]:
        with pytest.raises(ValueError, match="trace"):
            parse_trace(bad)


def test_arrivals_follow_the_trace():
    """Counts per segment within 4 sd of Poisson's mean; a ramp's arrivals grow linearly."""
    segs = parse_trace("50:40,200:20,0-100:40")
    t = arrivals(segs, seed=3)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 100
    for lo, hi, mean in [(0, 40, 2000), (40, 60, 4000), (60, 100, 2000)]:
        n = np.sum((t >= lo) & (t < hi))
        assert abs(n - mean) < 4 * np.sqrt(mean), (lo, n, mean)
    ramp = t[t >= 60] - 60
    first, second = np.sum(ramp < 20), np.sum(ramp >= 20)     # expected 500 and 1500
    assert abs(first - 500) < 4 * np.sqrt(500) and abs(second - 1500) < 4 * np.sqrt(1500)
    gaps = np.diff(t[(t > 1) & (t < 39)])
    assert abs(np.std(gaps) / np.mean(gaps) - 1) < 0.1   # exponential gaps: CV 1
    assert np.array_equal(arrivals(segs, seed=3), t)


def test_requests_to_near_by_the_offline_table():
    tables = {10.0: [{"point": [0], "config": "a", "p95_s": 0.010}, {"point": [1], "config": "b", "p95_s": 0.030}],
              50.0: [{"point": [0], "config": "a", "p95_s": 0.090}, {"point": [1], "config": "b", "p95_s": 0.040}]}
    assert oracle_point(tables, 12) == (0,) and oracle_point(tables, 45) == (1,)
    args = argparse.Namespace(trace_segments=parse_trace("10:1,50:1"), within=0.1)
    times = np.array([0.1, 0.5, 0.9, 1.1, 1.2, 1.5, 1.9])
    labels = ["b", "a", "a", "a", "b", "a", "b"]
    got = _changes(args, times, times, labels, tables)
    assert [(c["first"], c["settled"], c["requests"]) for c in got] == [(1, 1, 3), (1, 3, 4)]


@pytest.mark.slow
@pytest.mark.long   # ~45 s: three qcoll-serve processes and 8 s of trace (the pieces: the tests above, test_serve_*.py)
def test_short_run_end_to_end(tmp_path):
    from qcoll.bench.cli import main

    out = tmp_path / "serve.json"
    rc = main(["serve", "--trace", "30:2,90:2", "--runs", "oracle", "rrl", "--batch-sizes", "1,8",
               "--timeouts-ms", "0", "--oracle-seconds", "0.6", "--settle-seconds", "0.1", "--layers", "1",
               "--d-model", "32", "--heads", "2", "--vocab", "64", "--prompt-len", "8", "--new-tokens", "1",
               "--window", "20", "--replay-seeds", "2", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["space"] == 8 and set(doc["tables"]) == {"30.0", "90.0"}
    assert all(len(rows) == 8 for rows in doc["tables"].values())
    runs = {r["run"]: r for r in doc["runs"]}
    assert set(runs) == {"oracle", "rrl"}
    n = runs["oracle"]["requests"]
    assert 240 - 4 * 240 ** 0.5 < n < 240 + 4 * 240 ** 0.5          # 30/s and 90/s for 2 s each
    assert set(doc["replay"]) == {"rrl", "random", "tpe"}
    for r in runs.values():
        assert r["requests"] == n and r["ok"] + r["http_503"] + r["failed"] == n
        assert r["ok"] > 0.9 * n and 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert sum(c["requests"] for c in r["changes"]) == n
        assert len(r["changes"]) == 2 and 0 <= r["client_cpu"] < 1.5
    assert all(c["first"] == 0 and c["settled"] == 0 for c in runs["oracle"]["changes"])
    assert runs["rrl"]["switches"] >= 2
