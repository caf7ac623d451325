"""The __host__ __device__ helpers of src/cuda/qcoll_format.cuh and qcoll_memory.cuh, built for
the CPU with a host C++ compiler (tests/host/qc_host_test.cpp), against the torch reference byte for byte."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cuda_testdata import BITS, DTYPES, awkward_rows
from qcoll.quant import reference, rng

ROOT = Path(__file__).resolve().parents[1]
DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _host_compiler():
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return shutil.which(cxx)
    return None


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = _host_compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++/clang++) found")
    exe = tmp_path_factory.mktemp("qc_host") / "qc_host_test"
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wextra", "-Werror",
           "-I", str(ROOT / "src" / "cuda"), str(ROOT / "tests" / "host" / "qc_host_test.cpp"), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"host driver failed to compile:\n{' '.join(cmd)}\n{res.stderr}"
    return Driver(exe, exe.parent)


class Driver:
    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.count = exe, tmp, 0

    def __call__(self, mode: str, data: bytes, *args: int) -> bytes:
        self.count += 1
        inp, out = self.tmp / f"in{self.count}", self.tmp / f"out{self.count}"
        inp.write_bytes(data)
        res = subprocess.run([str(self.exe), mode, str(inp), str(out), *map(str, args)], capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stderr
        return out.read_bytes()


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_float_bits_equal(got: torch.Tensor, want: torch.Tensor):
    """Bit-identical, except that any NaN matches any NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), "NaN positions differ"
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    gb, wb = got.view(ib)[~gn], want.view(ib)[~wn]
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} values differ, first got {got[~gn][bad[0]]} want {want[~wn][bad[0]]}"


# ------------------------------------------------------------------ hash
def test_mix32_and_uniform(driver):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    x[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    got = np.frombuffer(driver("mix", x.to(torch.int64).numpy().astype(np.uint32).tobytes()), dtype=np.uint32)
    assert np.array_equal(got.astype(np.int64), rng.mix32(x).numpy())
    for seed, offset, count in ((0, 0, 1000), (12345, 77, 999), (2**32 - 1, 2**32 - 300, 700), (9, 2**40 + 5, 64)):
        got = np.frombuffer(driver("uniform", b"", seed, offset, count), dtype=np.float32)
        want = rng.uniform(seed, offset, count, "cpu").numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (seed, offset)


# ------------------------------------------------------------------ dtype conversions
def test_conversions(driver):
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    f = bits.view(torch.float32).clone()
    # values around fp16 / bf16 rounding boundaries, subnormals, overflow
    edge = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2**-24, 2**-25, 2**-25 * 1.0000001,
                         3 * 2**-26, 2**-14, 2**-14 * (1 - 2**-11), 1 + 2**-11, 1 + 3 * 2**-11, 3.4028234663852886e38,
                         float("inf"), float("-inf"), float("nan"), 1.1754943508222875e-38, 1e-45],
                        dtype=torch.float32)
    scaled = torch.randn(1 << 14, generator=g) * torch.exp2(torch.randint(-30, 20, (1 << 14,), generator=g).float())
    f = torch.cat([f, edge, scaled])
    for kind, dtype in ((0, torch.bfloat16), (1, torch.float16)):
        got = torch.frombuffer(bytearray(driver("cvt", _raw(f), kind)), dtype=torch.int16).view(dtype)
        _assert_float_bits_equal(got, f.to(dtype))
    allh = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    for kind, dtype in ((2, torch.bfloat16), (3, torch.float16)):
        got = torch.frombuffer(bytearray(driver("cvt", _raw(allh), kind)), dtype=torch.float32)
        _assert_float_bits_equal(got, allh.view(dtype).float())


# ------------------------------------------------------------------ quantize / dequantize
QUANT_CASES = [
    # rows, n, block, stochastic
    (3, 1000, 32, False),
    (3, 1000, 32, True),
    (2, 777, 128, True),
    (4, 256, 256, False),
    (1, 5, 64, True),
    (2, 3000, 1024, False),
    (1, 4100, 4096, True),
]


