"""Launch the qcoll kernels on torch CUDA tensors (CuPy modules, torch's current stream).

Pointers are passed zero-copy (``tensor.data_ptr()`` as a 64-bit kernel argument);
kernels run on ``torch.cuda.current_stream()``. CuPy is imported lazily, so this
module imports on machines without a GPU. Arguments were checked by the public entry
points; outputs are allocated by the functions in :mod:`qcoll.bindings.ops`.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import torch

from qcoll.quant import format as fmt

from . import nvrtc, sources

THREADS = 256
MAX_GRID = 1 << 20  # the kernels grid-stride beyond this

_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str], object] = {}
_streams: dict[tuple[int, int], object] = {}
MAX_STREAMS = 64
_lock = threading.Lock()

DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _cupy():
    import cupy

    return cupy


def device_arch(device: torch.device) -> str:
    """The ``sm_XY`` architecture NVRTC compiles for, of CUDA ``device``."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def get_kernel(name: str, device: torch.device):
    """The CuPy ``RawKernel`` of kernel ``name`` for the tensor's device (compiled on first use)."""
    index = _device_index(device)
    fn = _functions.get((index, name))
    if fn is not None:
        return fn
    source = sources.kernel_for(name)
    key = (index, source)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            cp = _cupy()
            path = nvrtc.compile_cubin(source, device_arch(torch.device("cuda", index)))
            with cp.cuda.Device(index):
                mod = cp.RawModule(path=str(path))
            _modules[key] = mod
        fn = _functions[(index, name)] = mod.get_function(name)
    return fn


def cupy_stream(index: int, ptr: int):
    """The CuPy handle of the CUDA stream ``ptr`` on device ``index``, built once per stream.

    A handle only names the stream (CuPy never destroys it), so a pointer that a new torch
    stream reuses maps to the right stream; the cache is cleared past ``MAX_STREAMS`` entries.
    """
    key = (index, ptr)
    stream = _streams.get(key)
    if stream is None:
        cp = _cupy()
        external = getattr(cp.cuda, "ExternalStream", None)
        if external is None:  # a CuPy after the deprecation (14.0) removed it
            with cp.cuda.Device(index):
                stream = cp.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = external(ptr, index)
        with _lock:
            if len(_streams) >= MAX_STREAMS:
                _streams.clear()
            _streams[key] = stream
    return stream


