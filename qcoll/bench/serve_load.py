"""The load generator of ``qcoll-bench serve``: open-loop Poisson arrivals whose rate follows a trace.

A trace is segments ``RATE:SECONDS`` (a constant rate) or ``FROM-TO:SECONDS`` (a linear ramp),
e.g. ``20:60,60:60,20:60``. Arrival times are drawn in advance (a non-homogeneous Poisson
process by thinning, seeded), and each request is sent at its time whether or not earlier ones
were answered (open loop: a slow server meets the same load, as it would in production). One
asyncio loop and aiohttp sessions with keep-alive connections: the client's own CPU time is
measured (``client_cpu``, a share of one core), because on this 2-core machine it competes with
the server.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    rate_from: float
    rate_to: float
    seconds: float

    def rate(self, t: float) -> float:
        return self.rate_from + (self.rate_to - self.rate_from) * (t / self.seconds)

    @property
    def mean_rate(self) -> float:
        return (self.rate_from + self.rate_to) / 2


def parse_trace(text: str) -> list[Segment]:
    """``"20:60,10-60:30"`` -> segments (rates in requests/s, durations in s); ValueError naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a trace is RATE:SECONDS or FROM-TO:SECONDS segments joined by commas, got {text!r}")
    out = []
    for part in text.split(","):
        try:
            rates, seconds = part.split(":")
            lo, _, hi = rates.partition("-")
            seg = Segment(float(lo), float(hi or lo), float(seconds))
        except ValueError:
            raise ValueError(f"trace segment {part!r}: expected RATE:SECONDS or FROM-TO:SECONDS") from None
        if not (seg.rate_from >= 0 and seg.rate_to >= 0 and max(seg.rate_from, seg.rate_to) > 0 and seg.seconds > 0
                and np.isfinite([seg.rate_from, seg.rate_to, seg.seconds]).all()):
            raise ValueError(f"trace segment {part!r}: rates must be >= 0 (not both 0) and seconds > 0")
        out.append(seg)
    return out


def arrivals(trace: list[Segment], seed: int = 0) -> np.ndarray:
    """Arrival times (s from the start) of a Poisson process whose rate follows ``trace`` (thinning)."""
    rng = np.random.default_rng(seed)
    times, start = [], 0.0
    for seg in trace:
        peak = max(seg.rate_from, seg.rate_to)
        n = rng.poisson(peak * seg.seconds)
        t = np.sort(rng.uniform(0, seg.seconds, n))
        keep = rng.uniform(0, peak, n) < np.array([seg.rate(x) for x in t])
        times.append(start + t[keep])
        start += seg.seconds
    return np.concatenate(times) if times else np.zeros(0)


def segment_starts(trace: list[Segment]) -> list[float]:
    return list(np.cumsum([0.0] + [s.seconds for s in trace])[:-1])


def rate_at(trace: list[Segment], t: float) -> float:
    """The trace's rate ``t`` seconds from its start (its last rate after its end)."""
    for start, seg in zip(segment_starts(trace), trace):
        if t < start + seg.seconds:
            return seg.rate(max(t - start, 0.0))
    return trace[-1].rate_to


async def _run(url: str, times: np.ndarray, body: bytes, connections: int, timeout_s: float) -> dict:
    import aiohttp

    n = len(times)
    sent, latency, status = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=np.int32)
    connector = aiohttp.TCPConnector(limit=connections)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(i: int) -> None:
            t0 = time.monotonic()
            sent[i] = t0
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    status[i] = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status[i] = -1
            latency[i] = time.monotonic() - t0

        start = time.monotonic() + 0.2
        tasks = []
        for i, t in enumerate(times):
            delay = start + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return {"start": start, "sent": sent, "latency": latency, "status": status}


def run_load(url: str, times: np.ndarray, body: bytes, connections: int = 256, timeout_s: float = 30.0) -> dict:
    """Send ``body`` (JSON) to ``url`` at ``times`` (s from now + 0.2 s); per request: the monotonic
    time it was sent, its latency (s, to the last byte of the answer) and HTTP status (-1: no
    answer). ``client_cpu``: the client's CPU seconds over the wall seconds (1.0 = one core)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    out = asyncio.run(_run(url, np.asarray(times, dtype=float), body, connections, timeout_s))
    out["client_cpu"] = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    return out
