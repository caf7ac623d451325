"""Real text that ships with every machine: the Python standard library's own sources."""
from __future__ import annotations

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


class Batches:
    """Deterministic batches of ``(input, target)`` windows; rank ``r`` of ``world`` takes
    its contiguous ``batch // world`` rows of the same global batch."""

    def __init__(self, data: torch.Tensor, batch: int, context: int, seed: int = 0):
        if batch < 1 or context < 1:
            raise ValueError(f"batch and context must be positive, got {batch}, {context}")
        self.data, self.batch, self.context = data, batch, context
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch % world:
            raise ValueError(f"batch {self.batch} is not divisible by the world size {world}")
        starts = torch.randint(0, self.data.numel() - self.context - 1, (self.batch,), generator=self.gen)
        rows = torch.stack([self.data[s: s + self.context + 1] for s in starts.tolist()])
        per = self.batch // world
        mine = rows[rank * per: (rank + 1) * per]
        return mine[:, :-1], mine[:, 1:]

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)
