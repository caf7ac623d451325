"""``qcoll-bench train --adaptive-batch``: argument errors, the time-to-target rule, one small run."""
import json
import math
import os
import subprocess
import sys

import pytest

from qcoll.bench import cli
from qcoll.bench.adaptive import to_target


def test_to_target_uses_the_running_mean_of_the_step_losses():
    losses = [5.0, 4.0, 3.0, 2.5, 2.0]
    samples = [8, 8, 16, 24, 16]
    seconds = [0.1, 0.1, 0.2, 0.3, 0.2]
    # window 2: means 4.5, 3.5, 2.75, 2.25 -> first <= 3.0 at step 4 (index 3)
    assert to_target(losses, samples, seconds, 3.0, 2) == (56, pytest.approx(0.7), 4)
    assert to_target(losses, samples, seconds, 1.0, 2) == (None, None, None)
    assert to_target(losses, samples, seconds, None, 2) == (None, None, None)
    assert to_target(losses, samples, seconds, 5.0, 1) == (8, pytest.approx(0.1), 1)


ARG_ERRORS = [
    (["--adaptive-batch", "1.5"], "cosine in (0, 1)"),
    (["--adaptive-batch", "0.8", "--peer", "fsdp2"], "qcoll.zero's modes only"),
    (["--adaptive-batch", "0.8", "--modes", "fsdp2-qcoll"], "no FSDP2 modes"),
    (["--steps", "5", "--target-loss", "2", "--loss-window", "6"], "must not exceed --steps"),
    (["--stop-at-target"], "needs --target-loss"),
    (["--max-accumulation", "0"], "must be >= 1"),
    (["--adaptive-batch", "0.8", "--keep-gathered"], "--keep-gathered needs --accumulate"),
]


@pytest.mark.parametrize("extra,message", ARG_ERRORS, ids=[" ".join(a) for a, _ in ARG_ERRORS])
def test_argument_errors_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qcoll-bench train: error:") and message in err[0], err


@pytest.mark.slow
def test_adaptive_run_reports_cosine_batch_lr_and_time_to_target(tmp_path):
    argv = ["train", "--nproc", "4", "--ranks-per-node", "2", "--modes", "zeropp", "--adaptive-batch", "0.95",
            "--max-accumulation", "3", "--similarity-window", "1", "--steps", "6", "--warmup", "1", "--batch", "4",
            "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2", "--lr", "0.01",
            "--target-loss", "5.2", "--loss-window", "2", "--json", str(tmp_path / "out.json")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", *argv], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert run["mode"] == "zeropp+adaptive"
    assert all(-1 <= c <= 1 for c in run["cosines"])
    assert all(b in (4, 8, 12) for b in run["batches"]) and run["batches"][0] == 4
    # the learning rate follows sqrt(batch / batch0)
    assert run["lrs"] == [pytest.approx(0.01 * math.sqrt(b / 4)) for b in run["batches"]]
    # a batch grows after a cosine below the target and shrinks after one above (window 1)
    for cos, b, nxt in zip(run["cosines"], run["batches"], run["batches"][1:]):
        assert nxt == (min(12, b + 4) if cos < 0.95 else max(4, b - 4)), run
    want = to_target(run["losses"], run["batches"], run["step_seconds"], 5.2, 2)
    assert (run["samples_to_target"], run["time_to_target_s"], run["steps_to_target"]) == want
    assert "cosine" in p.stdout and "samples>tgt" in p.stdout
    assert run["memory"]["gathered_peak_kib"] > 0
