"""The torch.compile'd CPU fast path (qcoll.quant.cpu) is byte-identical to the eager reference."""
import pytest
import torch

from qcoll.quant import compiled, cpu, reference
from qcoll.quant import format as fmt

from cuda_testdata import values_at_absmax


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


# the default run keeps three (every bits value's compiled graphs, each output dtype, are checked byte for byte
# by test_compiled_rows_byte_identical_to_reference below); pytest -m long runs the rest
_LONG = pytest.mark.long


@pytest.mark.parametrize("bits,rows,block,dtype", [
    (8, 1, 256, torch.float32), pytest.param(6, 1, 256, torch.float32, marks=_LONG),
    pytest.param(4, 1, 256, torch.float32, marks=_LONG), pytest.param(2, 1, 256, torch.float32, marks=_LONG),
    (4, 2, 128, torch.bfloat16), pytest.param(8, 2, 128, torch.float16, marks=_LONG),
    (6, 3, 64, torch.bfloat16),
])
def test_compiled_fast_path_matches_eager(monkeypatch, bits, rows, block, dtype):
    monkeypatch.setenv("QCOLL_NATIVE", "0")  # the native kernel (tests/test_codec_native.py) would run first
    taken = []  # what the compiled path returned: a tensor / True when it ran, None / False when it declined
    for name in ("quantize_rows", "dequantize_rows_into"):
        real = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, _real=real: taken.append(_real(*a)) or taken[-1])
    n = compiled.MIN_NUMEL // rows + 77  # a partial last block
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n).unsqueeze(0)
    x[0, 256:512] = 0
    x[0, 1024 + 5] = float("nan")
    x[-1, 4096 + 9] = float("-inf")
    assert compiled.enabled(x.device, x.numel())
    fast = cpu.quantize_rows(x, bits, block)
    fast_deq = cpu.dequantize_rows(fast, n, bits, block, dtype)
    into = torch.full((rows, 2 * n), 7.0, dtype=dtype)[:, ::2]  # a strided out
    cpu.dequantize_rows_into(fast, n, bits, block, into)
    assert not compiled._broken
    assert len(taken) == 3 and all(t is True or isinstance(t, torch.Tensor) for t in taken), taken
    monkeypatch.setenv("QCOLL_COMPILE", "0")
    assert not compiled.enabled(x.device, x.numel())
    assert torch.equal(cpu.quantize_rows(x, bits, block), fast) and len(taken) == 3  # QCOLL_COMPILE=0: the reference
    monkeypatch.delenv("QCOLL_COMPILE")
    eager = reference.quantize_rows(x, bits, block)
    eager_deq = reference.dequantize_rows(eager, n, bits, block, dtype)
    assert torch.equal(fast, eager)
    assert fast_deq.dtype == dtype and _same(fast_deq, eager_deq) and _same(into, eager_deq)
    # eager's own conversion: the fp32 values rounded to the output dtype
    assert _same(eager_deq, reference.dequantize_rows(eager, n, bits, block, torch.float32).to(dtype))


@pytest.mark.parametrize("n", [100, compiled.MIN_NUMEL])
def test_dequantize_into_rejects_a_wrong_out_shape(n):
    buf = reference.quantize_rows(torch.randn(2, n), 8, 64)
    for codec in (reference, cpu):
        with pytest.raises(ValueError, match=rf"out must have shape \(2, {n}\)"):
            codec.dequantize_rows_into(buf, n, 8, 64, torch.empty(2, n - 1))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1000, compiled.MIN_NUMEL + 3])
def test_dequantize_into_out_that_holds_the_packed_bytes(bits, n):
    """``out`` sharing memory with the packed buffer (decoding in place) gives the exact values."""
    import qcoll

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = qcoll.quantize(x, bits=bits, block_size=64)
    want = qcoll.dequantize(packed)
    store = torch.zeros(n)
    nbytes = packed.nbytes
    store.view(torch.uint8)[:nbytes].copy_(packed.data)
    aliased = qcoll.Packed(store.view(torch.uint8)[:nbytes], n, bits, 64, x.shape, x.dtype)
    assert torch.equal(qcoll.dequantize(aliased, out=store), want)


def _special_rows(rows: int, n: int, block: int, seed: int) -> torch.Tensor:
    """Random rows with, in row 0, a block of each kind the format treats apart: all zero, one
    NaN, +Inf, -Inf, FLT_MAX-sized, exact halves (ties to even) and a tiny (not subnormal-range) one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, n).unsqueeze(0)
    blocks = [torch.zeros(block), torch.randn(block, generator=g), torch.randn(block, generator=g),
              torch.randn(block, generator=g), torch.randn(block, generator=g) * 3e38,
              (torch.arange(block) % 16 - 7.5), torch.randn(block, generator=g) * 1e-30]
    blocks[1][3] = float("nan")
    blocks[2][-1] = float("inf")
    blocks[3][0] = float("-inf")
    for i, b in enumerate(blocks):
        if (i + 1) * block <= n:
            x[0, i * block:(i + 1) * block] = b
    return x


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN where the other is NaN, every other value bit for bit (so -0.0 != 0.0). NaN payloads
    may differ: the vectorized clamp makes all-ones NaNs, the eager one 0x7FC00000."""
    it = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and \
        torch.equal(a.masked_fill(nan, 0).view(it), b.masked_fill(nan, 0).view(it))


