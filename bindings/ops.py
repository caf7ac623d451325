"""qcoll's CUDA kernels on torch CUDA tensors: what :mod:`qcoll.quant.rows` calls for CUDA tensors.

CUDA only: the CPU path and the torch reference live in :mod:`qcoll.quant`, and
:mod:`qcoll.quant.rows` is the one place that picks between them and these. The functions
have the signatures of their twins in :mod:`qcoll.quant.reference` and produce its bytes.
Arguments are checked once, by the public entry points (:func:`qcoll.quantize`,
:func:`qcoll.dequantize`, the collectives); here they are trusted.

Each public function makes one call down. In plain eager mode that is its implementation
(allocate the output, launch the kernel through :mod:`.launch`), without the ``torch.library``
dispatcher's per-call cost (~48 us of Python dispatch on the host, more than the launch).
While anything traces, transforms or profiles the call it is the custom op ``qcoll::<name>``
instead, registered for CUDA with a fake implementation (output shape and dtype), so that
torch.compile/export, make_fx, FakeTensor, functorch and the profiler see one op.
Importing this module never touches CuPy or a GPU: kernels are compiled and loaded on first use.
"""
from __future__ import annotations

import torch
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qcoll.quant import format as fmt

from . import launch

NAMESPACE = "qcoll"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # no __torch_function__ of their own


def _register(name: str, impl):
    """``impl`` as the CUDA custom op ``qcoll::name`` (its annotations give the schema)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), device_types="cuda")(impl)


def _plain_eager(t: torch.Tensor) -> bool:
    """True when nothing traces, transforms or profiles ``t``.

    Public checks: a plain tensor (not a FakeTensor or other subclass), no torch-function mode
    or override, no torch.compile/export, no torch.jit.trace. torch has no public test for the
    rest, so these three are private: no dispatch mode (make_fx, FakeTensorMode over real
    tensors), no vmap/grad transform, no autograd profiler (which should show the op).
    """
    return (type(t) in _PLAIN_TYPES and not has_torch_function((t,)) and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and _get_current_dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active() and not torch.autograd._profiler_enabled())


def _call(op, impl, t: torch.Tensor, *args):
    """``impl(t, *args)`` in plain eager mode, else the registered ``op`` (the same result)."""
    return impl(t, *args) if _plain_eager(t) else op(t, *args)


# ------------------------------------------------------------------ quantize_rows
def _quantize_rows_impl(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int,
                        offset: int) -> torch.Tensor:
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty((rows, fmt.packed_nbytes(n, bits, block_size)), dtype=torch.uint8, device=x.device)
    launch.quantize_rows_into(x, out, bits, block_size, stochastic, seed, offset)
    return out


_quantize_rows_op = _register("quantize_rows", _quantize_rows_impl)


@_quantize_rows_op.register_fake
def _(x, bits, block_size, stochastic, seed, offset):
    rows, n = x.shape
    return x.new_empty((rows, fmt.packed_nbytes(n, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_rows
def _dequantize_rows_impl(buf: torch.Tensor, n: int, bits: int, block_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    buf = launch.packed_input(buf)
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
    x = x.contiguous()
    s = x.numel() // (nodes * local)
    out = torch.empty((nodes * local, fmt.packed_nbytes(s, bits, block_size)), dtype=torch.uint8,
                      device=x.device)
    launch.swizzle_quantize_into(x, out, nodes, local, s, bits, block_size, stochastic, seed, offset)
    return out


_swizzle_quantize_op = _register("swizzle_quantize", _swizzle_quantize_impl)


@_swizzle_quantize_op.register_fake
def _(x, nodes, local, bits, block_size, stochastic, seed, offset):
    s = x.numel() // (nodes * local)
    return x.new_empty((nodes * local, fmt.packed_nbytes(s, bits, block_size)), dtype=torch.uint8)


# ------------------------------------------------------------------ dequantize_reduce
def _dequantize_reduce_impl(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    bufs = launch.packed_input(bufs)
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
    bufs = launch.packed_input(bufs)
    out = torch.empty((bufs.shape[1], fmt.packed_nbytes(n, bits_out, block_out)), dtype=torch.uint8,
                      device=bufs.device)
    launch.reduce_requantize_into(bufs, out, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset)
    return out


_reduce_requantize_op = _register("reduce_requantize", _reduce_requantize_impl)


@_reduce_requantize_op.register_fake
def _(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset):
    return bufs.new_empty((bufs.shape[1], fmt.packed_nbytes(n, bits_out, block_out)), dtype=torch.uint8)


# ------------------------------------------------------------------ public functions
def quantize_rows(x: torch.Tensor, bits: int, block_size: int, stochastic: bool = False, seed: int = 0,
                  offset: int = 0) -> torch.Tensor:
    """Quantize each row of ``x`` on its own.

    Args:
        x: CUDA ``[rows, n]``, float32/bfloat16/float16, any strides.
        bits, block_size, stochastic, seed: as in :func:`qcoll.quantize`.
        offset: element index of column 0 for the stochastic-rounding hash, in ``[0, 2**63)``.
    Returns:
        uint8 ``[rows, packed_nbytes(n, bits, block_size)]`` on ``x``'s device.
    """
    return _call(_quantize_rows_op, _quantize_rows_impl, x, bits, block_size, bool(stochastic), seed, offset)


def dequantize_rows(buf: torch.Tensor, n: int, bits: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode each row of ``buf``.

    Args:
        buf: CUDA uint8 ``[rows, packed_nbytes(n, bits, block_size)]``.
        n: elements per row; ``bits``, ``block_size``: those ``buf`` was quantized with.
        dtype: float32, bfloat16 or float16.
    Returns:
        ``[rows, n]`` in ``dtype`` on ``buf``'s device (values saturated to the fp32 range).
    """
    return _call(_dequantize_rows_op, _dequantize_rows_impl, buf, n, bits, block_size, dtype)


