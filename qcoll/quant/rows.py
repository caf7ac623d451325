"""Row-level codec operations used by the collectives, dispatched per device.

Each function has the signature of its twin in :mod:`qcoll.quant.reference`
and runs the CUDA kernel for CUDA tensors (see :mod:`qcoll.quant.backend`).
"""
from __future__ import annotations

import torch

from . import cpu
from .backend import kernels, use_cuda


def quantize_rows(x, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    if use_cuda(x):
        return kernels().quantize_rows(x, bits, block_size, stochastic, seed, offset)
    return cpu.quantize_rows(x, bits, block_size, stochastic, seed, offset)


def dequantize_rows(buf, n, bits, block_size, dtype) -> torch.Tensor:
    if use_cuda(buf):
        return kernels().dequantize_rows(buf, n, bits, block_size, dtype)
    return cpu.dequantize_rows(buf, n, bits, block_size, dtype)


def dequantize_rows_into(buf, n, bits, block_size, out) -> torch.Tensor:
    """Like :func:`dequantize_rows`, written into ``out`` ``[rows, n]`` (its dtype); returns ``out``.

    On CPU the values are written straight into ``out``; the CUDA path still dequantizes into
    a fresh tensor and copies (``launch.dequantize_rows_into`` could write into ``out``: not yet wired).
    """
    if use_cuda(buf):
        return out.copy_(kernels().dequantize_rows(buf, n, bits, block_size, out.dtype))
    return cpu.dequantize_rows_into(buf, n, bits, block_size, out)


def swizzle_quantize(x, nodes, local, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    if use_cuda(x):
        return kernels().swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)
    return cpu.swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)


def dequantize_reduce(bufs, n, bits, block_size) -> torch.Tensor:
    if use_cuda(bufs):
        return kernels().dequantize_reduce(bufs, n, bits, block_size)
    return cpu.dequantize_reduce(bufs, n, bits, block_size)


def reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic=False, seed=0, offset=0):
    if use_cuda(bufs):
        return kernels().reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset)
    return cpu.reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset)
