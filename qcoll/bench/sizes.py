"""Parsing and printing of byte sizes (``1K``, ``64M``, ``1G``; binary units)."""
from __future__ import annotations

import argparse

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``'64M'`` -> 67108864 (``K``/``M``/``G`` are powers of 1024; ``KB``, ``KiB`` too).

    Raises ``argparse.ArgumentTypeError`` on anything that is not a positive
    finite size, so argparse reports it as a one-line usage error.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B") if text else ""
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1K, 64M, 1G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def sweep(lo: int, hi: int, factor: int) -> list[int]:
    """``lo, lo*factor, lo*factor**2, ...`` up to ``hi`` inclusive (``factor >= 2``)."""
    if factor < 2:
        raise ValueError(f"factor must be at least 2, got {factor}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out