def dequantize_rows_into(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_rows` written into ``out``: CUDA ``[rows, n]``, float32/bfloat16/float16
    (its dtype is the output's). Returns ``out``. (Decodes into a fresh tensor and copies:
    ``launch.dequantize_rows_into`` could write into ``out`` directly, not yet wired.)"""
    return out.copy_(dequantize_rows(buf, n, bits, block_size, out.dtype))


def swizzle_quantize(x: torch.Tensor, nodes: int, local: int, bits: int, block_size: int,
                     stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """qgZ step 1: flat ``x`` viewed as ``[N, L, S]`` (``N = nodes``, ``L = local``), slices quantized.

    Args:
        x: CUDA float32/bfloat16/float16 with ``N * L * S`` elements, any shape.
        bits, block_size, stochastic, seed, offset: as in :func:`quantize_rows`.
    Returns:
        uint8 ``[L * N, packed_nbytes(S, bits, block_size)]``; row ``l * N + n`` holds slice ``(n, l)``.
    """
    return _call(_swizzle_quantize_op, _swizzle_quantize_impl, x, nodes, local, bits, block_size,
                 bool(stochastic), seed, offset)


def dequantize_reduce(bufs: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    """Decode ``k`` row sets and sum them.

    Args:
        bufs: CUDA uint8 ``[k, rows, packed_nbytes(n, bits, block_size)]``, ``k >= 1``.
    Returns:
        float32 ``[rows, n]``: ``((set 0 + set 1) + set 2) + ...``, the reference's order.
    """
    return _call(_dequantize_reduce_op, _dequantize_reduce_impl, bufs, n, bits, block_size)


def reduce_requantize(bufs: torch.Tensor, n: int, bits_in: int, block_in: int, bits_out: int, block_out: int,
                      stochastic: bool = False, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """qgZ between hops: decode ``k`` row sets, sum in fp32 (as :func:`dequantize_reduce`), quantize the sum.

    Args:
        bufs: CUDA uint8 ``[k, rows, packed_nbytes(n, bits_in, block_in)]``, ``k >= 1``.
        bits_out, block_out, stochastic, seed, offset: the quantization of the sum.
    Returns:
        uint8 ``[rows, packed_nbytes(n, bits_out, block_out)]``.
    """
    return _call(_reduce_requantize_op, _reduce_requantize_impl, bufs, n, bits_in, block_in, bits_out, block_out,
                 bool(stochastic), seed, offset)


# ------------------------------------------------------------------ hadamard_rows
def _hadamard_rows_impl(x: torch.Tensor, block_size: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    launch.hadamard_rows_into(x, out, block_size, fmt.rotation_scale(block_size))
    return out


_hadamard_rows_op = _register("hadamard_rows", _hadamard_rows_impl)


@_hadamard_rows_op.register_fake
def _(x, block_size):
    return torch.empty_like(x)


def hadamard_rows(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-local orthonormal Walsh-Hadamard rotation (docs/FORMAT.md "Rotation"; self-inverse).

    Args:
        x: CUDA float32 ``[rows, n]``.
        block_size: a power of two in [32, 4096]; each row's partial tail block is copied.
    Returns:
        float32 ``[rows, n]``, bit-identical to :func:`qcoll.quant.hadamard.hadamard_rows`.
    """
    return _call(_hadamard_rows_op, _hadamard_rows_impl, x, block_size)
