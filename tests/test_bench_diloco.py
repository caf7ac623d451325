"""``qcoll-bench diloco``: argument errors, and one small run on 2 local replica groups of one rank.

Oracles: the outer bytes of qcoll's 2-bit all-reduce from the wire format (docs/FORMAT.md: per
DiLoCo tensor and sync, one frame out in each stage, 16-byte header + packed codes and fp32
scales of ceil(numel / 2) elements), and the number of syncs from steps / H; the fp32 DiLoCo run for
the bf16-outer peer's losses.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from qcoll.bench import cli
from qcoll.testing.models import char_transformer

pytest.importorskip("torchft", reason="torchft is not installed: pip install 'qcoll[torchft]'")
BLOCK = 128


@pytest.mark.parametrize("extra,message", [
    (["--sync-every", "5", "--fragments", "2"], "must be a multiple of --fragments 2"),
    (["--sync-every", "4", "--fragments", "2", "--fragment-delay", "2"], "--fragment-delay below 2"),
    (["--modes", "nope"], "invalid choice"),
    (["--batch", "3", "--nproc", "2"], "not divisible by the 2 ranks"),
])
def test_argument_errors_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["diloco", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def _two_bit_frame(numel: int) -> int:
    return 16 + math.ceil(numel / BLOCK) * (BLOCK * 2 // 8 + 4)


@pytest.mark.slow
def test_a_small_run_syncs_every_h_steps_with_the_formats_bytes(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", "diloco", "--nproc", "2", "--ranks-per-node", "1",
                        "--modes", "diloco", "diloco-bf16", "diloco-q2-ef", "--steps", "6", "--sync-every", "3", "--warmup", "0",
                        "--batch", "4", "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {r["mode"]: r for r in json.loads((tmp_path / "out.json").read_text())["runs"]}
    assert list(runs) == ["diloco H=3", "diloco-bf16 H=3", "diloco-q2-ef H=3"]
    sizes = [t.numel() for t in char_transformer(seed=0).parameters()]
    for r in runs.values():
        assert r["outer_syncs"] == 2 and len(r["curve"]) == 2
        assert all(math.isfinite(loss) and loss < 6 for _, _, loss in r["curve"])
    want = 2 * sum(2 * _two_bit_frame(-(-n // 2)) for n in sizes)   # 2 syncs x 2 stages, one peer
    assert runs["diloco-q2-ef H=3"]["qcoll_inter_bytes_per_rank"] == want
    assert runs["diloco H=3"]["qcoll_inter_bytes_per_rank"] == 2 * sum(sizes) * 4
    assert runs["diloco-bf16 H=3"]["qcoll_inter_bytes_per_rank"] == 2 * sum(sizes) * 2
    # a bf16 outer sync (rounding each pseudo-gradient to 8 mantissa bits) tracks the fp32 one closely,
    # but not bit for bit: the sync ran in bf16
    fp32, bf16 = ([loss for _, _, loss in runs[m]["curve"]] for m in ("diloco H=3", "diloco-bf16 H=3"))
    assert fp32 != bf16 and all(abs(a - b) < 0.02 for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert "diloco-q2-ef H=3" in p.stdout
