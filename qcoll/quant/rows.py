"""Row-level codec operations used by the collectives: the one place that picks the device.

A CUDA tensor runs the CUDA kernels of :mod:`qcoll.bindings.ops` (imported on first use,
so CPU-only installs never touch CuPy) when CuPy is importable and ``QCOLL_BACKEND`` is
``auto`` (the default); with ``QCOLL_BACKEND=reference``, or without CuPy, it runs the torch
reference (:mod:`qcoll.quant.reference`). A CPU tensor runs :mod:`qcoll.quant.cpu` (the
compiled fast path where it applies, else the reference; ``QCOLL_COMPILE=0`` turns the
fast path off). All of them produce the same bytes (docs/FORMAT.md).

Nothing here checks arguments: the public entry points (:func:`qcoll.quantize`,
:func:`qcoll.dequantize`, the collectives) have done that before calling.
"""
from __future__ import annotations

import functools
import os

import torch

from . import cpu, reference

BACKENDS = ("auto", "reference")


def backend_setting() -> str:
    """``QCOLL_BACKEND``: ``auto`` (default) or ``reference``; ``ValueError`` for anything else."""
    value = os.environ.get("QCOLL_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"QCOLL_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def _cuda_kernels():
    """:mod:`qcoll.bindings.ops`, or None when CuPy or the bindings cannot be imported."""
    try:
        import cupy  # noqa: F401

        from qcoll.bindings import ops
    except Exception:
        return None
    return ops


def codec_for(t: torch.Tensor):
    """The module that runs the codec on ``t``'s device: :mod:`qcoll.bindings.ops`,
    :mod:`qcoll.quant.cpu` or :mod:`qcoll.quant.reference` (they share signatures)."""
    setting = backend_setting()
    if t.is_cuda and setting == "auto":
        kernels = _cuda_kernels()
        if kernels is not None:
            return kernels
    return cpu if t.device.type == "cpu" else reference


def quantize_rows(x, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    """float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n)]``, each row quantized on its own;
    ``offset`` is the element index of column 0 for the stochastic-rounding hash."""
    return codec_for(x).quantize_rows(x, bits, block_size, stochastic, seed, offset)


def dequantize_rows(buf, n, bits, block_size, dtype) -> torch.Tensor:
    """uint8 ``[rows, packed_nbytes(n)]`` -> ``[rows, n]`` in ``dtype`` (fp32, bf16 or fp16)."""
    return codec_for(buf).dequantize_rows(buf, n, bits, block_size, dtype)


def dequantize_rows_into(buf, n, bits, block_size, out) -> torch.Tensor:
    """Like :func:`dequantize_rows`, written into ``out`` ``[rows, n]`` (its dtype); returns ``out``."""
    return codec_for(buf).dequantize_rows_into(buf, n, bits, block_size, out)


def swizzle_quantize(x, nodes, local, bits, block_size, stochastic=False, seed=0, offset=0) -> torch.Tensor:
    """Flat float ``x`` as ``[N, L, S]`` -> uint8 ``[L * N, packed_nbytes(S)]``, row ``l * N + n`` = slice ``(n, l)``."""
    return codec_for(x).swizzle_quantize(x, nodes, local, bits, block_size, stochastic, seed, offset)


def dequantize_reduce(bufs, n, bits, block_size) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes]`` -> fp32 ``[rows, n]``, the left-fold sum over k."""
    return codec_for(bufs).dequantize_reduce(bufs, n, bits, block_size)


def reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic=False, seed=0,
                      offset=0) -> torch.Tensor:
    """uint8 ``[k, rows, nbytes_in]`` -> dequantize, sum in fp32, quantize: uint8 ``[rows, nbytes_out]``."""
    return codec_for(bufs).reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, seed,
                                             offset)


def hadamard_rows(x, block_size) -> torch.Tensor:
    """fp32 ``[rows, n]``: every full block of each row Hadamard-rotated (self-inverse)."""
    return codec_for(x).hadamard_rows(x.to(torch.float32), block_size)
