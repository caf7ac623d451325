"""The integer, number and bool argument checks shared by every public entry point of qcoll.

A leaf module (no qcoll imports). ``bool`` is rejected where an int is wanted (``True`` is
an ``int`` to Python, never a valid count, size or seed here), and ``1`` where a bool is.
"""
from __future__ import annotations

import math


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. Both a ``TypeError`` and, for the callers that have
    always caught ``ValueError`` from a "must be a positive int" check, a ``ValueError``."""


def _describe(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if maximum is not None:
        return f"an int <= {maximum}"
    if minimum == 0:
        return "a non-negative int"
    if minimum == 1:
        return "a positive int"
    if minimum is not None:
        return f"an int >= {minimum}"
    return "an int"


def check_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) in ``[minimum, maximum]`` (either bound optional).

    Raises :class:`ArgumentTypeError` (a ``TypeError`` and a ``ValueError``) for a non-int and
    ``ValueError`` for an int out of range, both naming ``name`` and the value, e.g.
    ``"num_chunks must be a positive int, got 0"``.
    """
    what = _describe(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be {what}, got {value!r:.80} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {what}, got {value!r:.80}")
    return value


def _bounds(minimum, maximum, above, below) -> str:
    low = f"[{minimum}" if minimum is not None else f"({above}" if above is not None else None
    high = f"{maximum}]" if maximum is not None else f"{below})" if below is not None else None
    if low and high:
        return f"a number in {low}, {high}"
    if low:
        return f"a finite number {'>=' if minimum is not None else '>'} {low[1:]}"
    if high:
        return f"a finite number {'<=' if maximum is not None else '<'} {high[:-1]}"
    return "a finite number"


def check_number(value, name: str, *, minimum: float | None = None, maximum: float | None = None,
                 above: float | None = None, below: float | None = None) -> float:
    """``float(value)`` if ``value`` is an ``int`` or ``float`` (not a ``bool``), finite, and within the
    bounds given: ``minimum <= value <= maximum``, ``above < value < below`` (each optional).

    Raises :class:`ArgumentTypeError` (a ``TypeError`` and a ``ValueError``) for a non-number and
    ``ValueError`` for NaN, an infinity or a value out of range, naming ``name``, the range and the
    value, e.g. ``"target must be a number in (-1.0, 1.0), got 1.5"``. An int too large for a float
    is out of range, not an ``OverflowError``.
    """
    what = _bounds(minimum, maximum, above, below)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be {what}, got {value!r:.80} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:
        number = float("inf")
    if (not math.isfinite(number) or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum) or (above is not None and not number > above)
            or (below is not None and not number < below)):
        raise ValueError(f"{name} must be {what}, got {value!r:.80}")
    return number


def check_bool(value, name: str) -> bool:
    """``value`` if it is a ``bool``; else ``TypeError`` naming ``name`` (``1`` and ``None`` are not bools)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def int_option(text: str, minimum: int) -> int:
    """A command-line integer of at least ``minimum`` (for argparse ``type=`` callables):
    ``argparse.ArgumentTypeError`` with a one-line message otherwise."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
    return v
