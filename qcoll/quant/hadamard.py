"""Block-local Walsh-Hadamard rotation: the torch reference (docs/FORMAT.md, "Rotation").

Each full block of ``block`` elements (a power of two) of a row is multiplied by the
orthonormal Hadamard matrix ``H_B / sqrt(B)``: a fast Walsh-Hadamard transform of
``log2(B)`` butterfly stages in a fixed order (stage ``h = 1, 2, 4, ..``: elements ``j``
and ``j + h`` of each ``2h`` group become ``a + b`` and ``a - b``, in fp32), then one
multiplication by ``fp32(1 / sqrt(B))``. A row's last, partial block is left as it is.
The matrix is symmetric and orthogonal, so the same function inverts it (to fp32
rounding; exactly for ``B`` a power of four, where the scale is a power of two), and
it is linear, so sums of rotated rows are the rotated sums: qgZ rotates before its
first quantization and rotates back after its last reduction.

Rotation spreads a block's outliers over the block, so its maximum (the quantization
scale) shrinks towards its RMS; a non-finite element makes the whole block non-finite
(never finite garbage).
"""
from __future__ import annotations

import torch

from .format import rotation_scale


def hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``[rows, n]`` -> fp32 ``[rows, n]``: every full ``block`` of each row rotated."""
    rows, n = x.shape
    full = (n // block) * block
    out = x.to(torch.float32).clone()
    if full == 0 or block == 1:
        return out
    v = out[:, :full].reshape(rows, full // block, block)
    h = 1
    while h < block:
        pairs = v.reshape(rows, full // block, block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(rows, full // block, block)
        h *= 2
    out[:, :full] = (v * rotation_scale(block)).reshape(rows, full)
    return out
