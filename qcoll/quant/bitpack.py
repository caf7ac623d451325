"""Packing of signed codes into bytes (two's complement, little-endian in a byte)."""
from __future__ import annotations

import torch


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int8 codes ``[..., m]`` (m a multiple of 4) into uint8 ``[..., m*bits/8]``."""
    u = q.view(torch.uint8)
    if bits == 8:
        return u
    lead = u.shape[:-1]
    if bits == 4:
        g = (u & 0xF).reshape(*lead, -1, 2)
        return (g[..., 0] | (g[..., 1] << 4)).reshape(*lead, -1)
    if bits == 2:
        g = (u & 0x3).reshape(*lead, -1, 4)
        return (g[..., 0] | (g[..., 1] << 2) | (g[..., 2] << 4) | (g[..., 3] << 6)).reshape(*lead, -1)
    if bits == 6:
        g = (u & 0x3F).to(torch.int32).reshape(*lead, -1, 4)
        v = g[..., 0] | (g[..., 1] << 6) | (g[..., 2] << 12) | (g[..., 3] << 18)
        out = torch.stack((v & 0xFF, (v >> 8) & 0xFF, v >> 16), dim=-1)
        return out.to(torch.uint8).reshape(*lead, -1)
    raise ValueError(f"bits must be one of (8, 6, 4, 2), got {bits}")


def _sign_extend(c: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values holding ``bits``-bit two's complement codes -> int8."""
    half = 1 << (bits - 1)
    return ((c.to(torch.int16) ^ half) - half).to(torch.int8)


def unpack_codes(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., k]`` -> int8 codes ``[..., k*8/bits]``."""
    if bits == 8:
        return b.view(torch.int8)
    lead = b.shape[:-1]
    if bits == 4:
        c = torch.stack((b & 0xF, b >> 4), dim=-1)
    elif bits == 2:
        c = torch.stack((b & 0x3, (b >> 2) & 0x3, (b >> 4) & 0x3, b >> 6), dim=-1)
    elif bits == 6:
        g = b.to(torch.int32).reshape(*lead, -1, 3)
        v = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
        c = torch.stack((v & 0x3F, (v >> 6) & 0x3F, (v >> 12) & 0x3F, v >> 18), dim=-1)
    else:
        raise ValueError(f"bits must be one of (8, 6, 4, 2), got {bits}")
    return _sign_extend(c.reshape(*lead, -1), bits)
