"""qcoll.tune: RRL and the baselines on synthetic objectives with a known optimum and a cliff."""
import math

import numpy as np
import pytest

from qcoll import tune
from qcoll.tune import Knob, Space, Table

OPT = (4, 1, 2)


def _space():
    return Space([Knob("a", tuple(range(6))), Knob("b", tuple(range(5))), Knob("c", tuple(range(4)))])


def _table(cliff=True, scale=1.0, opt=OPT):
    """A smooth bowl around ``opt``; with ``cliff`` every a == 5 is infeasible although cheap."""
    sp = _space()
    costs = {}
    for p in sp.points():
        c = scale * (1 + sum(((x - o) / 2) ** 2 for x, o in zip(p, opt)))
        costs[p] = (c * (0.5 if cliff and p[0] == 5 else 1.0), not (cliff and p[0] == 5))
    return Table(sp, costs)


@pytest.mark.parametrize("name,budget", [("rrl", 60), ("tpe", 60), ("random", 120), ("exhaustive", 120)])
def test_each_tuner_finds_the_optimum_and_never_returns_an_infeasible_one(name, budget):
    table = _table()
    for seed in range(3):
        tuner = tune.TUNERS[name](table.space, seed=seed)
        history = tune.run(tuner, table.measure, budget)
        assert tuner.best().feasible and tuner.best().point == OPT, (name, seed, tuner.best())
        assert all(h["best_cost"] is None or table.costs[h["best_point"]][1] for h in history)


