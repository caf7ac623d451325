"""The codec's row operations on CPU tensors: the native kernel, the compiled path, the reference.

Same functions and signatures as :mod:`qcoll.quant.reference` (and :mod:`qcoll.bindings.ops`);
:mod:`qcoll.quant.rows` calls them for CPU tensors. In order, each byte-identical to the reference:

1. the native C kernel (:mod:`qcoll.bindings.cpu`, ``src/cpu/codec.c``) for the whole blocks of
   round-to-nearest quantize and of dequantize into fp32 or bf16, at 8, 4 and 2 bits, any size
   (a partial last block through the reference); ``QCOLL_NATIVE=0`` turns it off, and a failure
   to build or load it warns once and leaves it off for the rest of the process;
2. the torch.compile'd loops (:mod:`qcoll.quant.compiled`) for round-to-nearest quantize and
   every dequantize of at least :data:`qcoll.quant.compiled.MIN_NUMEL` elements
   (``QCOLL_COMPILE=0`` turns them off);
3. :mod:`qcoll.quant.reference` for everything else, and for what the others decline (blocks in
   the subnormal range). Arguments are not checked here.
"""
from __future__ import annotations

import torch

from qcoll.bindings import cpu as native

from . import compiled, reference
from . import format as fmt
from .bitpack import unpack_codes
from .hadamard import hadamard_rows  # noqa: F401  (the rotation has no compiled path: the reference)


def quantize_rows(x: torch.Tensor, bits: int, block_size: int, stochastic: bool = False, seed: int = 0,
                  offset: int = 0) -> torch.Tensor:
    """float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n)]``."""
    if not stochastic and _native(x.device, bits, block_size, x.shape[-1]):
        fast = _native_quantize(x, bits, block_size)
        if fast is not None:
            return fast if isinstance(fast, torch.Tensor) else reference.quantize_rows(x, bits, block_size)
    if not stochastic and compiled.enabled(x.device, x.numel()):
        fast = compiled.quantize_rows(x, bits, block_size)
        if fast is not None:
            return fast
    return reference.quantize_rows(x, bits, block_size, stochastic, seed, offset)


def dequantize_rows_into(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., packed_nbytes(n)]`` -> ``out`` ``[..., n]`` (fp32, bf16 or fp16); returns ``out``."""
    own = out.numel() > 0 and out.dtype in _NATIVE_OUT and _native(buf.device, bits, block_size, n)
    if not own and not compiled.enabled(buf.device, out.numel()):
        return reference.dequantize_rows_into(buf, n, bits, block_size, out)
    if not reference.direct_out(buf, n, out):  # strided or aliasing out: decode to fp32, then copy
        return out.copy_(dequantize_rows_fp32(buf, n, bits, block_size))
    if own and _native_dequantize(buf, n, bits, block_size, out):
        return out
    if compiled.enabled(buf.device, out.numel()) and compiled.dequantize_rows_into(buf, n, bits, block_size, out):
        return out
    return reference.dequantize_rows_into(buf, n, bits, block_size, out)


def dequantize_rows_fp32(buf: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """uint8 ``[..., packed_nbytes(n)]`` -> fp32 ``[..., n]``."""
    out = torch.empty(*buf.shape[:-1], n, dtype=torch.float32, device=buf.device)
    return dequantize_rows_into(buf, n, bits, block_size, out)


def dequantize_rows(buf: torch.Tensor, n: int, bits: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n)]`` -> ``[rows, n]`` in ``dtype``."""
    out = torch.empty(*buf.shape[:-1], n, dtype=dtype, device=buf.device)
    return dequantize_rows_into(buf, n, bits, block_size, out)


def swizzle_quantize(x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int,
                     stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """Flat ``x`` as ``[N, L, S]`` -> uint8 ``[L * N, packed_nbytes(S)]``, row ``l * N + n`` = slice ``(n, l)``."""
    return quantize_rows(reference.swizzle_rows(x, nodes, local), bits, block_size, stochastic, seed, offset)


def dequantize_reduce(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``, the sum over k in order."""
    return reference.sum_in_order(dequantize_rows_fp32(bufs, n, bits, block_size))


def reduce_requantize(bufs: torch.Tensor, n: int, bits_in: int, block_in: int, bits_out: int, block_out: int,
                      stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes_in]`` -> dequantize, sum in fp32, quantize: uint8 ``[rows, nbytes_out]``."""
    total = dequantize_reduce(bufs, n, bits_in, block_in)
    return quantize_rows(total, bits_out, block_out, stochastic, seed, offset)


_NATIVE_OUT = (torch.float32, torch.bfloat16)


def _native(device: torch.device, bits: int, block_size: int, n: int) -> bool:
    """Whether the native kernel covers ``bits`` and ``block_size`` on ``device`` for rows of ``n``
    elements (at least one whole block)."""
    return (device.type == "cpu" and bits in native.BITS and fmt.MIN_BLOCK <= block_size <= fmt.MAX_BLOCK
            and n >= block_size and native.enabled())


def _native_quantize(x: torch.Tensor, bits: int, block_size: int):
    """Round-to-nearest through the native kernel: the packed uint8 ``[rows, packed_nbytes(n)]``,
    False when a block is in the subnormal range (the reference's), None when the library is
    unavailable. The whole blocks are read in place; a partial last block is the reference's."""
    x = x.to(torch.float32)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    full, bb = n // block_size, fmt.block_code_bytes(bits, block_size)
    buf = torch.empty(rows, fmt.packed_nbytes(n, bits, block_size), dtype=torch.uint8)
    cb = fmt.codes_nbytes(n, bits, block_size)
    codes, scale_bytes = buf[:, :cb], buf[:, cb:]
    done = native.quantize_blocks(x, codes, scale_bytes, full, block_size, bits)
    if not done:
        return done
    if n > full * block_size:
        tail = reference.quantize_rows(x[:, full * block_size:], bits, block_size)  # [rows, bb + 4]
        codes[:, full * bb:].copy_(tail[:, :bb])
        scale_bytes[:, 4 * full:].copy_(tail[:, bb:])
    return buf


def _native_dequantize(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> bool:
    """The whole blocks through the native kernel straight into ``out`` (contiguous fp32 or bf16,
    not sharing ``buf``'s storage), a partial last block through the reference's
    :func:`~qcoll.quant.reference.scale_into`. False (nothing written) when the library is unavailable."""
    if buf.stride(-1) != 1:
        buf = buf.contiguous()
    cb = fmt.codes_nbytes(n, bits, block_size)
    flat = buf.reshape(-1, buf.shape[-1])
    codes, scale_bytes = flat[:, :cb], flat[:, cb:]
    rows, full = flat.shape[0], n // block_size
    out2 = out.view(rows, n)
    if not native.dequantize_blocks(codes, scale_bytes, out2, full, block_size, bits):
        return False
    if n > full * block_size:
        last = scale_bytes[:, 4 * full:].contiguous().view(torch.float32)
        q = unpack_codes(codes[:, full * fmt.block_code_bytes(bits, block_size):], bits)
        reference.scale_into(q[:, : n - full * block_size].unsqueeze(1), last,
                             out2[:, full * block_size:].unsqueeze(1))
    return True
