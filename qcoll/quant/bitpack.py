"""Packing of signed codes into bytes (two's complement, little-endian in a byte).

Each packed unit is computed from one machine word of codes (two int8 codes as an
int16 for 4 bits, four as an int32 for 2 and 6 bits), so every output element depends
on exactly one input element: the loops vectorize, eager and under torch.compile
(gathering codes at strides of 2 or 4 made inductor's CPU loops 4-7x slower). Bytes
are little-endian, so code ``j`` of a word is its byte ``j``.
"""
from __future__ import annotations

import sys

import torch

_BITS = (8, 6, 4, 2)
if sys.byteorder != "little":  # the dtype views below (and the wire format's fp32 scales) assume it
    raise ImportError("qcoll's wire format is little-endian; this host is big-endian")


def _check(t: torch.Tensor, bits: int, name: str, multiple: int) -> None:
    if bits not in _BITS:
        raise ValueError(f"bits must be one of {_BITS}, got {bits}")
    if t.dim() < 1 or t.shape[-1] % multiple:
        raise ValueError(f"{name} must have a last dimension that is a multiple of {multiple} for "
                         f"{bits}-bit codes, got shape {tuple(t.shape)}")


def _aligned(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Contiguous, with a storage offset that a dtype view of ``nbytes``-byte elements accepts."""
    t = t.contiguous()
    if torch.compiler.is_compiling():  # traced: the views are functional, and the query would break the graph
        return t
    return t.clone() if t.storage_offset() % nbytes else t


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int8 codes ``[..., m]`` into uint8 ``[..., m*bits/8]`` (m a multiple of the codes
    in a packed unit: 2 for 4 bits, 4 for 2 bits, 16 for 6 bits)."""
    _check(q, bits, "q", {8: 1, 6: 16, 4: 2, 2: 4}.get(bits, 1))
    q = _aligned(q, 4)
    if bits == 8:
        return q.view(torch.uint8)
    lead, m = q.shape[:-1], q.shape[-1]
    if q.numel() == 0:  # (dtype views of an empty tensor need strides it may not have)
        return torch.empty(*lead, m * bits // 8, dtype=torch.uint8, device=q.device)
    if bits == 4:  # two codes (the bytes of an int16) -> one byte, code 0 in the low nibble
        w = q.view(torch.int16).to(torch.int32)
        return ((w & 0xF) | ((w >> 4) & 0xF0)).to(torch.uint8)
    w = q.view(torch.int32)  # four codes, code j in byte j
    if bits == 2:
        return ((w & 0x3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0)).to(torch.uint8)
    # 6 bits: four codes -> a 24-bit group; four groups -> three int32 words (12 bytes)
    v = ((w & 0x3F) | ((w >> 2) & 0xFC0) | ((w >> 4) & 0x3F000) | ((w >> 6) & 0xFC0000)).reshape(*lead, m // 16, 4)
    g0, g1, g2, g3 = v[..., 0], v[..., 1], v[..., 2], v[..., 3]
    words = torch.stack((g0 | (g1 << 24), (g1 >> 8) | (g2 << 16), (g2 >> 16) | (g3 << 8)), dim=-1)
    return words.reshape(*lead, 3 * m // 16).view(torch.uint8)


def _code_byte(field: torch.Tensor, bits: int) -> torch.Tensor:
    """The low ``bits`` of int32 ``field`` sign-extended, as the byte value (0..255) of an int8."""
    half = 1 << (bits - 1)
    return (((field & ((1 << bits) - 1)) ^ half) - half) & 0xFF


def unpack_codes(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., k]`` (k a multiple of 3 for 6 bits) ->
    int8 codes ``[..., k*8/bits]``."""
    _check(b, bits, "b", 3 if bits == 6 else 1)
    b = b.contiguous()
    if bits == 8:
        return b.view(torch.int8)
    lead, k = b.shape[:-1], b.shape[-1]
    if b.numel() == 0:
        return torch.empty(*lead, k * 8 // bits, dtype=torch.int8, device=b.device)
    if bits == 4:  # one byte -> two codes, the bytes of an int16
        w = b.to(torch.int32)
        pair = (_code_byte(w, 4) | (_code_byte(w >> 4, 4) << 8)).to(torch.int16)
        return pair.view(torch.int8)
    if bits == 2:  # one byte -> four codes, the bytes of an int32
        w = b.to(torch.int32)
        quad = _code_byte(w, 2) | (_code_byte(w >> 2, 2) << 8) | (_code_byte(w >> 4, 2) << 16) \
            | (_code_byte(w >> 6, 2) << 24)
        return quad.view(torch.int8)
    g = b.reshape(*lead, k // 3, 3).to(torch.int32)  # 6 bits: three bytes -> four codes
    v = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    quad = _code_byte(v, 6) | (_code_byte(v >> 6, 6) << 8) | (_code_byte(v >> 12, 6) << 16) \
        | (_code_byte(v >> 18, 6) << 24)
    return quad.view(torch.int8)
