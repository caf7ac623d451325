"""The configuration space: ordinal knobs, configurations as index tuples (dicts of ZeroConfig fields).

A chosen configuration's printed and written forms (``ZeroConfig(...)``, DeepSpeed JSON, ``quantize_comm``
keyword arguments) are :mod:`qcoll.tune.emit`'s."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Knob:
    """One knob: a name and its values in ordinal order (neighbouring values are similar)."""

    name: str
    values: tuple

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"knob name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.values, tuple) or not self.values:
            raise ValueError(f"knob {self.name!r}: values must be a non-empty tuple, got {self.values!r}")


class Space:
    """The product of ``knobs``; a configuration is a tuple of value indices (ordinal coordinates)."""

    def __init__(self, knobs: list[Knob]):
        if not knobs or not all(isinstance(k, Knob) for k in knobs):
            raise TypeError("knobs must be a non-empty list of qcoll.tune.Knob")
        names = [k.name for k in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"knob names must be unique, got {names}")
        self.knobs = list(knobs)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(k.values) for k in self.knobs)

    def __len__(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def points(self) -> list[tuple[int, ...]]:
        """Every configuration, in lexicographic order."""
        return list(itertools.product(*(range(s) for s in self.shape)))

    def check(self, point) -> tuple[int, ...]:
        point = tuple(point)
        if len(point) != len(self.knobs) or any(not 0 <= i < s for i, s in zip(point, self.shape)):
            raise ValueError(f"{point!r} is not a configuration of a space of shape {self.shape}")
        return point

    def config(self, point) -> dict[str, Any]:
        """``{knob name: value}`` of a configuration."""
        return {k.name: k.values[i] for k, i in zip(self.knobs, self.check(point))}


#: qcoll's ZeRO++ knobs (ZeroConfig field names), in ordinal order.
ZEROPP_KNOBS = [
    Knob("weight_bits", (2, 4, 6, 8, None)),
    Knob("grad_bits", (4, 8, None)),
    Knob("weight_block", (64, 128, 256, 512)),
    Knob("grad_block", (64, 128, 256, 512)),
    Knob("prefetch", (0, 1, 2)),
    Knob("hpz", (False, True)),
]


#: the knobs :class:`qcoll.tune.AutoTune` switches between training steps (ZeroConfig field names): only
#: the wire format, never the layout (``weight_block``, ``persist_threshold`` and ``compute_dtype`` are
#: fixed when the model is sharded; :mod:`qcoll.zero.reconfigure`). 384 configurations; a model whose
#: gradients run with error feedback is also offered 2-bit gradients (:func:`online_space`).
ONLINE_KNOBS = [
    Knob("weight_bits", (4, 6, 8, None)),
    Knob("grad_bits", (4, (8, 4), 8, None)),
    Knob("hpz", (False, True)),
    Knob("prefetch", (0, 1, 2)),
    Knob("reduce_bucket_numel", (0, 1_000_000)),
    Knob("hierarchical_gather", (False, True)),
]


#: the gradient width ``online_space(feedback=True)`` adds to the ``grad_bits`` knob (error feedback re-sends
#: what its codes lose)
FEEDBACK_GRAD_BITS = 2


def online_space(knobs: list[Knob] | None = None, feedback: bool = False) -> Space:
    """The space :class:`qcoll.tune.AutoTune` searches by default (``knobs``, default ``ONLINE_KNOBS``).

    ``feedback``: the model's gradients run with error feedback (``ZeroConfig.grad_error_feedback``),
    which re-sends what the codes failed to send: the ``grad_bits`` knob then also offers 2 bits, first
    (the narrowest width, in the knob's ordinal order): ``(2, 4, (8, 4), 8, None)``, 480 configurations
    from ``ONLINE_KNOBS``. A knob that has 2 already, or a space without a ``grad_bits`` knob, is kept
    as it is."""
    if not isinstance(feedback, bool):
        raise TypeError(f"feedback must be a bool, got {feedback!r}")
    knobs = list(knobs or ONLINE_KNOBS)
    if feedback:
        knobs = [Knob(k.name, (FEEDBACK_GRAD_BITS, *k.values))
                 if k.name == "grad_bits" and FEEDBACK_GRAD_BITS not in k.values else k for k in knobs]
    return Space(knobs)


def config_label(config: dict) -> str:
    """A short label of a configuration of ZeroConfig fields, e.g. ``w8 g4 hpz pf1 b0 hier``."""
    names = {"weight_bits": "w", "grad_bits": "g", "prefetch": "pf", "reduce_bucket_numel": "b",
             "weight_block": "wb", "grad_block": "gb"}
    flags = {"hpz": "hpz", "hierarchical_gather": "hier"}
    parts = []
    for k, v in config.items():
        if k in flags:
            parts.append(flags[k] if v else f"no-{flags[k]}")
        elif k == "grad_bits" and isinstance(v, tuple):
            parts.append(f"g{v[0]}/{v[1]}")
        elif k == "reduce_bucket_numel":
            parts.append(f"b{v // 1000}k" if v else "b0")
        else:
            parts.append(f"{names.get(k, k + '=')}{'-' if v is None else v}")
    return " ".join(parts)


def zeropp_space(knobs: list[Knob] | None = None) -> Space:
    """The ZeRO++ space (``ZEROPP_KNOBS``, or a subset/variant of it)."""
    return Space(list(knobs or ZEROPP_KNOBS))