@pytest.mark.parametrize("name", ["rrl", "tpe", "random"])
def test_a_seed_fixes_the_search(name):
    table = _table()
    runs = [[h["point"] for h in tune.run(tune.TUNERS[name](table.space, seed=7), table.measure, 25)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_region_update_moves_toward_an_independent_quadratic_fit():
    """1-D, costs 1 + (x - 3)^2 / 3 measured at x = 0, 3, 6: the fit is that parabola; the region
    (radius 2 around x = 6) moves 0.3 of the way from its old values to it, measured points hold."""
    sp = Space([Knob("x", tuple(range(9)))])
    f = lambda x: 1 + (x - 3) ** 2 / 3  # noqa: E731
    r = tune.RRL(sp, seed=0, radius=2.0, adaptive_radius=False)
    r.tell((0,), f(0))
    r.tell((3,), f(3))
    before = r.Q.copy()
    r.tell((6,), f(6))
    for x in range(9):
        if x in (0, 3, 6):
            assert r.Q[x] == f(x)
        elif abs(x - 6) <= 2:
            assert r.Q[x] == pytest.approx(0.7 * before[x] + 0.3 * f(x), abs=2e-3)
        else:
            assert r.Q[x] == before[x]


def test_rrl_notices_a_workload_change_and_reconverges():
    first, second = _table(cliff=False), _table(cliff=False, scale=3.0, opt=(1, 3, 0))
    r = tune.RRL(first.space, seed=1)
    tune.run(r, first.measure, 40)
    assert r.best().point == OPT
    r.trials.clear()  # the new workload's best is judged on its own measurements
    history = tune.run(r, second.measure, 50)
    assert r.resets >= 1
    assert tune.trials_to_within(history, second.optimum()) is not None


def test_replay_round_trips_a_table_and_counts_trials(tmp_path):
    table = _table()
    table.save(str(tmp_path / "t.json"))
    again = Table.load(str(tmp_path / "t.json"))
    assert again.costs == table.costs
    out = tune.replay(again, tuners=("rrl", "exhaustive"), seeds=2, budget=120)
    exhaustive = sorted(table.space.points()).index(OPT) + 1
    assert out["exhaustive"]["trials"] == [exhaustive, exhaustive]
    curve = out["rrl"]["median_best"]  # best so far: never rises, ends at the optimum
    assert len(curve) == 120 and all(b <= a for a, b in zip(curve, curve[1:])) and curve[-1] == table.optimum()
    assert all(1 <= n <= 121 for n in out["rrl"]["trials"])


def test_config_lines_and_deepspeed_mapping():
    cfg = {"weight_bits": 8, "grad_bits": 4, "hpz": True, "prefetch": 2}
    assert tune.zero_config_line(cfg) == "ZeroConfig(weight_bits=8, grad_bits=4, hpz=True, prefetch=2)"
    ds = tune.deepspeed_json(cfg, 2)
    assert ds["zero_optimization"]["zero_quantized_weights"] is True
    assert ds["zero_optimization"]["zero_quantized_gradients"] is True
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert ds["qcoll"] == {"prefetch": 2, "hpz_partition_size": None}   # what DeepSpeed has no key for
    assert tune.deepspeed_json({"weight_bits": 4}, 2)["qcoll"]["weight_bits"] == 4


def test_bad_arguments():
    with pytest.raises(TypeError, match="space"):
        tune.RRL("space")
    with pytest.raises(ValueError, match="budget"):
        tune.run(tune.RandomSearch(_space()), _table().measure, 0)
    with pytest.raises(ValueError, match="not a configuration"):
        tune.RandomSearch(_space()).tell((9, 9, 9), 1.0)
    with pytest.raises(ValueError, match="NaN"):
        tune.RandomSearch(_space()).tell((0, 0, 0), math.nan)
    assert np.isfinite(_table().optimum())


# ---------------------------------------------------------------------------- qcoll-bench tune
BENCH = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "bench")


@pytest.mark.parametrize("extra,message", [
    (["--record", "a.json", "--replay", "b.json"], "exclude each other"),
    (["--replay", "/nonexistent/t.json"], "not a recorded table"),
    (["--nproc", "4", "--batch", "6"], "not divisible"),
    (["--steps", "4", "--warmup", "2"], "at least 3 timed steps"),
    (["--tuner", "bayes"], "invalid choice"),
])
def test_cli_argument_errors_exit_2_with_one_line(extra, message, capsys):
    from qcoll.bench import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["tune", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qcoll-bench tune: error:") and message in err[0], err


def test_cli_replays_the_recorded_tables(tmp_path, capsys):
    """The tables bench/RESULTS.md reports (emulated 2x2 cluster) replay in seconds, with the
    same medians as a direct replay of the library."""
    import json
    import os

    from qcoll.bench import cli

    path = os.path.join(BENCH, "tune_table_100mbit.json")
    if not os.path.exists(path):
        pytest.skip("the recorded table is part of the source tree, not of an installed package")
    assert cli.main(["tune", "--replay", path, "--seeds", "5", "--json", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    direct = tune.replay(Table.load(path), ("rrl", "random", "tpe"), seeds=5)
    assert {k: v["trials"] for k, v in doc["tuners"].items()} == {k: v["trials"] for k, v in direct.items()}
    assert "rrl: median" in capsys.readouterr().out
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    assert cli.main(["tune", "--replay", path, "--seeds", "2", "--plot", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_of_a_workload_change_counts_trials_after_it():
    before, after = _table(cliff=False), _table(cliff=False, scale=3.0, opt=(1, 3, 0))
    out = tune.replay_change(before, after, 30, tuners=("rrl", "exhaustive"), seeds=2, budget=120)
    assert all(n <= 120 for n in out["rrl"]["trials"]), out      # RRL finds the new best
    # exhaustive resumes its order where it stopped: the new best (1, 3, 0) is point 32 of the order
    assert out["exhaustive"]["trials"] == [sorted(after.space.points()).index((1, 3, 0)) + 1 - 30] * 2
    other = Table(Space([Knob("x", (0, 1))]), {(0,): (1.0, True), (1,): (2.0, True)})
    with pytest.raises(ValueError, match="same space"):
        tune.replay_change(before, other, 3)


@pytest.mark.slow
@pytest.mark.long   # ~30 s on 2 cores (5 processes); the report and --emit-config: test_tune_emit.py, in one process
def test_cli_live_search_reports_the_best_beside_the_defaults(tmp_path):
    import json
    import os
    import subprocess
    import sys

    import qcoll

    argv = ["tune", "--nproc", "4", "--ranks-per-node", "2", "--budget", "3", "--steps", "4", "--warmup", "1",
            "--batch", "4", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--json", str(tmp_path / "t.json"), "--emit-config", str(tmp_path / "ds.json")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", *argv], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["trials"]) == 3
    feasible = [t for t in doc["trials"] if t["feasible"]]
    assert doc["step_time_s"] == min(t["step_time_s"] for t in feasible)
    assert doc["best"] == min(feasible, key=lambda t: t["step_time_s"])["config"]
    assert doc["defaults"] == {"weight_bits": 8, "grad_bits": 4, "hpz": True, "prefetch": 1}
    assert "best: ZeroConfig(" in p.stdout and "defaults: ZeroConfig(" in p.stdout
    # issue 43: the best as printed and as written by --emit-config is what ZeroConfig.from_deepspeed takes
    chosen = qcoll.zero.ZeroConfig(**doc["best"])
    (line,) = [x for x in p.stdout.splitlines() if x.strip().startswith("{")]
    assert qcoll.zero.ZeroConfig.from_deepspeed(json.loads(line), 2) == chosen
    assert qcoll.zero.ZeroConfig.from_deepspeed(json.loads((tmp_path / "ds.json").read_text()), 2) == chosen
