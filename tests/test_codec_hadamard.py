"""Block-local Walsh-Hadamard rotation against a float64 oracle (the Sylvester matrix)."""
import numpy as np
import pytest
import torch

from qcoll.quant.hadamard import hadamard_rows


def sylvester(b: int) -> np.ndarray:
    """The orthonormal b x b Hadamard matrix in natural (Sylvester) order, float64."""
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(b)


@pytest.mark.parametrize("block", [32, 64, 128, 256, 4096])
@pytest.mark.parametrize("n", [0, 31, 256, 1000, 8192 + 77])
def test_rotation_matches_the_float64_matrix_and_leaves_the_tail(block, n):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n + block)) * 5
    got = hadamard_rows(x, block)
    h = sylvester(block)
    full = n // block * block
    want = x.double().numpy().copy()
    for r in range(3):
        for a in range(0, full, block):
            want[r, a:a + block] = h @ want[r, a:a + block]
    # fp32 butterflies: log2(block) rounded additions, each within 2^-24 of the running magnitude
    tol = np.log2(block) * 2.0 ** -23 * np.sqrt(block) * np.abs(x.double().numpy()).max(initial=0.0) + 1e-30
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert np.abs(got.double().numpy() - want).max(initial=0.0) <= tol
    assert torch.equal(got[:, full:], x[:, full:])


@pytest.mark.parametrize("block", [32, 128, 1024])
def test_rotation_is_its_own_inverse(block):
    x = torch.randn(4, 3 * block + 5, generator=torch.Generator().manual_seed(block))
    back = hadamard_rows(hadamard_rows(x, block), block)
    assert (back - x).abs().max() <= 2 * np.log2(block) * 2.0 ** -23 * np.sqrt(block) * x.abs().max()


def test_rotation_preserves_norms_and_spreads_a_spike():
    x = torch.zeros(1, 256)
    x[0, 17] = 64.0
    y = hadamard_rows(x, 256)
    assert torch.allclose(y.abs(), torch.full_like(y, 4.0))       # 64 / sqrt(256) everywhere
    z = torch.randn(2, 512)
    assert torch.allclose(hadamard_rows(z, 128).norm(dim=1), z.norm(dim=1), rtol=1e-6)


def test_non_finite_values_stay_in_their_block_and_stay_non_finite():
    x = torch.randn(1, 3 * 64)
    x[0, 70] = float("nan")
    x[0, 150] = float("inf")
    y = hadamard_rows(x, 64)
    assert torch.isfinite(y[0, :64]).all()
    assert not torch.isfinite(y[0, 64:128]).any() and not torch.isfinite(y[0, 128:]).any()
