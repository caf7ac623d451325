"""SimiGrad on the emulated cluster: static global batches against adaptive batching, to one target loss.

Run (root, iproute2): python bench/adaptive_sweep.py --out bench/adaptive_sweep.json
(issue 29's: ``--link 20mbit --d-model 128 --accumulate-targets 0.8 ...``, see bench/RESULTS.md).
Each configuration is one ``qcoll-bench cluster --nodes 2 --ranks-per-node 2 --link RATE -- train``
command (ZeRO++ 8/4, the char transformer, sqrt LR scaling from --lr at --base-batch); static
batches and adaptive targets (one batch per step; ``--accumulate-targets``: micro-batches
under ``no_sync`` with the gathered weights kept, ``--accumulate --keep-gathered``) run for --seeds seeds each, in an interleaved order (so the VM's
drift hits all alike). Prints, per configuration, the median over seeds of samples and wall
time until the 10-step running training loss reaches --target-loss, and the ratios of adaptive
against the best static batch by samples and by wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from qcoll.bench.cli import write_json


def _train_args(a, batch, lr, seed, extra):
    return ["train", "--modes", "zeropp", "--steps", str(a.steps), "--warmup", "2", "--batch", str(batch),
            "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads), "--context", str(a.context),
            "--lr", f"{lr:.6g}", "--seed", str(seed), "--target-loss", str(a.target_loss), "--loss-window", "10", "--stop-at-target",
            *extra]


def _run(a, name, batch, lr, seed, extra):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "c.json")
        cmd = [sys.executable, "-m", "qcoll.bench", "cluster", "--nodes", "2", "--ranks-per-node", "2",
               "--link", a.link, "--json", out, "--", *_train_args(a, batch, lr, seed, extra)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=d)
        if p.returncode:
            raise SystemExit(f"{name} seed {seed} failed:\n{p.stderr[-3000:]}")
        with open(out) as f:
            run = json.load(f)["runs"][0]["result"]["runs"][0]
    keep = ("samples_to_target", "time_to_target_s", "steps_to_target", "step_time_s", "final_loss")
    row = {"config": name, "seed": seed, **{k: run[k] for k in keep},
           "inter_bytes_per_step": run["inter_bytes_per_step"], "memory": run["memory"]}
    if "batches" in run:
        row.update(batches=run["batches"], cosines=run["cosines"])
    print(f"{name:>14} seed {seed}: samples {row['samples_to_target']}, wall {row['time_to_target_s']}, "
          f"steps {row['steps_to_target']}, step {row['step_time_s'] * 1e3:.0f} ms", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.8])
    p.add_argument("--accumulate-targets", type=float, nargs="*", default=[],
                   help="adaptive targets also run with --accumulate --keep-gathered")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--base-batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=8, help="adaptive: the global micro-batch (batch0)")
    p.add_argument("--max-accumulation", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="cap per run (each stops at the target loss)")
    p.add_argument("--target-loss", type=float, default=2.6)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    configs = [(f"static-{b}", b, a.lr * (b / a.base_batch) ** 0.5, []) for b in a.batches]
    configs += [(f"adaptive-{t}", a.micro, a.lr * (a.micro / a.base_batch) ** 0.5,
                 ["--adaptive-batch", str(t), "--max-accumulation", str(a.max_accumulation)]) for t in a.targets]
    configs += [(f"adaptive-acc-{t}", a.micro, a.lr * (a.micro / a.base_batch) ** 0.5,
                 ["--adaptive-batch", str(t), "--max-accumulation", str(a.max_accumulation), "--accumulate",
                  "--keep-gathered"]) for t in a.accumulate_targets]
    rows = [_run(a, name, b, lr, seed, extra) for seed in range(a.seeds) for name, b, lr, extra in configs]
    summary = {}
    for name, *_ in configs:
        mine = [r for r in rows if r["config"] == name]
        reached = [r for r in mine if r["samples_to_target"] is not None]
        summary[name] = {"reached": f"{len(reached)}/{len(mine)}",
                         "samples": statistics.median(r["samples_to_target"] for r in reached) if reached else None,
                         "wall_s": statistics.median(r["time_to_target_s"] for r in reached) if reached else None,
                         "step_ms": statistics.median(r["step_time_s"] for r in mine) * 1e3}
    static = {k: v for k, v in summary.items() if k.startswith("static") and v["samples"] is not None}
    best_samples = min(static.values(), key=lambda v: v["samples"])
    best_wall = min(static.values(), key=lambda v: v["wall_s"])
    print(f"\n{'config':>14} {'reached':>8} {'samples':>8} {'wall(s)':>8} {'step(ms)':>9} "
          f"{'samples/best':>13} {'best wall/wall':>15}")
    for name, v in summary.items():
        ratio_s = v["samples"] / best_samples["samples"] if v["samples"] else None
        ratio_w = best_wall["wall_s"] / v["wall_s"] if v["wall_s"] else None
        v.update(samples_vs_best_static=ratio_s, wall_speedup_vs_best_static=ratio_w)
        print(f"{name:>14} {v['reached']:>8} {v['samples'] or '-':>8} "
              f"{format(v['wall_s'], '.1f') if v['wall_s'] else '-':>8} "
              f"{v['step_ms']:>9.0f} {f'{ratio_s:.2f}' if ratio_s else '-':>13} {f'{ratio_w:.2f}' if ratio_w else '-':>15}")
    if a.out:
        write_json(a.out, {"args": vars(a), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
