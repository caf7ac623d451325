"""Torch reference implementation of the wire format, vectorized, for any device.

Everything works on *rows*: a 2-D input ``[rows, n]`` becomes ``rows`` packed
buffers of identical size, each quantized on its own (its own padding, element
indices restarting at ``offset``). A plain tensor is one row; qgZ's destination
slices are many.
"""
from __future__ import annotations

import torch

from . import compiled
from . import format as fmt
from .bitpack import pack_codes, unpack_codes
from .rng import uniform


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``[rows, n]`` -> zero-padded ``[rows, num_blocks, block_size]``."""
    rows, n = x.shape
    nb = fmt.num_blocks(n, block_size)
    pad = nb * block_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, nb, block_size)


def quantize_rows(
    x: torch.Tensor,
    bits: int,
    block_size: int,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """Quantize and pack each row of ``x`` ``[rows, n]``; returns uint8 ``[rows, packed_nbytes(n)]``.

    ``offset`` is the element index of column 0 for the stochastic-rounding hash.
    """
    rows, n = x.shape
    xb = _blocks(x.to(torch.float32), block_size)
    if not stochastic and compiled.enabled(x.device, x.numel()):
        fast = compiled.quantize_blocks(xb, bits)
        if fast is not None and not bool(fast[2]):  # blocks in the subnormal range take the eager path
            return torch.cat(fast[:2], dim=1)
    absmax = xb.abs().amax(dim=-1) if n else xb.new_zeros(rows, 0)
    finite = torch.isfinite(absmax)
    qm = torch.full_like(absmax, fmt.qmax(bits))
    scale = absmax / qm
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), qm / absmax)
    t = xb * inv.unsqueeze(-1)
    tiny = torch.isinf(inv) & finite
    if bool(tiny.any()):
        t = torch.where(tiny.unsqueeze(-1), torch.nan_to_num(xb / scale.unsqueeze(-1), nan=0.0), t)
    if stochastic:
        u = uniform(seed, offset, xb.shape[1] * block_size, x.device).reshape(1, -1, block_size)
        t = torch.floor(t + u)
    else:
        t = torch.round(t)
    q = t.clamp_(-fmt.qmax(bits), fmt.qmax(bits))
    q = torch.where(finite.unsqueeze(-1), q, torch.zeros_like(q)).to(torch.int8)
    scale_bits = torch.where(
        finite, scale.view(torch.int32), torch.full_like(scale, 0, dtype=torch.int32) + fmt.NAN_SCALE_BITS
    )
    codes = pack_codes(q.reshape(rows, -1), bits)
    return torch.cat((codes, scale_bits.view(torch.uint8).reshape(rows, -1)), dim=1)


def split_rows(buf: torch.Tensor, n: int, bits: int, block_size: int):
    """Views of the codes ``[rows, codes_nbytes]`` and fp32 scales ``[rows, num_blocks]``."""
    cb = fmt.codes_nbytes(n, bits, block_size)
    codes = buf[..., :cb]
    if cb == buf.shape[-1]:  # no blocks at all (n == 0)
        return codes, buf.new_empty(*buf.shape[:-1], 0, dtype=torch.float32)
    scales = buf[..., cb:].contiguous().view(torch.float32)
    return codes, scales


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` live in one storage (decoding into ``a`` might overwrite ``b``
    before it is read; disjoint parts of one storage just take the slower, safe path)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def dequantize_rows_into(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., packed_nbytes(n)]`` -> ``out`` ``[..., n]`` (fp32, bf16 or fp16), values
    saturated to the fp32 range, converted to ``out``'s dtype; returns ``out``."""
    lead = buf.shape[:-1]
    if tuple(out.shape) != (*lead, n):
        raise ValueError(f"out must have shape {(*lead, n)}, got {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    if not out.is_contiguous() or _shares_memory(out, buf):
        return out.copy_(dequantize_rows_fp32(buf, n, bits, block_size))
    codes, scales = split_rows(buf, n, bits, block_size)
    codes = codes.reshape(-1, codes.shape[-1])
    scales = scales.reshape(codes.shape[0], -1)
    flat = out.view(codes.shape[0], n)
    if compiled.enabled(buf.device, flat.numel()) and compiled.dequantize_into(codes, scales, bits, block_size, flat):
        return out
    compiled.scale_rows_into(unpack_codes(codes, bits), scales, block_size, flat)
    return out


def dequantize_rows_fp32(buf: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """uint8 ``[..., packed_nbytes(n)]`` -> saturated fp32 values ``[..., n]``."""
    out = torch.empty(*buf.shape[:-1], n, dtype=torch.float32, device=buf.device)
    return dequantize_rows_into(buf, n, bits, block_size, out)


def dequantize_rows(buf: torch.Tensor, n: int, bits: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n)]`` -> ``[rows, n]`` in ``dtype``."""
    out = torch.empty(*buf.shape[:-1], n, dtype=dtype, device=buf.device)
    return dequantize_rows_into(buf, n, bits, block_size, out)


def swizzle_quantize(
    x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int,
    stochastic: bool = False, seed: int = 0, offset: int = 0,
) -> torch.Tensor:
    """qgZ step 1: view flat ``x`` as ``[N, L, S]``, reorder to ``[L, N, S]`` and quantize each slice.

    Returns uint8 ``[L * N, packed_nbytes(S)]``: row ``l * N + n`` holds slice ``(n, l)``.
    """
    s = x.numel() // (nodes * local)
    rows = x.reshape(nodes, local, s).transpose(0, 1).reshape(local * nodes, s)
    return quantize_rows(rows, bits, block_size, stochastic, seed, offset)


def dequantize_reduce(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``: the sum over k, accumulated in order."""
    vals = dequantize_rows_fp32(bufs, n, bits, block_size)
    acc = vals[0].clone()
    for j in range(1, vals.shape[0]):
        acc += vals[j]
    return acc


def reduce_requantize(
    bufs: torch.Tensor, n: int, bits_in: int, block_in: int, bits_out: int, block_out: int,
    stochastic: bool = False, seed: int = 0, offset: int = 0,
) -> torch.Tensor:
    """qgZ between hops: dequantize k packed row sets, sum in fp32, quantize the sum."""
    total = dequantize_reduce(bufs, n, bits_in, block_in)
    return quantize_rows(total, bits_out, block_out, stochastic, seed, offset)
