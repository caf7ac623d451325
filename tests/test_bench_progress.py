"""Progress of the long ``qcoll-bench`` subcommands (issue 39): :mod:`qcoll.bench.progress`.

The reporter with a fake clock on a string stream: plain lines when each run begins, at most one
every ``interval`` seconds while it runs (also with no step done: the ticker's heartbeat), one when
it ends; nothing with ``QCOLL_PROGRESS=0`` or on ranks other than 0; a tqdm bar on a terminal or
with ``QCOLL_PROGRESS=1``. The start-up's line until rank 0 reports, the plain fallback of the
collectives' sweep, the cluster's forwarding of rank 0's lines; and one short real ``train``.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import pytest

from qcoll.bench import cluster, progress

LINE = re.compile(r"^qcoll-bench (\w+): (.*)$")


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch):
    """As a user runs it: no QCOLL_PROGRESS, not a rank of torchrun."""
    for key in ("QCOLL_PROGRESS", "RANK", progress.STARTED_ENV):
        monkeypatch.delenv(key, raising=False)


def _plain(**kw):
    out, clock = io.StringIO(), _Clock()
    return progress.Steps("train", file=out, clock=clock, ticker=False, **kw), out, clock


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_plain_lines_at_most_every_interval():
    steps, out, clock = _plain(interval=5.0)
    assert steps.style == "plain"                      # a StringIO is no terminal
    steps.begin("zeropp (1/2)", 20)
    assert _lines(out) == ["qcoll-bench train: zeropp (1/2) step 0/20"]   # at once, before any step
    printed = [clock.t]
    for i in range(1, 21):                             # a step every 1.3 s: 26 s in all
        clock.t += 1.3
        before = len(_lines(out))
        steps.update(i)
        if len(_lines(out)) > before:
            printed.append(clock.t)
    assert all(b - a >= 5.0 for a, b in zip(printed, printed[1:])), printed
    assert len(printed) - 1 == 4                       # 26 s of steps: at 5.2, 10.4, 15.6, 20.8 s
    assert _lines(out)[1] == "qcoll-bench train: zeropp (1/2) step 4/20, 5 s"
    steps.end()
    assert _lines(out)[-1] == "qcoll-bench train: zeropp (1/2) step 20/20, done in 26 s"
    for text in _lines(out):
        assert LINE.match(text) and "zeropp (1/2) step " in text


def test_a_line_when_each_run_begins_and_a_heartbeat_while_a_step_runs():
    steps, out, clock = _plain(interval=5.0)
    steps.begin("zero3 (1/2)", 3)
    clock.t += 0.5
    steps.update(3)
    steps.begin("zeropp (2/2)", 3)                      # within the interval: still a line of its own
    assert _lines(out) == ["qcoll-bench train: zero3 (1/2) step 0/3",
                           "qcoll-bench train: zero3 (1/2) step 3/3, done in 0 s",
                           "qcoll-bench train: zeropp (2/2) step 0/3"]
    clock.t += 4.0
    steps.tick()                                        # the ticker, 4 s into a long first step: not yet
    assert len(_lines(out)) == 3
    clock.t += 2.0
    steps.tick()                                        # 6 s: a line although no step is done
    clock.t += 1.0
    steps.tick()
    assert _lines(out)[3:] == ["qcoll-bench train: zeropp (2/2) step 0/3, 6 s"]
    steps.note("w8 g4")
    clock.t += 5.0
    steps.tick()
    assert _lines(out)[-1] == "qcoll-bench train: zeropp (2/2) step 0/3, 12 s (w8 g4)"
    steps.begin("starting 4 ranks")                     # a run of unknown length: its time only, no last line
    clock.t += 5.0
    steps.tick()
    steps.close()
    assert _lines(out)[-2:] == ["qcoll-bench train: starting 4 ranks", "qcoll-bench train: starting 4 ranks, 5 s"]


def test_a_failed_command_claims_no_run_done():
    out, clock = io.StringIO(), _Clock()
    with pytest.raises(RuntimeError):
        with progress.Steps("train", file=out, clock=clock, ticker=False) as steps:
            steps.begin("zeropp", 20)
            raise RuntimeError("a rank failed")
    assert _lines(out) == ["qcoll-bench train: zeropp step 0/20"]


def test_seconds_of_a_timed_run():
    steps, out, clock = _plain(interval=5.0)
    steps.begin("rrl (2/2): trace", 180, unit="s", timed=True)
    clock.t += 7.4
    steps.tick()
    clock.t += 200
    steps.end()
    assert _lines(out) == ["qcoll-bench train: rrl (2/2): trace 0/180 s",
                           "qcoll-bench train: rrl (2/2): trace 7/180 s, 7 s",
                           "qcoll-bench train: rrl (2/2): trace 180/180 s, done in 207 s"]


def test_nothing_with_qcoll_progress_0_nor_on_other_ranks(monkeypatch):
    steps, out, clock = _plain(enabled=False)           # a rank other than 0
    steps.begin("zeropp", 3)
    steps.update(3)
    steps.close()
    assert out.getvalue() == ""
    monkeypatch.setenv("QCOLL_PROGRESS", "0")
    for stream in (io.StringIO(), _Tty()):
        steps = progress.Steps("train", file=stream, clock=_Clock())
        assert steps.style == "off" and steps._thread is None
        steps.begin("zeropp", 3)
        steps.update(1)
        steps.tick()
        steps.close()
        with progress.starting("train", 2, file=stream):
            pass
        with progress.sweep(10, "collectives", file=stream) as p:
            p.set_postfix_str("1K all_gather fp32", refresh=False)
            p.update(10)
        assert stream.getvalue() == ""


@pytest.mark.parametrize("forced", [False, True], ids=["terminal", "QCOLL_PROGRESS=1"])
def test_a_tqdm_bar_on_a_terminal_or_when_forced(monkeypatch, forced):
    if forced:
        monkeypatch.setenv("QCOLL_PROGRESS", "1")
    stream = io.StringIO() if forced else _Tty()
    steps = progress.Steps("train", file=stream, ticker=False, mininterval=0)
    assert steps.style == "bar"
    steps.begin("zeropp (1/2)", 4)
    assert isinstance(steps._bar, progress.tqdm)
    steps.update(2, note="w8 g4")
    text = stream.getvalue()
    assert "train zeropp (1/2):  50%|" in text and "2/4 step" in text and "w8 g4" in text
    assert "\n" not in text and "qcoll-bench train:" not in text   # one line redrawn, no plain lines
    steps.end()
    assert stream.getvalue().endswith("\r") and stream.getvalue().rsplit("\r", 2)[-2].strip() == ""   # erased
    steps.begin("starting 2 ranks")                   # unknown length: its name and clock
    steps.tick()
    steps.close()
    assert "train starting 2 ranks: 00:00" in stream.getvalue() and "\n" not in stream.getvalue()


def test_the_sweep_falls_back_to_plain_lines():
    out, clock = io.StringIO(), _Clock()
    with progress.sweep(1000, "collectives", file=out, clock=clock, ticker=False) as p:
        assert not isinstance(p, progress.tqdm)
        p.set_postfix_str("1K all_gather fp32", refresh=False)
        p.update(0)
        clock.t += 6
        p.update(450)
        p.update(550)
    assert _lines(out) == ["qcoll-bench collectives: sweep 0%",
                           "qcoll-bench collectives: sweep 45%, 6 s (1K all_gather fp32)",
                           "qcoll-bench collectives: sweep 100%, done in 6 s"]
    with progress.sweep(1000, "collectives", file=_Tty()) as p:   # on a terminal: the bar, as before
        assert isinstance(p, progress.tqdm) and not p.disable


def test_the_start_up_is_reported_until_rank_0_reports():
    """``starting N ranks`` at once, then every interval, until rank 0's reporter exists (in the ranks:
    they inherit the marker's name); the marker and the variable are gone afterwards."""
    out = io.StringIO()
    with progress.starting("train", 2, file=out, interval=0.2):
        marker = os.environ[progress.STARTED_ENV]
        assert os.path.exists(marker)
        deadline = time.monotonic() + 10
        while len(_lines(out)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        progress.Steps("train", file=io.StringIO(), ticker=False)   # rank 0 (here: the same process)
        assert not os.path.exists(marker)
        time.sleep(0.6)                                 # the watcher ends the start-up's run
        seen = _lines(out)
        time.sleep(0.6)
        assert _lines(out) == seen                      # no more start-up lines
    assert seen[0] == "qcoll-bench train: starting 2 ranks"
    assert len(seen) >= 3 and all(re.fullmatch(r"qcoll-bench train: starting 2 ranks, \d+ s", s) for s in seen[1:])
    assert progress.STARTED_ENV not in os.environ


def test_the_cluster_forwards_rank_0s_progress_lines(tmp_path, capsys):
    """The ranks of ``qcoll-bench cluster`` write to files: rank 0's progress lines reach stderr as they are
    written (not its other output), and until the first one the cluster's own line every interval."""
    path, clock = tmp_path / "rank0.err", _Clock()
    forward = cluster._Forward(str(path), "train", 4, interval=5.0, clock=clock)
    forward.poll()                                      # no file yet
    clock.t += 6
    forward.poll()
    assert capsys.readouterr().err == "qcoll-bench cluster: train starting on 4 ranks, 6 s\n"
    with open(path, "w") as f:
        f.write("qcoll-bench train: starting 4 ranks\nsome warning\nqcoll-bench train: zeropp step 0/")
        f.flush()
        forward.poll()
        assert capsys.readouterr().err == "qcoll-bench train: starting 4 ranks\n"
        f.write("20\nqcoll-bench train: error: bad\nqcoll-bench collectives: sweep 5%\n")
        f.flush()
        clock.t += 6
        forward.poll()                                  # rank 0 reports: no more of the cluster's own
    assert capsys.readouterr().err == "qcoll-bench train: zeropp step 0/20\n"
    net = type("Net", (), {"addresses": ["10.0.0.1"], "ifname": "veth0",
                           "meter": lambda self: type("Meter", (), {"env_value": lambda m: ""})()})()
    assert "QCOLL_PROGRESS" not in cluster._rank_env(net, 0, 4, 2)   # the ranks write to files: plain lines


@pytest.mark.slow
def test_train_reports_each_mode_and_its_steps(tmp_path):
    """A real (tiny) run, stderr a pipe: the start-up line, then the mode's lines with its steps; the
    table alone on stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("QCOLL_PROGRESS", "RANK")}
    env["PYTHONWARNINGS"] = "ignore"
    argv = ["train", "--nproc", "2", "--steps", "3", "--warmup", "0", "--d-model", "32", "--layers", "1",
            "--batch", "4", "--context", "16", "--modes", "zeropp"]
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", *argv], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    lines = [s for s in p.stderr.splitlines() if s.startswith("qcoll-bench train:")]
    assert lines[0] == "qcoll-bench train: starting 2 ranks", p.stderr
    assert all(re.fullmatch(r"qcoll-bench train: starting 2 ranks(, \d+ s)?", s) for s in lines[:lines.index(
        "qcoll-bench train: zeropp step 0/3")]), p.stderr
    assert re.fullmatch(r"qcoll-bench train: zeropp step 3/3, done in \d+ s", lines[-1]), p.stderr
    assert "qcoll-bench" not in p.stdout and any(s.split()[:1] == ["zeropp"] for s in p.stdout.splitlines())
