"""Torch reference implementation of the wire format (docs/FORMAT.md): the oracle.

Plain eager torch, vectorized, for any device; the CUDA kernels (:mod:`qcoll.bindings`) and
the compiled CPU path (:mod:`qcoll.quant.compiled`) must reproduce its bytes. It imports
neither: :mod:`qcoll.quant.rows` picks which one runs.

Everything works on *rows*: a 2-D input ``[rows, n]`` becomes ``rows`` packed
buffers of identical size, each quantized on its own (its own padding, element
indices restarting at ``offset``). A plain tensor is one row; qgZ's destination
slices are many. Arguments are not checked here (the public entry points do that).
"""
from __future__ import annotations

import torch

from . import format as fmt
from .bitpack import pack_codes, unpack_codes
from .rng import uniform
from .hadamard import hadamard_rows  # noqa: F401  (this module's twin of bindings.ops.hadamard_rows)


def pad_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
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
    xb = pad_blocks(x.to(torch.float32), block_size)
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
    if not direct_out(buf, n, out):
        return out if out.numel() == 0 else out.copy_(dequantize_rows_fp32(buf, n, bits, block_size))
    codes, scales = row_sections(buf, n, bits, block_size)
    scale_rows_into(unpack_codes(codes, bits), scales, block_size, out.view(codes.shape[0], n))
    return out


def direct_out(buf: torch.Tensor, n: int, out: torch.Tensor) -> bool:
    """Whether values can be written straight into ``out``, which must be ``[..., n]`` for ``buf``'s
    rows (else ``ValueError``): False when ``out`` is empty, not contiguous or shares ``buf``'s storage."""
    lead = buf.shape[:-1]
    if tuple(out.shape) != (*lead, n):
        raise ValueError(f"out must have shape {(*lead, n)}, got {tuple(out.shape)}")
    return out.numel() > 0 and out.is_contiguous() and not _shares_memory(out, buf)


def row_sections(buf: torch.Tensor, n: int, bits: int, block_size: int):
    """uint8 ``[..., nbytes]`` -> codes ``[rows, codes_nbytes]`` and fp32 scales ``[rows, num_blocks]``
    (the leading dimensions flattened into ``rows``)."""
    codes, scales = split_rows(buf, n, bits, block_size)
    codes = codes.reshape(-1, codes.shape[-1])
    return codes, scales.reshape(codes.shape[0], -1)


def scale_into(q3: torch.Tensor, scales: torch.Tensor, out3: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[rows, nb, w]`` x fp32 scales ``[rows, nb]`` -> ``out3`` (any float dtype),
    saturated to the fp32 range. ``w`` is the block size (or a last block's length)."""
    v = q3.to(torch.float32) * scales.unsqueeze(-1)
    return out3.copy_(v.clamp(-fmt.FLT_MAX, fmt.FLT_MAX))


def scale_rows_into(q: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor,
                    full_blocks=scale_into) -> bool:
    """int8 codes ``[rows, >= n]``, fp32 scales ``[rows, nb]`` -> ``out`` ``[rows, n]`` (its last
    dimension contiguous): the whole blocks through ``full_blocks`` (:func:`scale_into` or a
    compiled twin; None from it means failure, and False is returned), the partial last block
    through :func:`scale_into`."""
    rows, n = out.shape
    full = n // block_size
    if full:
        q3 = q[:, : full * block_size].view(rows, full, block_size)
        out3 = out[:, : full * block_size].view(rows, full, block_size)
        if full_blocks(q3, scales[:, :full], out3) is None:
            return False
    if n > full * block_size:
        scale_into(q[:, full * block_size: n].unsqueeze(1), scales[:, full: full + 1],
                   out[:, full * block_size:].unsqueeze(1))
    return True


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
    return quantize_rows(swizzle_rows(x, nodes, local), bits, block_size, stochastic, seed, offset)


def swizzle_rows(x: torch.Tensor, nodes: int, local: int) -> torch.Tensor:
    """Flat ``x`` viewed as ``[N, L, S]`` -> ``[L * N, S]``, row ``l * N + n`` = slice ``(n, l)``."""
    s = x.numel() // (nodes * local)
    return x.reshape(nodes, local, s).transpose(0, 1).reshape(local * nodes, s)


def dequantize_reduce(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``: the sum over k, accumulated in order."""
    return sum_in_order(dequantize_rows_fp32(bufs, n, bits, block_size))


def sum_in_order(vals: torch.Tensor) -> torch.Tensor:
    """fp32 ``[k, rows, n]`` -> ``[rows, n]``: ``((v0 + v1) + v2) + ...``, the kernels' order."""
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
