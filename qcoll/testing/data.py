"""The text the tests and benchmarks train on, and its batches.

Real text that ships with every machine: the Python standard library's own sources
(:func:`stdlib_bytes`, :func:`corpus`). :class:`Batches` draws random windows of it from
a seeded generator; :class:`BatchList` serves batches drawn beforehand (of any tensors)
the same way, so that a sharded run and its single-process oracle see the same data.
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch


def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    """Up to ``limit`` bytes of the top-level ``*.py`` files of the stdlib, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


@functools.lru_cache(maxsize=None)
def corpus(limit: int = 1 << 20) -> torch.Tensor:
    """:func:`stdlib_bytes` of ``limit`` (default 1 MiB, the tests' text), read once per process.
    The same tensor is returned to every caller: read it, do not write it."""
    return stdlib_bytes(limit)


def _rows(n: int, rank: int, world: int) -> slice:
    if n % world:
        raise ValueError(f"batch {n} is not divisible by the world size {world}")
    per = n // world
    return slice(rank * per, (rank + 1) * per)


class Batches:
    """Deterministic batches of ``(input, target)`` windows; rank ``r`` of ``world`` takes
    its contiguous ``batch // world`` rows of the same global batch."""

    def __init__(self, data: torch.Tensor, batch: int, context: int, seed: int = 0):
        if batch < 1 or context < 1:
            raise ValueError(f"batch and context must be positive, got {batch}, {context}")
        self.data, self.batch, self.context = data, batch, context
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch's ``(input, target)`` rows of ``rank``: ``[batch // world, context]`` each.
        Every rank must call it once per step (each call draws the whole global batch)."""
        if self.batch % world:
            raise ValueError(f"batch {self.batch} is not divisible by the world size {world}")
        starts = torch.randint(0, self.data.numel() - self.context - 1, (self.batch,), generator=self.gen)
        rows = torch.stack([self.data[s: s + self.context + 1] for s in starts.tolist()])
        mine = rows[_rows(self.batch, rank, world)]
        return mine[:, :-1], mine[:, 1:]

    def state(self) -> torch.Tensor:
        """The generator's state (to resume the same sequence of batches with :meth:`set_state`)."""
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Continue from a :meth:`state`."""
        self.gen.set_state(state)


class BatchList:
    """Global batches drawn beforehand, served in order like :class:`Batches`: each batch is a
    tuple of tensors (or ``None``) with the batch in dimension 0, and rank ``r`` of ``world``
    takes its contiguous ``1 / world`` of the rows of each tensor."""

    def __init__(self, batches):
        self.batches = [tuple(b) for b in batches]
        self.position = 0

    def __len__(self) -> int:
        return len(self.batches)

    def next(self, rank: int = 0, world: int = 1) -> tuple:
        """The next batch's rows of ``rank`` (``None`` entries stay ``None``)."""
        if self.position >= len(self.batches):
            raise IndexError(f"all {len(self.batches)} batches have been served")
        batch = self.batches[self.position]
        self.position += 1
        return tuple(t if t is None else t[_rows(t.shape[0], rank, world)] for t in batch)
