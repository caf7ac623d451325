"""qcoll's CUDA kernels as ``torch.library`` custom ops (namespace ``qcoll``).

The plain functions at the bottom have exactly the signatures of their twins in
:mod:`qcoll.quant.reference`; :mod:`qcoll.quant.rows` calls them for CUDA tensors.
Each op has a fake (meta) implementation, so the ops trace under torch.compile.
A CPU tensor reaching an op runs the torch reference (the ops stay usable, and
testable, everywhere); a CUDA tensor runs the kernel. Importing this module never
touches CuPy or a GPU: kernels are compiled and loaded on first use.
"""
from __future__ import annotations

import torch

from qcoll.quant import format as fmt
from qcoll.quant import reference

from . import launch

NAMESPACE = "qcoll"


def _nbytes(n: int, bits: int, block_size: int) -> int:
    return fmt.packed_nbytes(n, bits, block_size)


# ------------------------------------------------------------------ quantize_rows
@torch.library.custom_op(f"{NAMESPACE}::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int,
                      offset: int) -> torch.Tensor:
    if not x.is_cuda:
        return reference.quantize_rows(x, bits, block_size, stochastic, seed, offset)
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty((rows, _nbytes(n, bits, block_size)), dtype=torch.uint8, device=x.device)
    launch.quantize_rows_into(x, out, bits, block_size, stochastic, seed, offset)
    return out


