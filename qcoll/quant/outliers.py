"""Outlier reserve ("spike reserving", FlashCommunication V2): each block keeps its ``k``
largest-magnitude elements exactly, beside the codes (docs/FORMAT.md, "Outlier reserve").

A row with reserve ``k`` is the plain packed row of the values with each block's ``k``
reserved elements set to 0 (so the block's scale comes from what remains), followed by
the reserved elements' positions (u16 within the block, the section padded to a
multiple of 4 bytes) and their values (fp32). The selection is by ``|x|`` descending,
ties to the lower index, NaN first, then infinities (a stable sort), over the block's
padded elements; a padding position is never written back. The plain codec (the torch
reference or the CUDA kernels, through :mod:`qcoll.quant.rows`) does the quantizing, so
the bytes agree across devices exactly when the selection does.
"""
from __future__ import annotations

import torch

from ..checks import check_int
from . import format as fmt
from . import rows

#: The largest reserve per block the frame header can carry.
MAX_OUTLIERS = 8


def check_outliers(k, block_size: int, name: str = "outliers") -> int:
    """``k`` as an int in [0, min(MAX_OUTLIERS, block_size)]; TypeError/ValueError naming ``name``."""
    return check_int(k, name, minimum=0, maximum=min(MAX_OUTLIERS, block_size))


def positions_nbytes(n: int, block_size: int, k: int) -> int:
    """Bytes of the positions section: ``num_blocks * k`` u16, padded to a multiple of 4."""
    return -(-fmt.num_blocks(n, block_size) * k * 2 // 4) * 4


def reserve_nbytes(n: int, block_size: int, k: int) -> int:
    """Bytes the reserve adds to a packed row of ``n`` elements."""
    return positions_nbytes(n, block_size, k) + fmt.num_blocks(n, block_size) * k * 4


def packed_nbytes(n: int, bits: int, block_size: int, k: int) -> int:
    """One packed row with reserve ``k`` (the plain row when ``k == 0``)."""
    return fmt.packed_nbytes(n, bits, block_size) + reserve_nbytes(n, block_size, k)


def _padded_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    r, n = x.shape
    nb = fmt.num_blocks(n, block_size)
    out = x.new_zeros(r, nb * block_size)
    out[:, :n] = x
    return out.view(r, nb, block_size)


def select(x: torch.Tensor, block_size: int, k: int):
    """fp32 ``[rows, n]`` -> (positions int64 ``[rows, nb, k]``, values fp32 ``[rows, nb, k]``,
    the rest fp32 ``[rows, n]`` with the reserved elements set to 0)."""
    r, n = x.shape
    xb = _padded_blocks(x.to(torch.float32), block_size)
    pos = torch.sort(xb.abs(), dim=-1, descending=True, stable=True).indices[..., :k]
    values = torch.gather(xb, -1, pos)
    rest = xb.scatter(-1, pos, 0.0).reshape(r, -1)[:, :n]
    return pos, values, rest


def quantize_rows(x: torch.Tensor, bits: int, block_size: int, k: int, stochastic: bool = False, seed: int = 0,
                  offset: int = 0) -> torch.Tensor:
    """float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n, bits, block_size, k)]``."""
    if k == 0:
        return rows.quantize_rows(x, bits, block_size, stochastic, seed, offset)
    r, n = x.shape
    pos, values, rest = select(x, block_size, k)
    base = rows.quantize_rows(rest, bits, block_size, stochastic, seed, offset)
    pos_bytes = torch.zeros(r, positions_nbytes(n, block_size, k), dtype=torch.uint8, device=x.device)
    if pos.numel():
        pos_bytes[:, : pos[0].numel() * 2] = pos.to(torch.int16).reshape(r, -1).view(torch.uint8)
    return torch.cat((base, pos_bytes, values.reshape(r, -1).view(torch.uint8)), dim=1)


def dequantize_rows_fp32(buf: torch.Tensor, n: int, bits: int, block_size: int, k: int) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n, bits, block_size, k)]`` -> fp32 ``[rows, n]``."""
    base_n = fmt.packed_nbytes(n, bits, block_size)
    base = rows.dequantize_rows(buf[:, :base_n].contiguous(), n, bits, block_size, torch.float32)
    if k == 0:
        return base
    r, nb = buf.shape[0], fmt.num_blocks(n, block_size)
    p0, p1 = base_n, base_n + positions_nbytes(n, block_size, k)
    pos = buf[:, p0:p0 + nb * k * 2].contiguous().view(torch.int16).reshape(r, nb, k).to(torch.int64)
    values = buf[:, p1:].contiguous().view(torch.float32).reshape(r, nb, k)
    out = _padded_blocks(base, block_size).scatter(-1, pos, values)
    return out.reshape(r, -1)[:, :n]


def dequantize_rows(buf: torch.Tensor, n: int, bits: int, block_size: int, k: int, dtype: torch.dtype):
    """Like :func:`dequantize_rows_fp32`, cast (round to nearest even) to ``dtype``."""
    out = dequantize_rows_fp32(buf, n, bits, block_size, k)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_reduce(bufs: torch.Tensor, n: int, bits: int, block_size: int, k: int) -> torch.Tensor:
    """uint8 ``[j, rows, nbytes]`` -> fp32 ``[rows, n]``: the sum over ``j`` as a left fold in order."""
    if k == 0:
        return rows.dequantize_reduce(bufs, n, bits, block_size)
    acc = dequantize_rows_fp32(bufs[0], n, bits, block_size, k).clone()
    for j in range(1, bufs.shape[0]):
        acc += dequantize_rows_fp32(bufs[j], n, bits, block_size, k)
    return acc


def reduce_requantize(bufs: torch.Tensor, n: int, bits_in: int, bits_out: int, block_size: int, k: int,
                      stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """qgZ between the hops with reserve ``k``: dequantize, sum in fp32, quantize the sum."""
    if k == 0:
        return rows.reduce_requantize(bufs, n, bits_in, block_size, bits_out, block_size, stochastic, seed, offset)
    total = dequantize_reduce(bufs, n, bits_in, block_size, k)
    return quantize_rows(total, bits_out, block_size, k, stochastic, seed, offset)


def swizzle_quantize(x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int, k: int,
                     stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """qgZ hop 1: flat ``x`` as ``[N, L, S]`` -> uint8 ``[L*N, packed row]``, row ``l*N+n`` = slice ``(n, l)``."""
    if k == 0:
        return rows.swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)
    s = x.numel() // (nodes * local)
    slices = x.reshape(nodes, local, s).transpose(0, 1).reshape(local * nodes, s)
    return quantize_rows(slices, bits, block_size, k, stochastic, seed, offset)
