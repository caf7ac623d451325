"""The tuners replayed on the recorded offline tables (bench/serve_tables.json) along the steps trace
40/s, 200/s, 40/s (60 s each): per tolerance, the median over seeds of the requests after each rate
change until the configuration in force is first near the table's best, and until it settled near
(90% of the rest of the segment); and the share of requests served by a configuration over the SLO.

    python bench/serve_replay_tolerances.py [--seeds 20]
"""
import argparse
import json
import os
import statistics

import numpy as np

from qcoll.serve.replay import replay_requests, settled
from qcoll.serve.scheduler import serve_space

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args()
    with open(os.path.join(HERE, "serve_tables.json")) as f:
        doc = json.load(f)
    space = serve_space(batch_sizes=(1, 2, 4, 8, 16, 32), timeouts_s=(0.0, 0.005, 0.02))
    by_rate = {float(r): {tuple(x["point"]): x["p95_s"] for x in rows} for r, rows in doc["tables"].items()}
    segments = [(40.0, 2400), (200.0, 12000), (40.0, 2400)]
    tables = [by_rate[r] for r, _ in segments]
    for name in ("rrl", "random", "tpe"):
        runs = [replay_requests(tables, segments, name, seed, slo_s=0.1, space=space) for seed in range(args.seeds)]
        line = [f"{name:<6}"]
        for within in (0.10, 0.25, 0.50):
            firsts, settles = [], []
            for in_force in runs:
                start = 0
                for k, ((_, n), table) in enumerate(zip(segments, tables)):
                    best = min(table.values())
                    near = [table[c] <= best * (1 + within) for c in in_force[start:start + n]]
                    firsts.append((k, near.index(True) if True in near else n))
                    s = settled(near)
                    settles.append((k, n if s is None else s))
                    start += n
            med = lambda xs, k: statistics.median(v for kk, v in xs if kk == k)  # noqa: E731
            line.append(f"{within:.0%}: first " + "/".join(f"{med(firsts, k):.0f}" for k in range(3)) +
                        " settled " + "/".join(f"{med(settles, k):.0f}" for k in range(3)))
        over = [np.mean([t[c] > 0.1 for t, c in zip([tables[0]] * 2400 + [tables[1]] * 12000 + [tables[2]] * 2400,
                                                      in_force)]) for in_force in runs]
        line.append(f"over the SLO {np.mean(over):.2%}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
