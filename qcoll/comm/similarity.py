"""Gradient similarity measured inside qgZ (SimiGrad), from what the reduction holds anyway.

In qgZ's final reduction every rank holds, for its own slice, the ``K`` contributions
it sums: the per-node partial sums (``K = N`` nodes), or with one node the ``L`` local
ranks' gradients. Rows ``[0, K // 2)`` are half A, the rest half B. Each rank adds
its slice's ``dot(A, B)``, ``|A|^2`` and ``|B|^2``, and the quantization-noise energy of
each half (docs/SIMILARITY.md), to a caller's float64 accumulator of :data:`SIZE`
values; summed over all ranks (one all-reduce of three numbers per step), they give
the cosine of the two half-batch gradients over the whole model.
"""
from __future__ import annotations

import math

import torch

from ..quant import format as fmt
from ..quant.reference import split_rows

SIZE = 5                       # dot(A, B), |A|^2, |B|^2, noise(A), noise(B)
DOT, AA, BB, NOISE_A, NOISE_B = range(SIZE)
#: Expected squared error per element, in units of scale^2: round to nearest (uniform error
#: in [-s/2, s/2]) and stochastic rounding (f(1-f) s^2 averaged over a uniform fraction f).
NOISE_FACTOR = {False: 1.0 / 12.0, True: 1.0 / 6.0}


def new_stats(device="cpu") -> torch.Tensor:
    """A zeroed accumulator for :func:`qcoll.reduce_scatter_quantized`'s ``similarity``."""
    return torch.zeros(SIZE, dtype=torch.float64, device=device)


def check_stats(stats, device) -> None:
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"similarity must be a torch.Tensor (qcoll.comm.similarity.new_stats()), "
                        f"got {type(stats).__name__}")
    if stats.dtype != torch.float64 or stats.shape != (SIZE,) or stats.device != torch.device(device):
        raise ValueError(f"similarity must be a float64 tensor of shape ({SIZE},) on {device}, got "
                         f"{stats.dtype} {tuple(stats.shape)} on {stats.device}")


def half_split(contributions: int) -> int:
    """Rows ``[0, h)`` of ``contributions`` rows form half A."""
    return contributions // 2


def add_parts(stats: torch.Tensor, parts: torch.Tensor, half: int) -> None:
    """Add ``dot(A, B)``, ``|A|^2``, ``|B|^2`` of ``parts`` ``[K, n]`` (A: rows below ``half``)."""
    a = parts[:half].double().sum(0)
    b = parts[half:].double().sum(0)
    stats[DOT] += torch.dot(a, b)
    stats[AA] += torch.dot(a, a)
    stats[BB] += torch.dot(b, b)


def noise_energy(rows: torch.Tensor, values: torch.Tensor, bits: int, block_size: int,
                 stochastic: bool) -> torch.Tensor:
    """Expected squared quantization error of each packed row ``[K, packed_nbytes(n)]`` whose
    decoded ``values`` are ``[K, n]`` (float64 ``[K]``): per block, ``scale^2 * factor`` for
    each element with a nonzero code. An element whose code is 0 adds no noise: with round
    to nearest its error is minus itself (exact zeros, such as absent tokens' embedding
    rows, have none), so it is missing signal rather than added noise (docs/SIMILARITY.md).
    A non-finite block gives NaN."""
    n = values.shape[-1]
    _, scales = split_rows(rows, n, bits, block_size)
    nb = fmt.num_blocks(n, block_size)
    nonzero = torch.zeros(values.shape[0], nb * block_size, dtype=torch.float64, device=rows.device)
    nonzero[:, :n] = (values != 0).double()
    counts = nonzero.view(values.shape[0], nb, block_size).sum(-1)
    return (scales.double().square() * counts).sum(-1) * NOISE_FACTOR[stochastic]


def add_noise(stats: torch.Tensor, energy: torch.Tensor, half: int) -> None:
    """Add the rows' noise ``energy`` ``[K]`` to half A (rows below ``half``) and half B."""
    stats[NOISE_A] += energy[:half].sum()
    stats[NOISE_B] += energy[half:].sum()


def add_half_noise(stats: torch.Tensor, energy: torch.Tensor, in_half_a: bool) -> None:
    """Add ``energy`` (all of one half's contributions) to that half."""
    stats[NOISE_A if in_half_a else NOISE_B] += energy.sum()


def cosine(dot: float, aa: float, bb: float) -> float:
    """``dot / sqrt(aa * bb)``; NaN when a squared norm is not positive or not finite."""
    if not (aa > 0 and bb > 0 and math.isfinite(aa) and math.isfinite(bb) and math.isfinite(dot)):
        return math.nan
    return dot / math.sqrt(aa * bb)


def corrected(stats: torch.Tensor) -> tuple[float, float, float]:
    """``(dot, |A|^2 - noise(A), |B|^2 - noise(B))`` of summed stats: what the all-reduce sends."""
    s = stats.tolist()
    return s[DOT], s[AA] - s[NOISE_A], s[BB] - s[NOISE_B]