# rows and lengths: whole blocks only, a partial last block, an odd row length (4 and 2 bits read a
# contiguous copy), and rows at an odd offset with an odd stride (a slice of a wider tensor)
_SHAPES = [(1, 8 * 64, 64, False), (1, 9 * 64 + 5, 64, False), (3, 7 * 64 + 1, 64, False),
           (2, 9 * 64 + 6, 64, False), (2, 8 * 32 + 3, 32, True)]


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_compiled_rows_byte_identical_to_reference(monkeypatch, bits):
    """Every bits value, small and odd shapes called on the compiled functions directly (below
    MIN_NUMEL): the packed bytes, and the decoded values in each output dtype, bit for bit."""
    graphs = []
    real_call = compiled._call
    monkeypatch.setattr(compiled, "_call", lambda name, *a: graphs.append(name) or real_call(name, *a))
    for k, (rows, n, block, sliced) in enumerate(_SHAPES):
        x = _special_rows(rows, n + 1, block, 10 * bits + k)
        x = x[:, 1:] if sliced else x[:, :n]
        want = reference.quantize_rows(x, bits, block)
        got = compiled.quantize_rows(x, bits, block)
        assert got is not None and torch.equal(got, want), (rows, n, block)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.full((rows, n), 5.0, dtype=dtype)
            assert compiled.dequantize_rows_into(want, n, bits, block, out)
            assert _bits_equal(out, reference.dequantize_rows(want, n, bits, block, dtype)), (rows, n, block, dtype)
    assert not compiled._broken
    want_graphs = {8: {"quantize_into", "scale"}, 6: {"quantize", "pack_into", "unpack", "scale"},
                   4: {"quantize_into", "dequantize_pairs", "unpack", "scale"}, 2: {"quantize_into", "quantize", "pack_into", "unpack", "scale"}}
    assert set(graphs) == want_graphs[bits]  # (4 bits: odd row lengths decode through unpack + scale; 2 bits: blocks of 32 pack apart)


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_compiled_dequantize_of_arbitrary_bytes(bits):
    """Random bytes as a packed buffer (scales of every exponent: NaN, Inf, subnormal, huge, so
    products saturate) decode bit for bit like the reference, into fp32 and bf16."""
    rows, n, block = 2, 6 * 64 + 7, 64
    nbytes = fmt.packed_nbytes(n, bits, block)
    buf = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(rows, n, dtype=dtype)
        assert compiled.dequantize_rows_into(buf, n, bits, block, out)
        assert _bits_equal(out, reference.dequantize_rows(buf, n, bits, block, dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_compiled_quantize_declines_subnormal_blocks(bits):
    """A block in the subnormal range (1/scale overflows) is the reference's: the compiled path
    returns None, and qcoll.quant.cpu's answer (the reference's) is identical."""
    n, block = compiled.MIN_NUMEL, 256
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(bits))
    x[0, 512:768] *= 1e-40  # subnormal values: qmax / absmax overflows even for qmax = 1
    assert compiled.quantize_rows(x, bits, block) is None
    assert torch.equal(cpu.quantize_rows(x, bits, block), reference.quantize_rows(x, bits, block))
    assert not compiled._broken


def test_compiled_quantize_into_a_given_buffer():
    """``buf=``: the codes and scales land in the caller's tensor (a view of a wider one), and
    nothing outside it is written."""
    rows, n, block = 2, 5 * 64 + 9, 64
    x = _special_rows(rows, n, block, 3)
    nbytes = fmt.packed_nbytes(n, 4, block)
    store = torch.full((rows, nbytes + 8), 0xAB, dtype=torch.uint8)
    got = compiled.quantize_rows(x, 4, block, store[:, 4:4 + nbytes])
    assert got is not None and got.data_ptr() == store[:, 4:].data_ptr()
    assert torch.equal(store[:, 4:4 + nbytes], reference.quantize_rows(x, 4, block))
    assert bool((store[:, :4] == 0xAB).all()) and bool((store[:, 4 + nbytes:] == 0xAB).all())


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_compiled_quantize_without_clamp_at_absmax(bits):
    """The quantize graphs skip the reference's clamp (see ``compiled._round``): blocks whose
    values sit at and just below their absmax, over the exponent range where 1/scale is finite, still give
    the reference's bytes (codes of exactly +-qmax)."""
    block = 32
    x = values_at_absmax(8192, block, seed=bits)
    got = compiled.quantize_rows(x, bits, block)
    want = reference.quantize_rows(x, bits, block)
    assert got is not None and torch.equal(got, want)
