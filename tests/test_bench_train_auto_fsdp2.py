"""``qcoll-bench train --auto-fsdp2``: AutoTune on the FSDP2 path inside the benchmark's training loop.

Oracle: the configurations the run reports per step against the space AutoTune searches on FSDP2
(``qcoll.tune.drivers.FSDP_KNOBS``), its start (``fsdp2-qcoll``'s ``quantize_comm`` defaults), and the
static run it is compared with; the switching itself is checked against the collectives in
tests/test_tune_fsdp.py.
"""
import json
import os
import subprocess
import sys

from qcoll.tune.drivers import FSDP_KNOBS
from qcoll.tune.space import config_label


def test_an_fsdp2_auto_run_switches_and_is_compared_with_the_static_run(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    env.pop("RANK", None)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", "train", "--nproc", "4", "--ranks-per-node", "2",
                        "--modes", "fsdp2-qcoll", "--auto-fsdp2", "random", "--steps", "8", "--warmup", "1",
                        "--settle", "2", "--auto-window", "1", "--auto-explore", "3", "--batch", "4", "--layers", "1",
                        "--d-model", "64", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    auto = runs["auto-fsdp2-random"]
    space = {config_label({"weight_bits": w, "grad_bits": g}) for w in FSDP_KNOBS[0].values for g in FSDP_KNOBS[1].values}
    labels = auto["auto"]["labels"]
    assert len(labels) == 8 and set(labels) <= space and labels[0] == "w8 g4"
    assert auto["auto"]["switches"] >= 1 and len(set(labels)) >= 2
    assert auto["best_static"] == "fsdp2-qcoll" and "quantize_comm(model, topology" in \
        auto["auto"]["final_config"]["quantize_comm"]
    assert "auto-fsdp2-random" in p.stdout and "settled on" in p.stdout