@pytest.mark.parametrize("rows,n,block,stochastic", QUANT_CASES)
def test_quantize_rows(driver, rows, n, block, stochastic):
    for i, dtype in enumerate(DTYPES):
        x = awkward_rows(rows, n, block, dtype, seed=rows * n + block + i)
        for bits in BITS:
            seed, offset = 1234567 + bits, (2**32 - 100 if bits == 2 else 3 * bits)
            want = reference.quantize_rows(x, bits, block, stochastic, seed, offset)
            got = driver("quant", _raw(x), DT_CODE[dtype], rows, n, bits, block, int(stochastic), seed, offset)
            assert got == _raw(want), (dtype, bits)
            # round trip: dequantize the reference bytes with the host helpers
            for out_dtype in DTYPES:
                deq = driver("dequant", _raw(want), DT_CODE[out_dtype], rows, n, bits, block)
                deq = torch.frombuffer(bytearray(deq), dtype=out_dtype).reshape(rows, n) if n else deq
                _assert_float_bits_equal(deq, reference.dequantize_rows(want, n, bits, block, out_dtype))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_random_bytes(driver, bits):
    """Arbitrary bytes: all codes incl. -2**(bits-1), scales of any bit pattern (NaN, Inf, huge)."""
    g = torch.Generator().manual_seed(bits)
    rows, n, block = 3, 700, 64
    from qcoll.quant import format as fmt

    buf = torch.randint(0, 256, (rows, fmt.packed_nbytes(n, bits, block)), generator=g, dtype=torch.uint8)
    for out_dtype in DTYPES:
        deq = driver("dequant", _raw(buf), DT_CODE[out_dtype], rows, n, bits, block)
        got = torch.frombuffer(bytearray(deq), dtype=out_dtype).reshape(rows, n)
        _assert_float_bits_equal(got, reference.dequantize_rows(buf, n, bits, block, out_dtype))


def test_swizzle_quantize(driver):
    nodes, local, s, block = 3, 2, 300, 32
    for i, dtype in enumerate(DTYPES):
        x = awkward_rows(nodes * local, s, block, dtype, seed=40 + i).reshape(-1)
        for bits in BITS:
            for stochastic in (False, True):
                want = reference.swizzle_quantize(x, nodes, local, bits, block, stochastic, 99, 5)
                got = driver("swizzle", _raw(x), DT_CODE[dtype], nodes, local, s, bits, block, int(stochastic), 99, 5)
                assert got == _raw(want), (dtype, bits, stochastic)


# ------------------------------------------------------------------ reductions
def _nan_in_last_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """NaN at the start of row 0's last (partial) block, whose padding then dequantizes to NaN
    as well: the sum is cut to n before it is re-padded with zeros."""
    x = x.clone()
    x[0, (x.shape[1] - 1) // block * block] = float("nan")
    return x


@pytest.mark.parametrize("k,rows,n,block_in,block_out", [(1, 2, 300, 32, 64), (3, 2, 1000, 128, 32), (4, 1, 77, 64, 128)])
def test_reduce(driver, k, rows, n, block_in, block_out):
    for bits_in in BITS:
        sets = [reference.quantize_rows(_nan_in_last_block(awkward_rows(rows, n, block_in, torch.float32, seed=j * 7 + bits_in), block_in),
                                        bits_in, block_in) for j in range(k)]
        if k > 1:  # overflow of the fp32 sum to inf
            big = torch.full((rows, n), 3.0e38)
            big[0] = 1.0  # row 0 keeps a finite sum (its NaN sits in the last block's padding)
            sets[0] = reference.quantize_rows(big, bits_in, block_in)
            sets[1] = reference.quantize_rows(big, bits_in, block_in)
        bufs = torch.stack(sets)
        got = driver("reduce", _raw(bufs), k, rows, n, bits_in, block_in)
        got = torch.frombuffer(bytearray(got), dtype=torch.float32).reshape(rows, n)
        _assert_float_bits_equal(got, reference.dequantize_reduce(bufs, n, bits_in, block_in))
        for bits_out in BITS:
            for stochastic in (False, True):
                want = reference.reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, 7, 11)
                got = driver("requant", _raw(bufs), k, rows, n, bits_in, block_in, bits_out, block_out,
                             int(stochastic), 7, 11)
                assert got == _raw(want), (bits_in, bits_out, stochastic)
