"""What window of steps the machine's noise supports: how far a window's median step time strays from
the run's mean, per window length, on the static runs of a ``qcoll-bench cluster ... -- train`` JSON.

    python bench/auto_noise.py bench/cluster_auto_slow.json bench/cluster_auto_fast.json

For each link and static mode (auto runs left out: they switch), the steps after ``--settle`` are cut
into consecutive windows of ``w`` steps (w = 1..8); printed: the step times' coefficient of variation,
and per ``w`` the 90th percentile of ``|median(window) / mean - 1|`` over the windows of every run.
A window is long enough when that is below the tuner's 5% goal: then two configurations 5% apart are
told apart by one window each, 9 times in 10.
"""
from __future__ import annotations

import json
import statistics
import sys

WINDOWS = range(1, 9)


def deviations(times: list[float], w: int) -> list[float]:
    mean = statistics.fmean(times)
    return [abs(statistics.median(times[i:i + w]) / mean - 1) for i in range(0, len(times) - w + 1, w)]


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def main(paths: list[str]) -> None:
    per_window = {w: [] for w in WINDOWS}
    print(f"{'link':>28} {'mode':>14} {'steps':>5} {'cv':>6}")
    for path in paths:
        with open(path) as fh:
            doc = json.load(fh)
        for run in doc["runs"]:
            settle = run["result"]["args"].get("settle") or 0
            for r in run["result"]["runs"]:
                if r["mode"].startswith("auto-") or "step_seconds" not in r:
                    continue
                times = r["step_seconds"][settle:]
                cv = statistics.pstdev(times) / statistics.fmean(times)
                print(f"{run['link']:>28} {r['mode']:>14} {len(times):>5} {cv:>6.3f}")
                for w in WINDOWS:
                    per_window[w] += deviations(times, w)
    print("\nwindow  p90 |median(window)/mean - 1|  (all static runs)")
    for w in WINDOWS:
        print(f"{w:>6}  {p90(per_window[w]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