class _StreamHandle:
    """A bare stream pointer speaking the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _launch(name: str, device: torch.device, work_items: int, per_cta: int, args) -> None:
    assert device.type == "cuda", device  # rows.py sends only CUDA tensors here
    if work_items <= 0:
        return
    cp = _cupy()
    grid = max(1, min(-(-work_items // per_cta), MAX_GRID))
    kernel = get_kernel(name, device)
    index = _device_index(device)
    stream = cupy_stream(index, torch.cuda.current_stream(device).cuda_stream)
    with cp.cuda.Device(index):
        kernel((grid,), (THREADS,), tuple(args), stream=stream)  # CuPy raises on launch errors


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _blocks_per_cta(block_size: int) -> int:
    """Wire-format blocks one CTA quantizes at once (T = min(32, block/8) threads each)."""
    return THREADS // min(32, block_size // 8)


def _vec_ok(t: torch.Tensor, n: int) -> int:
    """16-byte vector access is valid when the base is 16-aligned and rows hold whole 8-groups."""
    return int(t.data_ptr() % 16 == 0 and n % 8 == 0)


def packed_input(buf: torch.Tensor) -> torch.Tensor:
    """uint8 packed rows ``[..., nbytes]`` as the kernels read them: contiguous and 4-byte
    aligned (the fp32 scales), copied only when needed."""
    buf = buf.contiguous()
    if buf.data_ptr() % 4:
        buf = buf.clone()  # fresh allocations are 256-byte aligned
    return buf


def quantize_rows_into(x: torch.Tensor, out: torch.Tensor, bits, block_size, stochastic, seed, offset) -> None:
    """x [rows, n] contiguous float -> out uint8 [rows, packed_nbytes(n)]."""
    rows, n = x.shape
    name = f"qcoll_quantize_{DTYPE_SUFFIX[x.dtype]}"
    args = (_ptr(x), _ptr(out), np.uint64(rows), np.uint64(n), np.int32(bits), np.int32(block_size),
            np.int32(_vec_ok(x, n)), np.int32(bool(stochastic)), np.uint32(seed), np.uint64(offset))
    _launch(name, x.device, rows * fmt.num_blocks(n, block_size), _blocks_per_cta(block_size), args)


def swizzle_quantize_into(x, out, nodes, local, s, bits, block_size, stochastic, seed, offset) -> None:
    """flat x [N*L*S] -> out uint8 [L*N, packed_nbytes(S)], row l*N+n = slice (n, l)."""
    name = f"qcoll_swizzle_quantize_{DTYPE_SUFFIX[x.dtype]}"
    args = (_ptr(x), _ptr(out), np.uint64(nodes), np.uint64(local), np.uint64(s), np.int32(bits),
            np.int32(block_size), np.int32(_vec_ok(x, s)), np.int32(bool(stochastic)), np.uint32(seed),
            np.uint64(offset))
    _launch(name, x.device, nodes * local * fmt.num_blocks(s, block_size), _blocks_per_cta(block_size), args)


def dequantize_rows_into(buf: torch.Tensor, out: torch.Tensor, n, bits, block_size) -> None:
    """buf uint8 [rows, nbytes] -> out [rows, n] (fp32/bf16/fp16)."""
    rows = buf.shape[0]
    name = f"qcoll_dequantize_{DTYPE_SUFFIX[out.dtype]}"
    args = (_ptr(buf), _ptr(out), np.uint64(rows), np.uint64(n), np.int32(bits), np.int32(block_size),
            np.int32(_vec_ok(out, n)))
    _launch(name, buf.device, rows * -(-n // 8), THREADS, args)


def dequantize_reduce_into(bufs: torch.Tensor, out: torch.Tensor, n, bits, block_size) -> None:
    """bufs uint8 [k, rows, nbytes] -> out fp32 [rows, n], the left-fold sum over k."""
    k, rows = bufs.shape[0], bufs.shape[1]
    args = (_ptr(bufs), _ptr(out), np.uint64(k), np.uint64(rows), np.uint64(n), np.int32(bits),
            np.int32(block_size), np.int32(_vec_ok(out, n)))
    _launch("qcoll_dequantize_reduce", bufs.device, rows * -(-n // 8), THREADS, args)


def reduce_requantize_into(bufs, out, n, bits_in, block_in, bits_out, block_out, stochastic, seed, offset) -> None:
    """bufs uint8 [k, rows, nbytes_in] -> out uint8 [rows, nbytes_out]."""
    k, rows = bufs.shape[0], bufs.shape[1]
    args = (_ptr(bufs), _ptr(out), np.uint64(k), np.uint64(rows), np.uint64(n), np.int32(bits_in),
            np.int32(block_in), np.int32(bits_out), np.int32(block_out), np.int32(bool(stochastic)),
            np.uint32(seed), np.uint64(offset))
    _launch("qcoll_reduce_requantize", bufs.device, rows * fmt.num_blocks(n, block_out),
            _blocks_per_cta(block_out), args)


def hadamard_rows_into(x: torch.Tensor, out: torch.Tensor, block_size: int, scale: float) -> None:
    """x fp32 [rows, n] contiguous -> out fp32 [rows, n]: each full block rotated, the tail copied."""
    rows, n = x.shape
    args = (_ptr(x), _ptr(out), np.uint64(rows), np.uint64(n), np.int32(block_size), np.float32(scale))
    _launch("qcoll_hadamard_rows", x.device, rows * -(-n // block_size), 1, args)
