"""``--plot FILE.png``: bandwidth vs message size, one line per variant, one panel per op.

matplotlib is optional (the ``plot`` extra) and imported only here, lazily;
:func:`check` runs before any rank starts so a missing matplotlib or an
unsupported file type is a one-line usage error, not a failure after the sweep.
"""
from __future__ import annotations

import os

from .. import files

INSTALL_HINT = "pip install 'qcoll[plot]'"


def check(path: str) -> str | None:
    """Why ``path`` cannot be plotted to (one line), or None when it can."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return f"--plot needs matplotlib, which is not installed ({INSTALL_HINT} or pip install matplotlib)"
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if ext not in supported:
        return f"--plot {path}: unsupported file type {ext or '(none)'!r}; use one of {', '.join(sorted(supported))}"
    return None


def bandwidth(rows: list[dict], path: str, title: str = "", y: str = "algbw_GBs") -> None:
    """Save a figure of ``y`` vs ``size`` with one panel per ``op`` and one line per ``variant``."""
    from matplotlib.figure import Figure  # headless: no pyplot, no GUI backend
    from matplotlib.ticker import FuncFormatter

    from .sizes import format_size

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig = Figure(figsize=(5.0 * max(1, len(ops)), 4.0), layout="constrained")
    axes = fig.subplots(1, max(1, len(ops)), squeeze=False)[0]
    for ax, op in zip(axes, ops):
        mine = [r for r in rows if r["op"] == op]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            pts = sorted((r["size"], r[y]) for r in mine if r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=variant)
        if op == "replica_gather":   # the gather it replaces, for comparison
            pts = sorted((r["size"], r[y]) for r in rows if r["op"] == "all_gather" and r["variant"] == "fp32")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", linewidth=1, label="all_gather fp32")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v)) if v >= 1 else ""))
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes of the fp32 tensor)")
        ax.set_ylabel({"algbw_GBs": "algbw (GB/s)", "busbw_GBs": "busbw (GB/s)"}.get(y, y))
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    save_figure(fig, path)


def save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path`` (its extension the format) atomically, replacing, never following,
    a symlink planted at ``path`` (:func:`qcoll.files.write_atomic`)."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    files.write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=120))
