"""A link rate that changes mid-run (``qcoll-bench cluster --link 100mbit@0,20mbit@150``) and
``qcoll-bench train --auto``'s reporting.

Oracles: the schedule's text itself; ``tc qdisc show`` for the rate a device really has (root);
hand-computed means for the report.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from qcoll.bench import link_schedule, netns, train_auto
from qcoll.bench.link_schedule import ProgressWriter, RateFollower, change_steps, parse_schedule, rate_at

from test_bench_cluster import _run_main, needs_netns


def test_parse_schedule():
    assert parse_schedule("100mbit@0,20mbit@150", netns.parse_rate) == [(0, 10**8), (150, 2 * 10**7)]
    assert parse_schedule("1gbit", netns.parse_rate) == [(0, 10**9)]
    assert parse_schedule("unlimited@0,20mbit@5,unlimited@9", netns.parse_rate) == [(0, None), (5, 2 * 10**7),
                                                                                       (9, None)]
    assert change_steps("100mbit@0,20mbit@150,100mbit@200") == [150, 200]
    assert change_steps(None) == [] and change_steps("1gbit") == []


@pytest.mark.parametrize("text, message", [
    ("100mbit@5,20mbit@9", "starts at step 0"), ("100mbit@0,20mbit@0", "steps increase"),
    ("100mbit,20mbit", "needs its step"), ("100mbit@0,20mbit@x", "whole number"), ("100mbit@0,fast@3", "link rate"),
])
def test_parse_schedule_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_schedule(text, netns.parse_rate)


def test_rate_at():
    s = [(0, 1), (10, 2), (20, None)]
    assert [rate_at(s, i) for i in (0, 9, 10, 19, 20, 500)] == [1, 1, 2, 2, None, None]


def test_follower_sets_the_rate_of_the_reported_step(tmp_path, monkeypatch):
    path = str(tmp_path / "progress")
    monkeypatch.setenv(link_schedule.PROGRESS_ENV, path)
    writer, ignored = ProgressWriter(rank=0), ProgressWriter(rank=1)
    assert ignored.path is None
    applied = []
    follower = RateFollower(path, [(0, 100), (3, 20)], applied.append)
    follower.start()

    def at(run, step):
        while run > writer.run:
            writer.begin_run()
        writer.step(step)
        ignored.step(step)
        time.sleep(10 * link_schedule.POLL_S)

    for step in range(5):
        at(0, step)
    at(1, 0)   # the next mode's steps start again: so does the schedule
    at(1, 4)
    changes = follower.stop()
    assert applied == [20, 100, 20]
    assert [(c["run"], c["step"]) for c in changes] == [(0, 3), (1, 0), (1, 4)]
    assert not [f for f in os.listdir(tmp_path) if f != "progress"]   # no temporary files left


@pytest.mark.parametrize("argv, message", [
    (["cluster", "--link", "100mbit@0,20mbit@3", "--", "collectives"], "works with train"),
    (["cluster", "--link", "100mbit@0,20mbit@3", "--delay", "1ms", "--", "train"], "without --delay"),
    (["cluster", "--link", "100mbit@2", "--", "train"], "starts at step 0"),
    (["train", "--auto", "rrl", "--steps", "20"], "--settle 60 must be smaller than --steps 20"),
    (["train", "--auto", "rrl", "--steps", "100", "--adaptive-batch", "0.8"], "does not combine"),
    (["train", "--auto", "sgd"], "invalid choice"),
])
def test_argument_errors_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(netns, "Network", None)
    code, err = _run_main(argv, capsys)
    assert code == 2 and message in err


def test_summary_against_the_best_static_run(monkeypatch):
    monkeypatch.setattr(train_auto, "_slowest", lambda values: list(values))
    runs = [{"mode": "a", "step_seconds": [1.0] * 8}, {"mode": "b", "step_seconds": [2.0] * 2 + [0.9] * 6},
            {"mode": "auto-rrl", "step_seconds": [1.0, 1.0, 3.0, 1.0, 2.0, 0.8, 0.5, 0.5]}]
    train_auto.summarize(runs, settle=2)
    by = {r["mode"]: r for r in runs}
    assert by["a"]["mean_after_s"] == 1.0 and by["b"]["mean_after_s"] == pytest.approx(0.9)
    assert by["a"]["wall_s"] == 8.0 and by["b"]["wall_s"] == pytest.approx(9.4)
    auto = by["auto-rrl"]
    assert auto["best_static"] == "b"                                   # the best mean after settling
    assert auto["mean_after_vs_best_static"] == pytest.approx((3 + 1 + 2 + 0.8 + 0.5 + 0.5) / 6 / 0.9)
    assert auto["wall_vs_best_static"] == pytest.approx(9.8 / 8)       # against the best wall: a's


def test_steps_to_within_5pct_after_a_change(monkeypatch):
    times = [1.0] * 20 + [2.0] * 5 + [1.2] * 3 + [1.0] * 22       # 50 steps, the change at 20
    static = [{"mode": "s", "step_seconds": [1.0] * 50}]
    out = train_auto._after_change({"step_seconds": times}, static, 20, 50)
    assert out["best_static"] == "s" and out["best_static_s"] == 1.0
    # the first step from which the median of 4 is <= 1.05: step 20 + 7 (1.2, 1.0, 1.0, 1.0 -> median 1.0)
    assert out["steps_to_within_5pct"] == 7


@needs_netns
def test_set_rate_changes_every_shaped_device():
    net = netns.Network(2, netns.parse_rate("20mbit"))
    try:
        net.create()
        net.set_rate(netns.parse_rate("50mbit"))
        assert all("tbf" in q and "rate 50Mbit" in q for q in net.qdiscs().values()), net.qdiscs()
        net.set_rate(None)
        assert not any("tbf" in q for q in net.qdiscs().values()), net.qdiscs()
        net.set_rate(netns.parse_rate("10mbit"))
        assert all("rate 10Mbit" in q for q in net.qdiscs().values()), net.qdiscs()
    finally:
        assert net.destroy() == []


@needs_netns
@pytest.mark.slow
def test_train_auto_on_a_link_that_changes(tmp_path):
    """End to end: the rate changes at step 3 of each run; the auto run switches configurations."""
    from test_bench_cluster import _cluster, _cluster_namespaces

    out = tmp_path / "cluster.json"
    argv = ["--link", "50mbit@0,10mbit@3", "--json", str(out), "--", "train", "--modes", "zeropp", "--auto", "rrl",
            "--steps", "6", "--warmup", "1", "--settle", "1", "--auto-window", "1", "--auto-explore", "3",
            "--batch", "4", "--layers", "1", "--d-model", "64"]
    p = _cluster(argv, tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert not _cluster_namespaces(p.pid)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["link"] == "50mbit@0,10mbit@3"
    # per run: 10 Mbit/s from step 3, back to 50 at the next run's step 0, 10 again at its step 3
    assert [(c["run"], c["step"], c["rate_bits"]) for c in run["rate_changes"]] == [
        (0, 3, 10**7), (1, 0, 5 * 10**7), (1, 3, 10**7)]
    modes = {r["mode"]: r for r in run["result"]["runs"]}
    auto = modes["auto-rrl"]
    assert len(auto["auto"]["labels"]) == 6 and len(set(auto["auto"]["labels"])) >= 2
    assert auto["auto"]["switches"] >= 1 and auto["best_static"] == "zeropp"
    assert [c["step"] for c in auto["changes"]] == [3]
    assert "online search" in stdout and "settled on" in stdout