@_quantize_rows_op.register_fake
def _(x, bits, block_size, stochastic, seed, offset):
    rows, n = x.shape
    return x.new_empty((rows, _nbytes(n, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_rows
@torch.library.custom_op(f"{NAMESPACE}::dequantize_rows", mutates_args=())
def _dequantize_rows_op(buf: torch.Tensor, n: int, bits: int, block_size: int,
                        dtype: torch.dtype) -> torch.Tensor:
    if not buf.is_cuda:
        return reference.dequantize_rows(buf, n, bits, block_size, dtype)
    buf = launch.packed_input(buf, "buf")
    out = torch.empty((buf.shape[0], n), dtype=dtype, device=buf.device)
    launch.dequantize_rows_into(buf, out, n, bits, block_size)
    return out


@_dequantize_rows_op.register_fake
def _(buf, n, bits, block_size, dtype):
    return buf.new_empty((buf.shape[0], n), dtype=dtype)


# ------------------------------------------------------------------ swizzle_quantize
@torch.library.custom_op(f"{NAMESPACE}::swizzle_quantize", mutates_args=())
def _swizzle_quantize_op(x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int,
                         stochastic: bool, seed: int, offset: int) -> torch.Tensor:
    if not x.is_cuda:
        return reference.swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)
    x = x.contiguous()
    s = x.numel() // (nodes * local)
    out = torch.empty((nodes * local, _nbytes(s, bits, block_size)), dtype=torch.uint8, device=x.device)
    launch.swizzle_quantize_into(x, out, nodes, local, s, bits, block_size, stochastic, seed, offset)
    return out


@_swizzle_quantize_op.register_fake
def _(x, nodes, local, bits, block_size, stochastic, seed, offset):
    s = x.numel() // (nodes * local)
    return x.new_empty((nodes * local, _nbytes(s, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_reduce
@torch.library.custom_op(f"{NAMESPACE}::dequantize_reduce", mutates_args=())
def _dequantize_reduce_op(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    if not bufs.is_cuda:
        return reference.dequantize_reduce(bufs, n, bits, block_size)
    bufs = launch.packed_input(bufs, "bufs")
    out = torch.empty((bufs.shape[1], n), dtype=torch.float32, device=bufs.device)
    launch.dequantize_reduce_into(bufs, out, n, bits, block_size)
    return out


@_dequantize_reduce_op.register_fake
def _(bufs, n, bits, block_size):
    return bufs.new_empty((bufs.shape[1], n), dtype=torch.float32)


# ------------------------------------------------------------------ reduce_requantize
@torch.library.custom_op(f"{NAMESPACE}::reduce_requantize", mutates_args=())
def _reduce_requantize_op(bufs: torch.Tensor, n: int, bits_in: int, block_in: int, bits_out: int,
                          block_out: int, stochastic: bool, seed: int, offset: int) -> torch.Tensor:
    if not bufs.is_cuda:
        return reference.reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed,
                                           offset)
    bufs = launch.packed_input(bufs, "bufs")
    out = torch.empty((bufs.shape[1], _nbytes(n, bits_out, block_out)), dtype=torch.uint8, device=bufs.device)
    launch.reduce_requantize_into(bufs, out, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset)
    return out


@_reduce_requantize_op.register_fake
def _(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset):
    return bufs.new_empty((bufs.shape[1], _nbytes(n, bits_out, block_out)), dtype=torch.uint8)


# ------------------------------------------------------------------ validation
def _check_quant(bits, block_size, seed, offset, bits_name="bits", block_name="block_size"):
    fmt.check_bits(bits, bits_name)
    fmt.check_block_size(block_size, block_name)
    fmt.check_seed(seed)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
        raise ValueError(f"offset must be an int in [0, 2**63), got {offset!r}")


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return n


def _check_packed(buf, ndim: int, n: int, bits: int, block_size: int, name: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8, got {buf.dtype}")
    if buf.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(buf.shape)}")
    want = _nbytes(n, bits, block_size)
    if buf.shape[-1] != want:
        raise ValueError(
            f"{name} rows hold {buf.shape[-1]} bytes but n={n}, bits={bits}, block_size={block_size} "
            f"need {want}"
        )


# ------------------------------------------------------------------ public functions
def quantize_rows(x, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    """x ``[rows, n]`` float -> uint8 ``[rows, packed_nbytes(n)]`` (see reference.quantize_rows)."""
    fmt.check_float_tensor(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, n], got shape {tuple(x.shape)}")
    _check_quant(bits, block_size, seed, offset)
    return _quantize_rows_op(x, bits, block_size, bool(stochastic), seed, offset)


def dequantize_rows(buf, n, bits, block_size, dtype) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n)]`` -> ``[rows, n]`` in ``dtype``."""
    _check_n(n)
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    if dtype not in fmt.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_packed(buf, 2, n, bits, block_size, "buf")
    return _dequantize_rows_op(buf, n, bits, block_size, dtype)


def swizzle_quantize(x, nodes, local, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    """Flat x as ``[N, L, S]`` -> uint8 ``[L*N, packed_nbytes(S)]``, row ``l*N+n`` = slice ``(n, l)``."""
    fmt.check_float_tensor(x, "x")
    for name, v in (("nodes", nodes), ("local", local)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if x.numel() % (nodes * local):
        raise ValueError(f"x has {x.numel()} elements, not a multiple of nodes*local = {nodes * local}")
    _check_quant(bits, block_size, seed, offset)
    return _swizzle_quantize_op(x, nodes, local, bits, block_size, bool(stochastic), seed, offset)


def dequantize_reduce(bufs, n, bits, block_size) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``, summed as a left fold over k."""
    _check_n(n)
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    _check_packed(bufs, 3, n, bits, block_size, "bufs")
    if bufs.shape[0] < 1:
        raise ValueError("bufs must hold at least one row set (k >= 1)")
    return _dequantize_reduce_op(bufs, n, bits, block_size)


def reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic=False, seed=0,
                      offset=0) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes_in]`` -> dequantize, sum in fp32, quantize: uint8 ``[rows, nbytes_out]``."""
    _check_n(n)
    fmt.check_bits(bits_in, "bits_in")
    fmt.check_block_size(block_in, "block_in")
    _check_quant(bits_out, block_out, seed, offset, "bits_out", "block_out")
    _check_packed(bufs, 3, n, bits_in, block_in, "bufs")
    if bufs.shape[0] < 1:
        raise ValueError("bufs must hold at least one row set (k >= 1)")
    return _reduce_requantize_op(bufs, n, bits_in, block_in, bits_out, block_out, bool(stochastic), seed, offset)
