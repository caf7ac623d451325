"""The table of record for issue 41: step time of every peer, qcoll.zero's and the FSDP2 path's
static modes and both auto modes at each link rate, over repeated launches, composed from
``qcoll-bench cluster ... -- train`` JSON files (one file per repeat and kind of run).

A static mode's figure in one repeat is its ``step_time_s`` (median of the timed steps); an auto
mode's (``auto-*``) is its ``mean_after_s`` (mean step after ``--settle``: after the search).
Reported per link and mode: the median over the repeats and the spread (min-max), link bytes
per step and per-rank memory (KiB: state, and peak with the gathered parameters) of the first
repeat. Then the issue's goals, each as the median of the per-repeat ratios (each ratio from
one launch of the command, side by side) with their spread.

    python bench/fsdp_table.py --static s1.json s2.json s3.json --auto a1.json a2.json a3.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

PEERS = ("fsdp2", "fsdp2-bf16", "hsdp", "hsdp-bf16")
LINKS = ("20mbit", "100mbit", "1gbit", "unlimited")


def _load(path: str) -> dict:
    """{link: {mode: run}} of one cluster JSON (a run's ``step_s``: its figure, as above)."""
    with open(path) as f:
        data = json.load(f)
    out: dict = defaultdict(dict)
    for link_run in data["runs"]:
        link = link_run.get("link") or _link_name(link_run["rate_bits"])
        for run in link_run["result"]["runs"]:
            run = dict(run)
            run["step_s"] = run["mean_after_s"] if "auto" in run else run["step_time_s"]
            out[link][run["mode"]] = run
    return out


def _link_name(rate_bits) -> str:
    if not rate_bits:
        return "unlimited"
    return f"{rate_bits // 10**9}gbit" if rate_bits >= 10**9 else f"{rate_bits // 10**6}mbit"


def _spread(values: list[float], digits: int = 2) -> str:
    """``median [min-max]`` of ``values`` with ``digits`` decimals ("-" for none)."""
    if not values:
        return "-"
    med = statistics.median(values)
    return (f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]" if len(values) > 1
            else f"{med:.{digits}f}")


def _memory(run: dict) -> str:
    from qcoll.bench.train import memory_kib
    state, peak = memory_kib(run.get("memory"))
    return "-" if state is None else f"{state:.0f} / {peak:.0f}"


def _best(runs: dict, names) -> tuple[str | None, float]:
    found = [(runs[m]["step_s"], m) for m in names if m in runs]
    return (min(found)[1], min(found)[0]) if found else (None, float("nan"))


def _is_qcoll(mode: str) -> bool:
    return mode not in PEERS


def compose(repeats: list[dict]) -> str:
    lines = ["| link | mode | step ms, median [min-max] | link bytes/step | state / peak KiB |", "|---|---|---|---|---|"]
    goals = ["", "| link | best peer (median ms) | fsdp2-qcoll / zeropp | best qcoll / best peer | "
             "auto-rrl / best peer | auto-fsdp2-rrl / best peer |", "|---|---|---|---|---|---|"]
    for link in LINKS:
        per = [r[link] for r in repeats if link in r]
        if not per:
            continue
        modes = list(dict.fromkeys(m for r in per for m in r))
        for mode in modes:
            times = [r[mode]["step_s"] * 1e3 for r in per if mode in r]
            first = next(r[mode] for r in per if mode in r)
            bytes_ = first.get("link_bytes_per_step")
            lines.append(f"| {link} | {mode} | {_spread(times, 0)} | {'-' if bytes_ is None else f'{bytes_:,.0f}'} | "
                         f"{_memory(first)} |")
        peer_ms = [_best(r, PEERS)[1] * 1e3 for r in per]
        best_peer = statistics.mode([_best(r, PEERS)[0] for r in per])
        ratios = defaultdict(list)
        for r in per:
            _, peer = _best(r, PEERS)
            if "fsdp2-qcoll" in r and "zeropp" in r:
                ratios["fsdp"].append(r["fsdp2-qcoll"]["step_s"] / r["zeropp"]["step_s"])
            _, mine = _best(r, [m for m in r if _is_qcoll(m)])
            ratios["best"].append(peer / mine)
            for auto in ("auto-rrl", "auto-fsdp2-rrl"):
                if auto in r:
                    ratios[auto].append(peer / r[auto]["step_s"])
        goals.append(f"| {link} | {best_peer} ({statistics.median(peer_ms):.0f}) | {_spread(ratios['fsdp'])} | "
                     f"{_spread(ratios['best'])} | {_spread(ratios['auto-rrl'])} | {_spread(ratios['auto-fsdp2-rrl'])} |")
    return "\n".join(lines + goals)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--static", nargs="+", required=True, help="one cluster JSON of the static modes per repeat")
    p.add_argument("--auto", nargs="*", default=[], help="one cluster JSON of the auto modes per repeat, same order")
    args = p.parse_args(argv)
    if args.auto and len(args.auto) != len(args.static):
        p.error(f"--auto has {len(args.auto)} files, --static {len(args.static)}: one of each per repeat")
    repeats = []
    for i, path in enumerate(args.static):
        merged = _load(path)
        if args.auto:
            for link, runs in _load(args.auto[i]).items():
                merged[link].update(runs)
        repeats.append(merged)
    print(compose(repeats))


if __name__ == "__main__":
    main()
