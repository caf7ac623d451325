"""Outlier reserve (docs/FORMAT.md "Outlier reserve") against a float64 numpy oracle."""
import numpy as np
import pytest
import torch

from qcoll.quant import outliers as reserve
from qcoll.quant import quantize

QMAX = {8: 127, 6: 31, 4: 7, 2: 1}


def spiky(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 0.01
    return torch.where(torch.rand(rows, n, generator=g) < 0.02, torch.randn(rows, n, generator=g) * 3, x)


def oracle(x: np.ndarray, bits: int, block: int, k: int):
    """Per element: (kept exactly?, error bound) from the format's rule, in float64."""
    n = x.size
    nb = -(-n // block)
    pad = np.zeros(nb * block)
    pad[:n] = x
    kept = np.zeros(nb * block, dtype=bool)
    bound = np.zeros(nb * block)
    for b in range(nb):
        blk = pad[b * block:(b + 1) * block]
        order = sorted(range(block), key=lambda i: (-abs(blk[i]), i))  # |x| descending, ties to the lower index
        kept[b * block + np.array(order[:k], dtype=int)] = True
        rest = np.abs(np.delete(blk, order[:k])) if k else np.abs(blk)
        bound[b * block:(b + 1) * block] = (rest.max() if rest.size else 0.0) / QMAX[bits] / 2
    return kept[:n], bound[:n]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("n,block", [(1000, 128), (64, 64), (33, 32), (4096 + 5, 4096)])
def test_reserved_values_are_exact_and_the_rest_within_the_remaining_scale(bits, k, n, block):
    x = spiky(3, n, seed=n + k + bits)
    buf = reserve.quantize_rows(x, bits, block, k)
    assert buf.dtype == torch.uint8 and buf.shape == (3, reserve.packed_nbytes(n, bits, block, k))
    y = reserve.dequantize_rows_fp32(buf, n, bits, block, k).double().numpy()
    for r in range(3):
        xr = x[r].double().numpy()
        kept, bound = oracle(xr, bits, block, k)
        assert np.array_equal(y[r][kept], xr[kept])
        assert np.all(np.abs(y[r] - xr) <= bound * (1 + 1e-6) + 1e-30)


def test_layout_sizes_follow_the_format():
    # 1000 elements, block 128: 8 blocks; 4-bit codes 8*64 bytes, scales 8*4; k=3: 24 u16 positions
    # (48 bytes, already a multiple of 4) and 24 fp32 values; k=1: 8 u16 = 16 bytes.
    assert reserve.packed_nbytes(1000, 4, 128, 3) == 8 * 64 + 8 * 4 + 48 + 24 * 4
    assert reserve.packed_nbytes(1000, 4, 128, 1) == 8 * 64 + 8 * 4 + 16 + 8 * 4
    # 1 block, k=1: one u16 padded to 4 bytes
    assert reserve.packed_nbytes(100, 8, 128, 1) == 128 + 4 + 4 + 4
    assert reserve.packed_nbytes(100, 8, 128, 0) == 128 + 4


def test_reserve_zero_is_the_plain_codec_and_the_prefix_is_the_plain_row_of_the_rest():
    x = spiky(2, 500, seed=1)
    assert torch.equal(reserve.quantize_rows(x, 4, 128, 0)[0], quantize(x[0], 4, 128).data)
    buf = reserve.quantize_rows(x, 4, 128, 2)
    base = reserve.packed_nbytes(500, 4, 128, 0)
    _, _, rest = reserve.select(x, 128, 2)
    assert torch.equal(buf[0, :base], quantize(rest[0], 4, 128).data)


def test_ties_go_to_the_lower_index_and_padding_is_never_written():
    x = torch.zeros(1, 40)
    x[0, 3] = x[0, 9] = -2.0
    x[0, 7] = 2.0
    pos, values, _ = reserve.select(x, 32, 2)
    assert pos[0, 0].tolist() == [3, 7] and values[0, 0].tolist() == [-2.0, 2.0]
    assert pos[0, 1].tolist() == [0, 1]          # the 8-element tail block: real zeros before padding
    y = reserve.dequantize_rows_fp32(reserve.quantize_rows(x, 4, 32, 2), 40, 4, 32, 2)
    assert y.shape == (1, 40) and y[0, 9] == -2.0


def test_non_finite_values_are_reserved_first_and_never_become_finite():
    x = spiky(1, 256, seed=3)
    x[0, 10], x[0, 20], x[0, 200] = float("nan"), float("inf"), float("-inf")
    y = reserve.dequantize_rows_fp32(reserve.quantize_rows(x, 4, 128, 2), 256, 4, 128, 2)
    assert torch.isnan(y[0, 10]) and y[0, 20] == float("inf") and torch.isfinite(y[0, 128:200]).all()
    assert y[0, 200] == float("-inf")
    # two non-finite values in a block with a reserve of 1: the block decodes non-finite throughout
    z = reserve.dequantize_rows_fp32(reserve.quantize_rows(x, 4, 128, 1), 256, 4, 128, 1)
    assert not torch.isfinite(z[0, :128]).any()


def test_bad_reserve_names_the_argument():
    with pytest.raises(ValueError, match="outliers"):
        reserve.check_outliers(9, 128)
    with pytest.raises(TypeError, match="outliers"):
        reserve.check_outliers(True, 128)
