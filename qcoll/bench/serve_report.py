"""``qcoll-bench serve``'s figures: latency percentiles, SLO violations, throughput, and per rate change
the requests until the configuration in force is near the oracle's (by the offline tables)."""
from __future__ import annotations

import numpy as np

from ..serve.replay import settled
from .serve_load import rate_at, segment_starts


def _nearest(tables: dict, rate: float) -> list[dict]:
    return tables[min(tables, key=lambda r: abs(float(r) - rate))]


def _best_row(tables: dict, rate: float) -> dict:
    """The row with the lowest offline p95 at the table rate nearest ``rate``."""
    return min(_nearest(tables, rate), key=lambda row: row["p95_s"])


def oracle_point(tables: dict, rate: float) -> tuple:
    """The configuration with the lowest offline p95 at the table rate nearest ``rate``."""
    return tuple(_best_row(tables, rate)["point"])


def _near_sets(tables: dict, within: float) -> dict:
    """Per table rate: the labels of the configurations within ``within`` of that table's best p95."""
    out = {}
    for rate, rows in tables.items():
        best = min(row["p95_s"] for row in rows)
        out[rate] = {row["config"] for row in rows if row["p95_s"] <= best * (1 + within)}
    return out


def _pct(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if x.size else None


def _config_at(switches: list, t: np.ndarray, fallback: str) -> list[str]:
    """The configuration label in force at each time of ``t`` (``switches``: [time, label] in order)."""
    if not switches:
        return [fallback] * len(t)
    times = np.array([s[0] for s in switches])
    idx = np.searchsorted(times, t, side="right") - 1
    return [switches[max(i, 0)][1] for i in idx]


def _changes(args, times, sent, labels, tables) -> list[dict]:
    """Per segment: the requests from its start until the configuration in force is within
    ``args.within`` of the oracle's offline p95 at the segment's rate (first, and settled: from then
    on in 90% of the segment's requests, :func:`qcoll.serve.replay.settled`)."""
    out = []
    trace = args.trace_segments
    near_sets = _near_sets(tables, args.within)
    starts = segment_starts(trace) + [float("inf")]
    for k, seg in enumerate(trace):
        mine = np.nonzero((times >= starts[k]) & (times < starts[k + 1]))[0]
        rate = seg.mean_rate
        near = np.array([labels[i] in _nearest(near_sets, rate_at(trace, times[i])) for i in mine], dtype=bool)
        best = _best_row(tables, rate)["p95_s"]
        first = int(np.argmax(near)) if near.any() else None
        out.append({"segment": k, "rate": rate, "requests": int(mine.size), "oracle_p95_ms": best * 1e3,
                    "first": first, "settled": settled(near)})
    return out


def summarize(name: str, args, times, out: dict, metrics: dict, tables: dict | None, space) -> dict:
    lat, status = out["latency"], out["status"]
    ok = status == 200
    slo = args.slo_ms / 1e3
    duration = sum(s.seconds for s in args.trace_segments)
    served = lat[ok]
    doc = {"run": name, "requests": int(lat.size), "ok": int(ok.sum()), "http_503": int((status == 503).sum()),
           "failed": int((~ok & (status != 503)).sum()),
           "p50_ms": _pct(served * 1e3, 50), "p95_ms": _pct(served * 1e3, 95), "p99_ms": _pct(served * 1e3, 99),
           "violation_rate": float(np.mean(~ok | (lat > slo))) if lat.size else None,
           "throughput_rps": float(ok.sum() / duration), "client_cpu": out["client_cpu"],
           "server_cpu": out["server_cpu_s"] / duration, "final_config": metrics.get("config"),
           "scheduler": metrics.get("scheduler"), "switches": len(metrics.get("switches", []))}
    starts = segment_starts(args.trace_segments) + [float("inf")]
    doc["segments"] = []
    for k in range(len(args.trace_segments)):
        m = (times >= starts[k]) & (times < starts[k + 1])
        s_ok = m & ok
        doc["segments"].append({"p95_ms": _pct(lat[s_ok] * 1e3, 95),
                                "violation_rate": float(np.mean(~ok[m] | (lat[m] > slo))) if m.any() else None})
    if tables:
        if name == "oracle":   # the configuration it applied for the rate of the moment
            labels = [_best_row(tables, rate_at(args.trace_segments, t))["config"] for t in times]
        else:
            labels = _config_at(metrics.get("switches", []), out["sent"], metrics.get("config"))
        doc["changes"] = _changes(args, times, out["sent"], labels, tables)
    return doc


def _f(v, fmt=".1f") -> str:
    return "-" if v is None else format(v, fmt)


def format_table(results: list[dict], args) -> str:
    lines = [f"trace {args.trace} (requests/s:seconds), SLO p95 <= {args.slo_ms:g} ms, near = within "
             f"{args.within:.0%} of the oracle's offline p95",
             f"{'run':<8} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'viol':>6} {'req/s':>6} {'503':>5} "
             f"{'srv cpu':>7} {'cli cpu':>7}  requests to near, per segment (first/settled)"]
    for r in results:
        changes = " ".join(f"{_f(c['first'], 'd')}/{_f(c['settled'], 'd')}" for c in r.get("changes", []))
        lines.append(f"{r['run']:<8} {_f(r['p50_ms']):>7} {_f(r['p95_ms']):>7} {_f(r['p99_ms']):>7} "
                     f"{r['violation_rate']:>6.1%} {r['throughput_rps']:>6.1f} {r['http_503']:>5d} "
                     f"{r['server_cpu']:>7.2f} {r['client_cpu']:>7.2f}  {changes}")
    return "\n".join(lines)


def format_replay(replayed: dict, args) -> str:
    """The replay's medians: requests to near after each segment's start, per tuner."""
    lines = [f"replay on the offline tables ({args.replay_seeds} seeds): median requests to near (settled), per "
             "segment; never = seeds that did not settle"]
    for name, r in replayed.items():
        lines.append(f"  {name:<7} " + "  ".join(f"{m:>6.0f} (never {n})" for m, n in zip(r["median"], r["never"])))
    return "\n".join(lines)
