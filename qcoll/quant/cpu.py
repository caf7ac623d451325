"""The codec's row operations on CPU tensors: the compiled fast path where it applies, else the reference.

Same functions and signatures as :mod:`qcoll.quant.reference` (and :mod:`qcoll.bindings.ops`);
:mod:`qcoll.quant.rows` calls them for CPU tensors. Round-to-nearest quantize and every
dequantize of at least :data:`qcoll.quant.compiled.MIN_NUMEL` elements run the
torch.compile'd loops (byte-identical to the reference); everything else, and anything
the compiled path declines, runs :mod:`qcoll.quant.reference`. Arguments are not checked here.
"""
from __future__ import annotations

import torch

from . import compiled, reference
from .hadamard import hadamard_rows  # noqa: F401  (the rotation has no compiled path: the reference)


def quantize_rows(x: torch.Tensor, bits: int, block_size: int, stochastic: bool = False, seed: int = 0,
                  offset: int = 0) -> torch.Tensor:
    """float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n)]``."""
    if not stochastic and compiled.enabled(x.device, x.numel()):
        fast = compiled.quantize_rows(x, bits, block_size)
        if fast is not None:
            return fast
    return reference.quantize_rows(x, bits, block_size, stochastic, seed, offset)


def dequantize_rows_into(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., packed_nbytes(n)]`` -> ``out`` ``[..., n]`` (fp32, bf16 or fp16); returns ``out``."""
    if not compiled.enabled(buf.device, out.numel()):
        return reference.dequantize_rows_into(buf, n, bits, block_size, out)
    if not reference.direct_out(buf, n, out):  # strided or aliasing out: decode to fp32, then copy
        return out.copy_(dequantize_rows_fp32(buf, n, bits, block_size))
    if compiled.dequantize_rows_into(buf, n, bits, block_size, out):
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
