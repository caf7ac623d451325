"""The counter-based hash behind stochastic rounding (docs/FORMAT.md), in torch.

All values are int64 tensors holding unsigned 32-bit numbers; products are split
so that nothing overflows int64, which makes the result exact on every device.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B


def mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for uint32 values held in int64, without overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (a * c_lo + (((a * c_hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = mul32(x, MIX_C2)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """mix32 for one Python int (host-side: seeds, frame check values), in plain integers."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_C1) & MASK32
    x ^= x >> 15
    x = (x * MIX_C2) & MASK32
    return x ^ (x >> 16)


def uniform(seed: int, offset: int, count: int, device) -> torch.Tensor:
    """fp32 ``u`` in [0, 1) for element indices ``offset .. offset+count-1``."""
    idx = torch.arange(offset, offset + count, dtype=torch.int64, device=device)
    lo = idx & MASK32
    if offset + count > 2**32:
        inner = mix32(mix32(idx >> 32) ^ (seed & MASK32))
    else:  # mix(0) == 0, so the high word contributes nothing
        inner = mix32_int(seed)
    h = mix32(lo ^ inner)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def rank_seed(seed: int, rank: int) -> int:
    """The per-rank seed of qgZ: mix(seed ^ mix(rank + 1))."""
    return mix32_int((seed & MASK32) ^ mix32_int(rank + 1))
