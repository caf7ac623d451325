"""pytest-benchmark suites for the codec: quantize+pack and unpack+dequantize vs ``Tensor.copy_``.

Run (from the repository root):

    pytest bench/test_codec_benchmark.py --benchmark-enable

pyproject's ``addopts`` carry ``--benchmark-disable`` (so without ``--benchmark-enable``
every case runs once, as a smoke test) and CI's ``testpaths`` are only ``tests/``,
so CI never runs this file. Cases are grouped by device and size, each group
holding ``copy_`` of the same fp32 tensor as the side-by-side baseline; every
case records its input bytes in ``extra_info`` (``--benchmark-json`` keeps them).
The CPU cases time the public API on CPU tensors, i.e. the torch reference
(with its torch.compile'd fast path from 2**20 elements, compiled in an untimed
warm-up call). The CUDA cases (marked ``cuda``) time the same calls on GPU
tensors, i.e. the CUDA kernels when CuPy is installed, with a synchronize
inside the timed call; they skip without a GPU.
"""
from __future__ import annotations

import pytest
import torch

import qcoll

SIZES = [2**12, 2**16, 2**20]           # elements of fp32: 16 KiB, 256 KiB, 4 MiB
BITS = [8, 4]
BLOCK = qcoll.quant.DEFAULT_WEIGHT_BLOCK

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _label(n: int) -> str:
    return f"{n >> 20}M" if n >= 2**20 else f"{n >> 10}K"


def _timed(fn, device: str):
    if device == "cuda":
        def run():
            fn()
            torch.cuda.synchronize()
        return run
    return fn


def _setup(benchmark, device: str, n: int, what: str) -> torch.Tensor:
    benchmark.group = f"{device} {_label(n)} fp32 elements"
    benchmark.extra_info.update({"device": device, "numel": n, "input_bytes": 4 * n, "op": what})
    return torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES, ids=_label)
def test_copy(benchmark, device, n):
    x = _setup(benchmark, device, n, "copy_")
    dst = torch.empty_like(x)
    fn = _timed(lambda: dst.copy_(x), device)
    fn()
    benchmark(fn)
    assert torch.equal(dst, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES, ids=_label)
def test_quantize(benchmark, device, bits, n):
    x = _setup(benchmark, device, n, f"quantize{bits}")
    fn = _timed(lambda: qcoll.quantize(x, bits=bits, block_size=BLOCK), device)
    fn()   # warm-up: NVRTC / torch.compile happen here, untimed
    benchmark(fn)
    packed = qcoll.quantize(x, bits=bits, block_size=BLOCK)
    assert packed.nbytes == qcoll.quant.packed_nbytes(n, bits, BLOCK)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES, ids=_label)
def test_dequantize(benchmark, device, bits, n):
    x = _setup(benchmark, device, n, f"dequantize{bits}")
    packed = qcoll.quantize(x, bits=bits, block_size=BLOCK)
    out = torch.empty_like(x)
    fn = _timed(lambda: qcoll.dequantize(packed, out=out), device)
    fn()
    benchmark(fn)
    qmax = 2 ** (bits - 1) - 1
    assert float((out - x).abs().max()) <= float(x.abs().max()) / (2 * qmax) * (1 + 1e-6)
