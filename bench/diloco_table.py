"""The table of record for issue 40: time to a held-out loss at each link rate, over three seeds,
composed from ``qcoll-bench cluster ... -- diloco`` JSON files.

Two kinds of runs feed it:

- **timing runs** (one seed, every link rate, on a quiet machine): each mode's training seconds
  at each held-out evaluation step (``curve``), or, for a synchronous mode run for fewer steps
  than the token budget (its steps all cost the same), its seconds per step;
- **loss runs** (every seed, any link: the losses do not depend on the link): the step at which
  each seed's held-out loss first reaches the target, and the final held-out loss.

A mode's time to the target for seed ``s`` at rate ``r`` is the seconds the rate-``r`` timing run
took to reach step ``k_s`` (``k_s``: seed ``s``'s step at the target), i.e. what seed ``s``'s run
would have taken at that rate; step times do not depend on the data. Reported: the median over
the seeds and the spread (min-max), "-" where a seed never reaches the target within the budget
(then the median is over all seeds, a miss counting as infinite).

    python bench/diloco_table.py --timing bench/diloco_t_*.json --loss 1:a.json 1:b.json 2:c.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

INF = math.inf
PEER_PREFIXES = ("diloco H", "diloco-bf16", "hsdp", "fsdp2")


def is_peer(mode: str) -> bool:
    return mode.startswith(PEER_PREFIXES) and "qcoll" not in mode


def _runs(path: str):
    """(link, inner run) of a cluster JSON."""
    with open(path) as f:
        data = json.load(f)
    for link_run in data["runs"]:
        for run in link_run["result"]["runs"]:
            yield link_run["link"], run


def load(timing: list[str], losses: list[str], budget: int, same: dict) -> tuple[dict, dict]:
    """``(times, outcomes)``: ``times[mode][link]`` the timing run; ``outcomes[mode][seed]`` =
    ``(step at target or None, final held-out, steps run)``; ``same``: mode -> the mode whose
    losses it takes (a bf16 peer timed only, its fp32 twin's losses)."""
    times, outcomes = {}, {}
    for path in timing:
        for link, run in _runs(path):
            times.setdefault(run["mode"], {})[link] = run
    for spec in losses:
        seed, path = spec.split(":", 1)
        for _, run in _runs(path):
            outcomes.setdefault(run["mode"], {})[int(seed)] = (run["step_at_target"], run["final_held_out"],
                                                               run["curve"][-1][0] if run["curve"] else None)
    for mode, by_link in times.items():   # seed 0: from its timing runs at full length
        for run in by_link.values():
            if run["curve"] and run["curve"][-1][0] == budget and 0 not in outcomes.get(mode, {}):
                outcomes.setdefault(mode, {})[0] = (run["step_at_target"], run["final_held_out"], budget)
    for mode, twin in same.items():
        outcomes[mode] = outcomes.get(twin, {})
    return times, outcomes


def seconds_at(run: dict, step: int | None, budget: int) -> float:
    """The timing run's training seconds at ``step`` (INF when the target was never reached)."""
    if step is None:
        return INF
    for s, t, _ in run["curve"]:
        if s == step:
            return t
    last = run["curve"][-1][0]
    if last < budget:   # a shortened synchronous run: every step costs the same
        return run["train_s"] * step / last
    raise ValueError(f"{run['mode']}: no evaluation at step {step}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else INF


def table(times: dict, outcomes: dict, links: list[str], budget: int) -> tuple[list[dict], dict]:
    rows = []
    for mode in times:
        seeds = outcomes.get(mode, {})
        if not seeds:
            continue
        row = {"mode": mode, "peer": is_peer(mode), "steps": {s: o[0] for s, o in sorted(seeds.items())},
               "final": {s: o[1] for s, o in sorted(seeds.items())}, "by_link": {}}
        for link in links:
            run = times[mode].get(link)
            if run is None:
                continue
            per_seed = [seconds_at(run, o[0], budget) for o in seeds.values()]
            row["by_link"][link] = {"median": _median(per_seed), "min": min(per_seed), "max": max(per_seed),
                                    "outer_mb": run["qcoll_inter_bytes_per_rank"] / 1e6 * (budget / run["curve"][-1][0]),
                                    "mib": run["memory_per_rank"] / 2 ** 20}
        rows.append(row)
    best = {}
    for link in links:
        for side in (True, False):
            cands = [(r["by_link"][link]["median"], r["mode"]) for r in rows if r["peer"] == side and link in r["by_link"]]
            best[(link, side)] = min(cands) if cands else (INF, "-")
    return rows, best


def _fmt(x: float) -> str:
    return "-" if x == INF else f"{x:.1f}"


def markdown(rows: list[dict], best: dict, links: list[str], limit: str = "unlimited") -> str:
    head = "| mode | steps to target (per seed) | final held-out (per seed) | " + " | ".join(
        f"{link}: s (spread)" for link in links) + " | outer MB/rank per 150 steps | MiB/rank |"
    out = [head, "|" + "---|" * (5 + len(links))]
    for r in rows:
        cells = []
        for link in links:
            c = r["by_link"].get(link)
            cells.append("" if c is None else f"{_fmt(c['median'])} ({_fmt(c['min'])}-{_fmt(c['max'])})")
        any_link = next(iter(r["by_link"].values()))
        steps = "/".join("-" if s is None else str(s) for s in r["steps"].values())
        final = "/".join(f"{f:.3f}" for f in r["final"].values())
        name = r["mode"] + ("" if r["peer"] else " **(qcoll)**")
        out.append(f"| {name} | {steps} | {final} | " + " | ".join(cells) + f" | {any_link['outer_mb']:.2f} | "
                   f"{any_link['mib']:.1f} |")
    out += ["", "| link | best peer | s | best qcoll mode | s | peer / qcoll | qcoll / its own limit |",
            "|---|---|---|---|---|---|---|"]
    for link in links:
        (tp, mp), (tq, mq) = best[(link, True)], best[(link, False)]
        own = next((r["by_link"].get(limit, {}).get("median", INF) for r in rows if r["mode"] == mq), INF)
        ratio = "-" if INF in (tp, tq) else f"{tp / tq:.2f}x"
        lim = "-" if INF in (tq, own) else f"{tq / own:.2f}x"
        out.append(f"| {link} | {mp} | {_fmt(tp)} | {mq} | {_fmt(tq)} | {ratio} | {lim} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timing", nargs="+", required=True, help="cluster JSONs of the timing runs (seed 0)")
    p.add_argument("--loss", nargs="*", default=[], metavar="SEED:FILE", help="cluster JSONs of other seeds' runs")
    p.add_argument("--links", nargs="+", default=["5mbit", "20mbit", "100mbit", "1gbit", "unlimited"])
    p.add_argument("--budget", type=int, default=150, help="the token budget in steps")
    p.add_argument("--same-losses", nargs="*", default=["hsdp-bf16=hsdp", "fsdp2-bf16=fsdp2"], metavar="MODE=TWIN",
                   help="modes timed only, with their twin's losses (default: the bf16 peers, fp32's)")
    p.add_argument("--json", default=None, help="write the composed rows here")
    a = p.parse_args(argv)
    times, outcomes = load(a.timing, a.loss, a.budget, dict(s.split("=", 1) for s in a.same_losses))
    rows, best = table(times, outcomes, a.links, a.budget)
    print(markdown(rows, best, a.links))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "best": {f"{k[0]} {'peer' if k[1] else 'qcoll'}": v for k, v in best.items()}},
                      f, indent=1, default=lambda x: None)


if __name__ == "__main__":
    main()
