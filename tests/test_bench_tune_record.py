"""qcoll-bench tune --record/--json/--plot: outputs checked before measuring, written atomically,
a symlink at the output path replaced and never followed.

The measurements are stubbed (``qcoll.bench.tune._measure``) and the command runs as one rank in
this process (``RANK`` set, as under torchrun), so the whole --record path runs in a second.
"""
import json
import os
import socket

import pytest

from qcoll import files, tune
from qcoll.bench import cli
from qcoll.bench import tune as tune_cmd

FAST = ["--steps", "4", "--warmup", "1"]


def _fake_cost(config: dict) -> float:
    """A distinct, known step time per configuration."""
    return 1.0 + (config["weight_bits"] or 0) / 10 + (config["grad_bits"] or 0) / 100 + config["hpz"] / 1000 \
        + config["prefetch"] / 10000


@pytest.fixture
def one_rank(monkeypatch):
    """Run ``qcoll-bench tune`` as a single in-process rank with stubbed measurements; yields the call list."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "QCOLL_PROGRESS": "0"}.items():
        monkeypatch.setenv(k, v)
    calls = []

    def measure(args, topo, config):
        calls.append(dict(config))
        return _fake_cost(config), 1.0

    monkeypatch.setattr(tune_cmd, "_measure", measure)
    return calls


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank is started (or anything measured); yields the call list."""
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError("a rank was started although the arguments were refused")

    monkeypatch.setattr(tune_cmd, "run_ranks", refuse)
    monkeypatch.setattr(tune_cmd, "_measure", refuse)
    return calls


def test_record_replaces_a_planted_symlink_and_leaves_its_target(one_rank, tmp_path):
    victim, victim_json = tmp_path / "victim.txt", tmp_path / "victim2.txt"
    victim.write_text("precious\n")
    victim_json.write_text("also precious\n")
    record, out = tmp_path / "table.json", tmp_path / "out.json"
    record.symlink_to(victim)
    out.symlink_to(victim_json)
    assert cli.main(["tune", "--record", str(record), "--json", str(out), *FAST]) == 0
    assert victim.read_text() == "precious\n" and victim_json.read_text() == "also precious\n"
    for path in (record, out):
        assert not path.is_symlink() and path.is_file(), path
    table = tune.Table.load(str(record))          # the format Table.load reads
    sp = tune_cmd.space()
    assert len(table.costs) == len(sp) == 24
    assert all(table.costs[p] == (_fake_cost(sp.config(p)), True) for p in sp.points())
    assert len(json.loads(out.read_text())["rows"]) == 24
    assert len(one_rank) == 25                     # ZeRO-3 reference + the 24 configurations
    # nothing left behind: no temporary files beside the outputs
    assert sorted(os.listdir(tmp_path)) == ["out.json", "table.json", "victim.txt", "victim2.txt"]


def test_record_to_a_regular_file_replaces_it(one_rank, tmp_path):
    record = tmp_path / "table.json"
    record.write_text("old")
    assert cli.main(["tune", "--record", str(record), *FAST]) == 0
    assert len(tune.Table.load(str(record)).costs) == 24


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qcoll-bench tune: error:"), err
    return err[0]


@pytest.mark.parametrize("option", ["--record", "--json", "--plot"])
def test_a_missing_folder_is_refused_before_any_measurement(no_ranks, tmp_path, capsys, option):
    path = str(tmp_path / "missing" / ("t.png" if option == "--plot" else "t.json"))
    err = _usage_error(capsys, ["tune", option, path, *FAST])
    assert f"{option} {path}" in err and "does not exist" in err, err
    assert no_ranks == []


def test_record_into_a_file_as_folder_or_onto_a_folder_is_refused(no_ranks, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "t.json")
    err = _usage_error(capsys, ["tune", "--record", path, *FAST])
    assert f"--record {path}" in err and "is not a folder" in err, err
    err = _usage_error(capsys, ["tune", "--record", str(tmp_path), *FAST])
    assert f"--record {tmp_path}" in err and "is a folder" in err, err
    assert no_ranks == [] and os.listdir(tmp_path) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_record_into_a_read_only_folder_is_refused(no_ranks, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        path = str(folder / "t.json")
        err = _usage_error(capsys, ["tune", "--record", path, *FAST])
        assert f"--record {path}" in err and "cannot create a file" in err, err
    finally:
        folder.chmod(0o755)
    assert no_ranks == []


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_replay_checks_its_outputs_before_replaying(monkeypatch, tmp_path, capsys, option):
    monkeypatch.setattr(tune, "replay", lambda *a, **k: pytest.fail("replayed although an output was refused"))
    table = tmp_path / "t.json"
    sp = tune_cmd.space()
    table.write_text(json.dumps(tune_cmd.table_doc(tune.Table(sp, {p: (1.0, True) for p in sp.points()}))))
    path = str(tmp_path / "missing" / ("r.png" if option == "--plot" else "r.json"))
    err = _usage_error(capsys, ["tune", "--replay", str(table), option, path])
    assert f"{option} {path}" in err and "does not exist" in err, err


def test_write_atomic_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")

    def fail(f):
        f.write(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        files.write_atomic(str(path), fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_gives_the_permissions_of_a_plain_open(tmp_path):
    old = os.umask(0o022)
    try:
        cli.write_json(str(tmp_path / "a.json"), {"x": 1})
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "a.json").st_mode & 0o777) == 0o644
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_plot_is_written_atomically_through_a_symlink(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    victim, path = tmp_path / "victim.png", tmp_path / "p.png"
    victim.write_bytes(b"precious")
    path.symlink_to(victim)
    tune_cmd._plot({"rrl": [2.0, 1.0, 1.0]}, str(path), "test")
    assert victim.read_bytes() == b"precious" and not path.is_symlink()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
