"""The native CPU codec (src/cpu/codec.c through qcoll.bindings.cpu) is byte-identical to the reference,
runs where qcoll.quant.cpu says it does, and falls back cleanly when it cannot be built."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qcoll.bindings import cpu as native
from qcoll.quant import cpu, reference
from qcoll.quant import format as fmt

from cuda_testdata import values_at_absmax

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native CPU codec unavailable: {native._broken}")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN where the other is NaN, every other value bit for bit (so -0.0 != 0.0)."""
    it = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and \
        torch.equal(a.masked_fill(nan, 0).view(it), b.masked_fill(nan, 0).view(it))


def _tie_block(bits: int, block: int) -> torch.Tensor:
    """A block whose absmax is qmax (so 1/scale is exactly 1) holding every x.5 in (-qmax, qmax): exact ties."""
    qm = fmt.qmax(bits)
    v = (torch.arange(block) % min(2 * qm, block) - min(qm, block // 2) + 0.5).to(torch.float32)
    v[0] = qm
    return v


def _special_rows(rows: int, n: int, block: int, bits: int, seed: int) -> torch.Tensor:
    """Random rows of every magnitude with, in row 0, a block of each kind the format treats apart: all
    zero, one NaN, +Inf, -Inf, FLT_MAX-sized, exact ties, tiny (not subnormal-range), NaN beside Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, n).unsqueeze(0)
    blocks = [torch.zeros(block), torch.randn(block, generator=g), torch.randn(block, generator=g),
              torch.randn(block, generator=g), torch.randn(block, generator=g) * 3e38, _tie_block(bits, block),
              torch.randn(block, generator=g) * 1e-30, torch.randn(block, generator=g)]
    blocks[1][3] = float("nan")
    blocks[2][-1] = float("inf")
    blocks[3][0] = float("-inf")
    blocks[7][1], blocks[7][2] = float("inf"), float("-nan")
    for i, b in enumerate(blocks):
        if (i + 1) * block <= n:
            x[0, i * block:(i + 1) * block] = b
    return x


def _calls():
    return dict(native._calls)


# (rows, n, block, sliced): whole blocks only, partial last blocks, odd row lengths, and rows at an odd
# offset with an odd stride (a slice of a wider tensor); block sizes 32..512
_SHAPES = [(1, 8 * 64, 64, False), (1, 9 * 32 + 5, 32, False), (3, 7 * 128 + 1, 128, False),
           (2, 9 * 256 + 6, 256, True), (2, 8 * 512 + 3, 512, True), (1, 40, 32, True)]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_rows_byte_identical_to_reference(bits):
    """Packed bytes of qcoll.quant.cpu equal the reference's, and the native kernel ran for them; the
    decoded values (fp32 and bf16 by the kernel, fp16 elsewhere) equal the reference's bit for bit."""
    for k, (rows, n, block, sliced) in enumerate(_SHAPES):
        x = _special_rows(rows, n + 1, block, bits, 10 * bits + k)
        x = x[:, 1:] if sliced else x[:, :n]
        before = _calls()
        want = reference.quantize_rows(x, bits, block)
        got = cpu.quantize_rows(x, bits, block)
        assert _calls()["quantize"] == before["quantize"] + 1, "the native kernel did not run"
        assert torch.equal(got, want), (rows, n, block, sliced)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.full((rows, n), 5.0, dtype=dtype)
            before = _calls()
            cpu.dequantize_rows_into(want, n, bits, block, out)
            assert _calls()["dequantize"] == before["dequantize"] + (dtype != torch.float16)
            assert _bits_equal(out, reference.dequantize_rows(want, n, bits, block, dtype)), (rows, n, block, dtype)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_ties_round_half_to_even(bits):
    """x.5 codes round to the even neighbour, as torch.round (half away from zero would differ)."""
    block = 64
    x = _tie_block(bits, block).repeat(3).reshape(1, -1)
    got = cpu.quantize_rows(x, bits, block)
    assert torch.equal(got, reference.quantize_rows(x, bits, block))
    q = reference.dequantize_rows(got, x.shape[1], bits, block, torch.float32)  # scale 1: the codes
    assert torch.equal(q, torch.round(x))
    if bits > 2:
        assert q[0, x[0] == 1.5].eq(2).all() and q[0, x[0] == 2.5].eq(2).all() and q[0, x[0] == -2.5].eq(-2).all()
    assert q[0, x[0] == 0.5].eq(0).all() and q[0, x[0] == -0.5].eq(0).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_codes_at_absmax_over_the_exponent_range(bits):
    """Values at and just below their block's absmax, absmax over the range where 1/scale is finite:
    codes of exactly +-qmax and the reference's bytes."""
    block = 32
    x = values_at_absmax(4096, block, seed=bits)
    before = _calls()
    assert torch.equal(cpu.quantize_rows(x, bits, block), reference.quantize_rows(x, bits, block))
    assert _calls()["quantize"] == before["quantize"] + 1


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_dequantize_of_arbitrary_bytes(bits):
    """Random bytes as a packed buffer (scales of every exponent: NaN, Inf, subnormal, huge, so products
    saturate or are 0 * Inf) decode bit for bit like the reference, into fp32 and bf16."""
    rows, n, block = 3, 6 * 64 + 7, 64
    nbytes = fmt.packed_nbytes(n, bits, block)
    buf = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1e-45, 0.0])  # row 0's scales
    buf[0, fmt.codes_nbytes(n, bits, block):] = special.view(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(rows, n, dtype=dtype)
        assert native.dequantize_blocks(buf[:, : fmt.codes_nbytes(n, bits, block)],
                                        buf[:, fmt.codes_nbytes(n, bits, block):], out, n // block, block, bits)
        cpu.dequantize_rows_into(buf, n, bits, block, out)
        assert _bits_equal(out, reference.dequantize_rows(buf, n, bits, block, dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_declines_subnormal_blocks(bits):
    """A block in the subnormal range (1/scale overflows) is the reference's: the kernel reports it and
    qcoll.quant.cpu's answer is the reference's."""
    n, block = 8 * 256, 256
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(bits))
    x[0, 512:768] *= 1e-40
    cb = fmt.codes_nbytes(n, bits, block)
    buf = torch.empty(1, fmt.packed_nbytes(n, bits, block), dtype=torch.uint8)
    assert native.quantize_blocks(x, buf[:, :cb], buf[:, cb:], n // block, block, bits) is False
    assert torch.equal(cpu.quantize_rows(x, bits, block), reference.quantize_rows(x, bits, block))
    assert native.enabled()


@pytest.mark.parametrize("pool", ["openmp", "threads"])
def test_native_parallel_split(monkeypatch, pool):
    """Inputs large enough to split over threads (torch's OpenMP threads, or the fallback pool), rows
    whose blocks straddle the threads' ranges: the reference's bytes and values."""
    if pool == "threads":
        monkeypatch.setattr(native, "openmp", lambda: None)
    elif native.openmp() is None:
        pytest.skip("torch runs no OpenMP runtime here")
    monkeypatch.setattr(native, "PARALLEL_NUMEL", 1 << 12)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for bits in (8, 4):
            x = _special_rows(5, 37 * 64 + 9, 64, bits, bits)
            want = reference.quantize_rows(x, bits, 64)
            assert torch.equal(cpu.quantize_rows(x, bits, 64), want)
            x[2, 700] *= 1e-42  # one tiny value, not a tiny block
            x[3, 128:192] = 1e-41  # a subnormal-range block in one thread's range only
            assert torch.equal(cpu.quantize_rows(x, bits, 64), reference.quantize_rows(x, bits, 64))
            out = torch.empty(5, x.shape[1])
            assert _bits_equal(cpu.dequantize_rows_into(want, x.shape[1], bits, 64, out),
                               reference.dequantize_rows(want, x.shape[1], bits, 64, torch.float32))
    finally:
        torch.set_num_threads(threads)


def test_qcoll_native_0_turns_it_off(monkeypatch):
    """``QCOLL_NATIVE=0``: the same bytes, without the kernel."""
    x = _special_rows(2, 9 * 64 + 3, 64, 8, 0)
    want = cpu.quantize_rows(x, 8, 64)
    monkeypatch.setenv("QCOLL_NATIVE", "0")
    before = _calls()
    assert torch.equal(cpu.quantize_rows(x, 8, 64), want)
    assert _bits_equal(cpu.dequantize_rows(want, x.shape[1], 8, 64, torch.float32),
                       reference.dequantize_rows(want, x.shape[1], 8, 64, torch.float32))
    assert _calls() == before


_SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    from qcoll.bindings import cpu as native
    from qcoll.quant import cpu, reference
    x = torch.randn(3, 9 * 64 + 5, generator=torch.Generator().manual_seed(1))
    x[0, :64] = torch.arange(64) - 31.5  # ties at 8 bits (absmax 127: 1/scale is 1)
    x[0, 0] = 127
    x[1, 70], x[2, 300] = float("inf"), float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = [torch.equal(cpu.quantize_rows(x, bits, 64), reference.quantize_rows(x, bits, 64)) for bits in (8, 4)]
        buf = reference.quantize_rows(x, 4, 64)
        got, want = (m.dequantize_rows(buf, x.shape[1], 4, 64, torch.float32) for m in (cpu, reference))
        same.append(torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()))
    msgs = [str(w.message) for w in caught if "native CPU codec" in str(w.message)]
    print(all(same), len(msgs), native._calls["quantize"], native.enabled(), msgs[0] if msgs else "")
""")


def _run_script(tmp_path, before="", **env):
    environ = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-c", before + _SCRIPT], capture_output=True, text=True, env=environ,
                          cwd=tmp_path, timeout=300)


def test_generic_build_without_avx2(tmp_path):
    """The build for CPUs without AVX2 (no -mavx2 -mfma; another cache entry) gives the same bytes."""
    done = _run_script(tmp_path, "from qcoll.bindings import cpu as native; native._has_avx2 = lambda: False\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ")[:4] == ["True", "0", "2", "True"], done.stdout
    assert len(list((tmp_path / "cache" / "qcoll").glob("*.so"))) == 1


def test_broken_compiler_warns_once_and_falls_back(tmp_path):
    """``CC=/bin/false`` with an empty cache: one warning naming the failure, the reference's bytes
    through the fallback, the native path off for the rest of the process."""
    done = _run_script(tmp_path, CC="/bin/false")
    assert done.returncode == 0, done.stderr
    same, warned, calls, enabled, msg = done.stdout.split(" ", 4)
    assert (same, warned, calls, enabled) == ("True", "1", "0", "False"), done.stdout
    assert "/bin/false" in msg and "disabled" in msg


def test_concurrent_builds_share_one_library(tmp_path):
    """Two processes building into one empty cache at once: both run the kernel, one library is left,
    no temporary files."""
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.split(" ")[:4] == ["True", "0", "2", "True"], out
    assert [f.suffix for f in (tmp_path / "cache" / "qcoll").iterdir()] == [".so"]


def test_unwritable_cache_uses_a_temporary_directory(tmp_path, monkeypatch):
    """A cache root that cannot hold a directory (here a file) gives a private temporary directory."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    path = native._cache_dir()
    assert path.is_dir() and os.access(path, os.W_OK) and tmp_path not in path.parents
    path.rmdir()
