"""CUDA kernels (qcoll.bindings.ops) against the torch reference, byte for byte (needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from cuda_testdata import BITS, DTYPES, NEEDS_GPU, awkward_rows
from qcoll.quant import format as fmt
from qcoll.quant import reference

pytestmark = NEEDS_GPU


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("cupy")
    from qcoll.bindings import ops

    return ops


def _assert_float_bits_equal(got: torch.Tensor, want: torch.Tensor):
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), "NaN positions differ"
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    assert torch.equal(got.view(ib)[~gn], want.view(ib)[~wn])


CASES = [(3, 1000, 32), (2, 777, 128), (4, 4096, 256), (1, 5, 64), (2, 3000, 1024), (1, 9000, 4096), (5, 2048, 128)]


@pytest.mark.parametrize("rows,n,block", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_dequantize(ops, rows, n, block, stochastic):
    for i, dtype in enumerate(DTYPES):
        x = awkward_rows(rows, n, block, dtype, seed=n + block + i)
        xc = x.cuda()
        for bits in BITS:
            seed, offset = 4242 + bits, (2**32 - 64 if bits == 6 else bits)
            want = reference.quantize_rows(x, bits, block, stochastic, seed, offset)
            got = ops.quantize_rows(xc, bits, block, stochastic, seed, offset)
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), want), (dtype, bits)
            for out_dtype in DTYPES:
                _assert_float_bits_equal(ops.dequantize_rows(got, n, bits, block, out_dtype),
                                         reference.dequantize_rows(want, n, bits, block, out_dtype))


def test_unaligned_and_noncontiguous(ops):
    """Views that defeat the 16-byte vector path still give the reference bytes."""
    x = torch.randn(3, 1001)
    xc = x.cuda()
    for view in (xc[:, 1:], xc.t().contiguous().t()[:, :1000], xc[:, :1000]):
        want = reference.quantize_rows(view.cpu(), 4, 64)
        assert torch.equal(ops.quantize_rows(view, 4, 64).cpu(), want)
    buf = reference.quantize_rows(x[:, :1000], 8, 32)
    big = torch.zeros(buf.numel() + 2, dtype=torch.uint8)
    big[1:-1] = buf.reshape(-1)
    shifted = big.cuda()[1:-1].view(buf.shape)  # packed input at an odd address
    _assert_float_bits_equal(ops.dequantize_rows(shifted, 1000, 8, 32, torch.float32),
                             reference.dequantize_rows(buf, 1000, 8, 32, torch.float32))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_random_bytes(ops, bits):
    g = torch.Generator().manual_seed(bits)
    buf = torch.randint(0, 256, (3, fmt.packed_nbytes(700, bits, 64)), generator=g, dtype=torch.uint8)
    for out_dtype in DTYPES:
        _assert_float_bits_equal(ops.dequantize_rows(buf.cuda(), 700, bits, 64, out_dtype),
                                 reference.dequantize_rows(buf, 700, bits, 64, out_dtype))


@pytest.mark.parametrize("nodes,local,s,block", [(2, 4, 1024, 128), (3, 2, 300, 32), (1, 8, 8192, 256)])
def test_swizzle_quantize(ops, nodes, local, s, block):
    for i, dtype in enumerate(DTYPES):
        x = awkward_rows(nodes * local, s, block, dtype, seed=i + s).reshape(-1)
        for bits in BITS:
            for stochastic in (False, True):
                want = reference.swizzle_quantize(x, nodes, local, bits, block, stochastic, 17, 3)
                got = ops.swizzle_quantize(x.cuda(), nodes, local, bits, block, stochastic, 17, 3)
                assert torch.equal(got.cpu(), want), (dtype, bits, stochastic)


def _nan_in_last_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """NaN at the start of row 0's last (partial) block, whose padding then dequantizes to NaN
    as well: the sum is cut to n before it is re-padded with zeros."""
    x = x.clone()
    x[0, (x.shape[1] - 1) // block * block] = float("nan")
    return x


@pytest.mark.parametrize("k,rows,n,block_in,block_out", [(1, 2, 300, 32, 64), (4, 3, 1000, 128, 32),
                                                        (8, 2, 4096, 256, 128), (3, 1, 77, 64, 4096)])
def test_reductions(ops, k, rows, n, block_in, block_out):
    for bits_in in BITS:
        sets = [reference.quantize_rows(_nan_in_last_block(awkward_rows(rows, n, block_in, torch.float32, seed=j + 10 * bits_in), block_in),
                                        bits_in, block_in) for j in range(k)]
        if k > 1:
            big = torch.full((rows, n), 3.0e38)
            big[0] = 1.0  # row 0 keeps a finite sum (its NaN sits in the last block's padding)
            sets[0] = sets[1] = reference.quantize_rows(big, bits_in, block_in)
        bufs = torch.stack(sets)
        bc = bufs.cuda()
        _assert_float_bits_equal(ops.dequantize_reduce(bc, n, bits_in, block_in),
                                 reference.dequantize_reduce(bufs, n, bits_in, block_in))
        for bits_out in BITS:
            for stochastic in (False, True):
                want = reference.reduce_requantize(bufs, n, bits_in, block_in, bits_out, block_out, stochastic, 5, 9)
                got = ops.reduce_requantize(bc, n, bits_in, block_in, bits_out, block_out, stochastic, 5, 9)
                assert torch.equal(got.cpu(), want), (bits_in, bits_out, stochastic)


def test_rows_dispatch_and_stream(ops):
    """qcoll.quant.rows routes CUDA tensors to the kernels; work queues on torch's current stream."""
    from qcoll.quant import rows

    x = torch.randn(4, 4096, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = rows.quantize_rows(x, 8, 256)
    s.synchronize()
    assert torch.equal(got.cpu(), reference.quantize_rows(x.cpu(), 8, 256))


def test_empty(ops):
    x = torch.zeros(0, 100, device="cuda")
    assert ops.quantize_rows(x, 8, 32).shape == (0, fmt.packed_nbytes(100, 8, 32))
    assert ops.quantize_rows(torch.zeros(2, 0, device="cuda"), 8, 32).shape == (2, 0)


def test_registered_ops_on_cuda(ops):
    """The ops themselves (what torch.compile and dispatch modes call, eager calls skip the
    dispatcher): opcheck's schema/fake/AOT checks on CUDA tensors, and the same bytes as eager."""
    x = torch.randn(3, 1000, device="cuda")
    buf = ops.quantize_rows(x, 4, 128)
    torch.library.opcheck(ops._quantize_rows_op, (x, 4, 128, False, 0, 0))
    torch.library.opcheck(ops._dequantize_rows_op, (buf, 1000, 4, 128, torch.bfloat16))
    assert torch.equal(ops._quantize_rows_op(x, 4, 128, False, 0, 0), buf)
    compiled = torch.compile(lambda t: ops.dequantize_rows(ops.quantize_rows(t, 4, 128), 1000, 4, 128,
                                                           torch.float32), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ops.dequantize_rows(buf, 1000, 4, 128, torch.float32))


def test_streams_each_get_their_own_handle(ops):
    """Launches on two torch streams, interleaved, each land on their own stream (the cached
    CuPy handles are keyed by the stream, not reused across streams)."""
    from qcoll.bindings import launch

    x = torch.randn(2, 1 << 16, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for s in streams * 2:
        with torch.cuda.stream(s):
            outs.append(ops.quantize_rows(x, 8, 256))
    torch.cuda.synchronize()
    ptrs = {(x.device.index, s.cuda_stream) for s in streams}
    assert ptrs <= set(launch._streams)
    for key in ptrs:
        assert launch._streams[key].ptr == key[1]
    want = reference.quantize_rows(x.cpu(), 8, 256)
    assert all(torch.equal(o.cpu(), want) for o in outs)


@pytest.mark.parametrize("rows,n,block", CASES)
def test_hadamard_rows(ops, rows, n, block):
    """The rotation kernel against the torch reference, bit for bit (the tail copied, NaN kept)."""
    from qcoll.quant.hadamard import hadamard_rows

    x = awkward_rows(rows, n, block, torch.float32, seed=n + block)
    got = ops.hadamard_rows(x.cuda(), block)
    _assert_float_bits_equal(got, hadamard_rows(x, block))
    _assert_float_bits_equal(ops.hadamard_rows(got, block).cpu(), hadamard_rows(hadamard_rows(x, block), block))


def test_outlier_reserve_on_cuda_matches_cpu(ops):
    """The reserve selects with a stable sort and quantizes through the kernels: the same bytes as on CPU."""
    from qcoll.quant import outliers as reserve

    x = awkward_rows(3, 3000, 128, torch.float32, seed=11)
    for bits in BITS:
        for k in (1, 3, 8):
            got = reserve.quantize_rows(x.cuda(), bits, 128, k)
            want = reserve.quantize_rows(x, bits, 128, k)
            assert torch.equal(got.cpu(), want), (bits, k)
            _assert_float_bits_equal(reserve.dequantize_rows_fp32(got, 3000, bits, 128, k).cpu(),
                                     reserve.dequantize_rows_fp32(want, 3000, bits, 128, k))
