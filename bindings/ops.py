"""qcoll's CUDA kernels as ``torch.library`` custom ops (namespace ``qcoll``).

The plain functions at the bottom have exactly the signatures of their twins in
:mod:`qcoll.quant.reference`; :mod:`qcoll.quant.rows` calls them for CUDA tensors.
Each op has a fake (meta) implementation, so the ops trace under torch.compile. In plain
eager mode the public functions call the op's implementation directly (the same code,
without the dispatcher's per-call cost); anything tracing goes through the op.
A CPU tensor reaching an op runs the torch reference (the ops stay usable, and
testable, everywhere); a CUDA tensor runs the kernel. Importing this module never
touches CuPy or a GPU: kernels are compiled and loaded on first use.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qcoll.quant import format as fmt
from qcoll.quant import reference

from . import launch

NAMESPACE = "qcoll"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # no __torch_function__ of their own


def _nbytes(n: int, bits: int, block_size: int) -> int:
    return fmt.packed_nbytes(n, bits, block_size)


def _register(name: str, impl):
    """``impl`` as the custom op ``qcoll::name`` (its annotations give the schema)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)


def _plain_eager(t: torch.Tensor) -> bool:
    """True when nothing is tracing, transforming or profiling ``t``: a plain tensor, no
    torch.compile/export, no torch.jit.trace, no dispatch or torch-function mode (FakeTensor,
    make_fx), no vmap/grad transform, no autograd profiler (which should show the op)."""
    return (type(t) in _PLAIN_TYPES and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and _get_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active() and not torch.autograd._profiler_enabled())


def _dispatch(op, impl, t: torch.Tensor, *args):
    """Run ``impl`` directly in plain eager mode, else the registered op.

    The op's Python dispatch costs ~30 us (CPU) to ~48 us (CUDA host side) per call, more than
    the kernel launch itself; eager callers gain nothing from it, while torch.compile, export,
    FakeTensor and functorch need the op (and its fake implementation) to see through the call.
    """
    if _plain_eager(t):
        return impl(t, *args)
    return op(t, *args)


# ------------------------------------------------------------------ quantize_rows
def _quantize_rows_impl(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int,
                        offset: int) -> torch.Tensor:
    if not x.is_cuda:
        return reference.quantize_rows(x, bits, block_size, stochastic, seed, offset)
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty((rows, _nbytes(n, bits, block_size)), dtype=torch.uint8, device=x.device)
    launch.quantize_rows_into(x, out, bits, block_size, stochastic, seed, offset)
    return out


_quantize_rows_op = _register("quantize_rows", _quantize_rows_impl)


@_quantize_rows_op.register_fake
def _(x, bits, block_size, stochastic, seed, offset):
    rows, n = x.shape
    return x.new_empty((rows, _nbytes(n, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_rows
def _dequantize_rows_impl(buf: torch.Tensor, n: int, bits: int, block_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    if not buf.is_cuda:
        return reference.dequantize_rows(buf, n, bits, block_size, dtype)
    buf = launch.packed_input(buf, "buf")
    out = torch.empty((buf.shape[0], n), dtype=dtype, device=buf.device)
    launch.dequantize_rows_into(buf, out, n, bits, block_size)
    return out


_dequantize_rows_op = _register("dequantize_rows", _dequantize_rows_impl)


@_dequantize_rows_op.register_fake
def _(buf, n, bits, block_size, dtype):
    return buf.new_empty((buf.shape[0], n), dtype=dtype)


# ------------------------------------------------------------------ swizzle_quantize
def _swizzle_quantize_impl(x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int,
                           stochastic: bool, seed: int, offset: int) -> torch.Tensor:
    if not x.is_cuda:
        return reference.swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)
    x = x.contiguous()
    s = x.numel() // (nodes * local)
    out = torch.empty((nodes * local, _nbytes(s, bits, block_size)), dtype=torch.uint8, device=x.device)
    launch.swizzle_quantize_into(x, out, nodes, local, s, bits, block_size, stochastic, seed, offset)
    return out


_swizzle_quantize_op = _register("swizzle_quantize", _swizzle_quantize_impl)


@_swizzle_quantize_op.register_fake
def _(x, nodes, local, bits, block_size, stochastic, seed, offset):
    s = x.numel() // (nodes * local)
    return x.new_empty((nodes * local, _nbytes(s, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_reduce
def _dequantize_reduce_impl(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    if not bufs.is_cuda:
        return reference.dequantize_reduce(bufs, n, bits, block_size)
    bufs = launch.packed_input(bufs, "bufs")
    out = torch.empty((bufs.shape[1], n), dtype=torch.float32, device=bufs.device)
    launch.dequantize_reduce_into(bufs, out, n, bits, block_size)
    return out


_dequantize_reduce_op = _register("dequantize_reduce", _dequantize_reduce_impl)


@_dequantize_reduce_op.register_fake
def _(bufs, n, bits, block_size):
    return bufs.new_empty((bufs.shape[1], n), dtype=torch.float32)


# ------------------------------------------------------------------ reduce_requantize
def _reduce_requantize_impl(bufs: torch.Tensor, n: int, bits_in: int, block_in: int, bits_out: int,
                            block_out: int, stochastic: bool, seed: int, offset: int) -> torch.Tensor:
    if not bufs.is_cuda:
        return reference.reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed,
                                           offset)
    bufs = launch.packed_input(bufs, "bufs")
    out = torch.empty((bufs.shape[1], _nbytes(n, bits_out, block_out)), dtype=torch.uint8, device=bufs.device)
    launch.reduce_requantize_into(bufs, out, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset)
    return out


_reduce_requantize_op = _register("reduce_requantize", _reduce_requantize_impl)


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
    return _dispatch(_quantize_rows_op, _quantize_rows_impl, x, bits, block_size, bool(stochastic), seed, offset)


def dequantize_rows(buf, n, bits, block_size, dtype) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n)]`` -> ``[rows, n]`` in ``dtype``."""
    _check_n(n)
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    if dtype not in fmt.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_packed(buf, 2, n, bits, block_size, "buf")
    return _dispatch(_dequantize_rows_op, _dequantize_rows_impl, buf, n, bits, block_size, dtype)


def swizzle_quantize(x, nodes, local, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    """Flat x as ``[N, L, S]`` -> uint8 ``[L*N, packed_nbytes(S)]``, row ``l*N+n`` = slice ``(n, l)``."""
    fmt.check_float_tensor(x, "x")
    for name, v in (("nodes", nodes), ("local", local)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if x.numel() % (nodes * local):
        raise ValueError(f"x has {x.numel()} elements, not a multiple of nodes*local = {nodes * local}")
    _check_quant(bits, block_size, seed, offset)
    return _dispatch(_swizzle_quantize_op, _swizzle_quantize_impl, x, nodes, local, bits, block_size,
                     bool(stochastic), seed, offset)


def dequantize_reduce(bufs, n, bits, block_size) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``, summed as a left fold over k."""
    _check_n(n)
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    _check_packed(bufs, 3, n, bits, block_size, "bufs")
    if bufs.shape[0] < 1:
        raise ValueError("bufs must hold at least one row set (k >= 1)")
    return _dispatch(_dequantize_reduce_op, _dequantize_reduce_impl, bufs, n, bits, block_size)


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
    return _dispatch(_reduce_requantize_op, _reduce_requantize_impl, bufs, n, bits_in, block_in, bits_out,
                     block_out, bool(stochastic), seed, offset)
