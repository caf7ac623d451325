"""What ``qcoll-bench collectives`` measured, for a newcomer: a legend of the columns and a
summary of the bytes saved and the link bandwidth below which each quantized collective pays.

On one host the links are loopback: the quantized collectives' extra CPU work (quantize,
dequantize) is all there is to see, so they come out slower than fp32. On a link of ``R``
bytes/s per rank a call takes about its measured time plus its wire bytes over ``R``;
the quantized call (``t_q``, ``B_q``) beats the baseline (``t_b``, ``B_b``) when
``t_q + B_q / R < t_b + B_b / R``, i.e. below ``R = (B_b - B_q) / (t_q - t_b)``.
"""
from __future__ import annotations

import math

from .sizes import format_size

LEGEND = """columns:
  op        all_gather; replica_gather (hpZ's node-local backward gather); reduce_scatter
  variant   fp32, bf16: unquantized; qwZ<b>: <b>-bit weight all-gather; hpZ8: gather of the secondary
            shard a qwZ8 gather kept; qgZ<b>[x<k>]: <b>-bit 2-hop reduce-scatter [k chunks]; -raw: no headers
  size      bytes of the fp32 tensor (all-gather output, reduce-scatter input), equal across variants
  count     its elements
  type      the dtype the caller passes and gets back
  time(us)  one call: the slowest rank's median over --iters
  algbw     size / time (GB/s)
  busbw     algbw x (g-1)/g, g the group's ranks (as nccl-tests)
  wire(B)   bytes this rank hands to other ranks in one call
  hdr(B)    of them, frame headers (16 B per quantized buffer sent)
  ratio     wire bytes / the same op's fp32 wire bytes (replica_gather: the fp32 all-gather's)
  max_err   max |out - fp32 out| / max |fp32 out|, over all ranks
  mean_err  mean |out - fp32 out| / max |fp32 out|, over all ranks"""

WHERE_IT_PAYS = ("see it pay on slower links (an emulated 2 x 2 cluster; root, iproute2): "
                 "qcoll-bench cluster --link 100mbit 1gbit -- collectives")


def break_even_bits_per_s(t_q: float, bytes_q: float, t_b: float, bytes_b: float) -> float:
    """The link bandwidth per rank (bits/s) below which the quantized call (``t_q`` seconds
    measured, ``bytes_q`` on the wire) is faster than the baseline (``t_b``, ``bytes_b``):
    ``inf`` when it is faster at every bandwidth, 0 when at none."""
    saved, extra = bytes_b - bytes_q, t_q - t_b
    if saved <= 0:
        return 0.0 if extra >= 0 else math.inf
    if extra <= 0:
        return math.inf
    return 8 * saved / extra


def format_rate(bits_per_s: float) -> str:
    """A break-even for the summary: ``inf`` -> 'always', 0 -> 'never', else Mbit/s (Gbit/s from 1 Gbit/s)."""
    if math.isinf(bits_per_s):
        return "always"
    if bits_per_s <= 0:
        return "never"
    if bits_per_s >= 1e9:
        return f"{bits_per_s / 1e9:.2f} Gbit/s"
    return f"{bits_per_s / 1e6:.1f} Mbit/s"


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per quantized variant at the largest size measured: bytes against fp32 and bf16 and the
    break-evens (bits/s, :func:`break_even_bits_per_s`). The bf16 baselines are the measured
    ``bf16`` rows; where an op has none (rows of an older run), its bf16 bytes are half the fp32
    bytes and its time is taken as fp32's (``bf16_measured`` False). ``hpZ8`` compares with the
    all-gathers (it replaces a backward all-gather)."""
    size = max(r["size"] for r in rows)
    at = [r for r in rows if r["size"] == size and not r["variant"].endswith("-raw")]
    out = []
    for op, base_op in (("all_gather", "all_gather"), ("replica_gather", "all_gather"),
                        ("reduce_scatter", "reduce_scatter")):
        base = {r["variant"]: r for r in at if r["op"] == base_op and r["bits"] is None}
        if "fp32" not in base:
            continue
        fp32 = base["fp32"]
        bf16 = base.get("bf16") or dict(fp32, wire_bytes=fp32["wire_bytes"] / 2, variant="bf16 (fp32's time)")
        for r in (r for r in at if r["op"] == op and r["bits"] is not None):
            t, b = r["time_us"] * 1e-6, r["wire_bytes"]
            out.append({"op": op, "variant": r["variant"], "size": size,
                        "bytes_vs_fp32": b / fp32["wire_bytes"], "bytes_vs_bf16": b / bf16["wire_bytes"],
                        "break_even_vs_fp32": break_even_bits_per_s(t, b, fp32["time_us"] * 1e-6, fp32["wire_bytes"]),
                        "break_even_vs_bf16": break_even_bits_per_s(t, b, bf16["time_us"] * 1e-6, bf16["wire_bytes"]),
                        "bf16_measured": "bf16" in base})
    return out


def format_summary(rows: list[dict], *, on_cluster: bool = False) -> str:
    """The closing summary under the table (see :func:`summary_rows`). ``on_cluster``: the rows
    were measured on ``qcoll-bench cluster``'s rate-limited links, not one host's loopback."""
    summary = summary_rows(rows)
    if not summary:
        return ""
    size = summary[0]["size"]
    lines = [f"summary at size {format_size(size)} ({size // 4} fp32 elements, the largest measured): per quantized "
             f"collective, its wire bytes over the",
             "  unquantized one's, and the link bandwidth per rank below which it is faster: R = (B_base - B_q) / "
             "(t_q - t_base),",
             "  from the times t and bytes B above (on a link of R bytes/s a call takes about t + B/R; 'always': "
             "faster even here)",
             f"{'op':>14} {'variant':>10} {'bytes/fp32':>10} {'bytes/bf16':>10} {'faster than fp32 below':>23} "
             f"{'faster than bf16 below':>23}"]
    for s in summary:
        lines.append(f"{s['op']:>14} {s['variant']:>10} {s['bytes_vs_fp32']:>10.3f} {s['bytes_vs_bf16']:>10.3f} "
                     f"{format_rate(s['break_even_vs_fp32']):>23} {format_rate(s['break_even_vs_bf16']):>23}")
    for op in dict.fromkeys(s["op"] for s in summary if not s["bf16_measured"]):
        lines.append(f"({op} has no bf16 row: its bf16 bytes are taken as half of fp32's, its time as fp32's)")
    if any(s["op"] == "replica_gather" for s in summary):
        lines.append("(hpZ8's bytes all stay inside the node; counted here as if they crossed the slow link)")
    if on_cluster:
        lines.append("Measured across the emulated cluster's rate-limited node links: 'always' = faster on them.")
    else:
        lines.append("Here (one host, loopback) the links cost next to nothing: the codec's CPU time is all there "
                     "is to see.")
        lines.append(WHERE_IT_PAYS)
    return "\n".join(lines)
