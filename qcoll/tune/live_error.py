"""The codec's error on a sharded model's live tensors: what a configuration would cost in accuracy.

Measured on the tensors the configuration would quantize, not on the loss (which moves for other
reasons): each group's fp32 master shard quantized as the forward's qwZ gather quantizes it
(``weight_bits`` in blocks of ``weight_block``, the shard's own blocks), and each group's reduced
gradient shard (``master.grad``) quantized at each qgZ hop's bits in blocks of ``grad_block``. Each
hop quantizes once, so the gradient error is the root sum of squares of the two hops' errors (a
pair ``(intra, inter)`` gives one error at each width, an int ``b`` two at ``b``). The reduced
gradient stands in for the per-rank gradients the hops quantize (those are gone after the backward).
The plain codec is used: a rotation or an outlier reserve of the configuration would only lower the
error, so the budget is checked conservatively. Any width of :data:`qcoll.quant.format.VALID_BITS`
(2 bits included, alone or in a pair) is measured alike; with error feedback the same one-step error
is what a step delays rather than loses, and :class:`~qcoll.tune.AutoTune` holds it to its own budget
(``feedback_error``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.stats import stats
from ..quant import dequantize, quantize
from ..zero.state import state_of


def _squared_error(x: torch.Tensor, bits: int, block: int) -> float:
    if x.numel() == 0:
        return 0.0
    x = x.detach().float().reshape(-1)
    return float((dequantize(quantize(x, bits, block), dtype=torch.float32) - x).double().pow(2).sum())


def squared_errors(w: torch.Tensor, grad: torch.Tensor | None, weight_bits: int | None, grad_bits, weight_block: int,
                   grad_block: int) -> list[float]:
    """``[weight error, weight, gradient error, gradient]`` squared sums of one rank's shard ``w`` and its
    gradient (each hop of ``grad_bits`` once; see the module docstring)."""
    hops = () if grad_bits is None else (tuple(grad_bits) if isinstance(grad_bits, tuple) else (grad_bits, grad_bits))
    out = [0.0, float(w.double().pow(2).sum()), 0.0, 0.0]
    if weight_bits is not None:
        out[0] = _squared_error(w, weight_bits, weight_block)
    if grad is not None:
        out[3] = float(grad.double().pow(2).sum())
        out[2] = sum(_squared_error(grad, b, grad_block) for b in hops)
    return out


def relative_errors(model, weight_bits: int | None, grad_bits, weight_block: int, grad_block: int) -> tuple[float, float]:
    """``(weight error, gradient error)`` of a ``qcoll.zero`` model's master shards (:func:`shard_errors`;
    replicated groups, never gathered nor reduce-scattered, left out)."""
    return shard_errors(((g.master.detach(), g.master.grad) for g in state_of(model).groups if not g.replicated),
                        weight_bits, grad_bits, weight_block, grad_block)


def shard_errors(shards, weight_bits: int | None, grad_bits, weight_block: int, grad_block: int) -> tuple[float, float]:
    """``(weight error, gradient error)``: relative L2 errors (``||q(x) - x|| / ||x||``) over every
    rank's ``shards`` (``(weight shard, its gradient or None)`` pairs; one all-reduce of four float64
    over the world, a collective: every rank calls it with the same arguments). 0 for an unquantized
    side; the gradient error is NaN when no rank holds a gradient (call it between
    ``optimizer.step()`` and ``zero_grad()``)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for w, grad in shards:
        sums += torch.tensor(squared_errors(w, grad, weight_bits, grad_bits, weight_block, grad_block),
                             dtype=torch.float64)
    dist.all_reduce(sums)
    stats.add("autotune.error", None, sums.numel() * sums.element_size())
    return ratios(sums.tolist(), grad_bits)


def ratios(sums: list[float], grad_bits) -> tuple[float, float]:
    """``(weight error, gradient error)`` of the world's squared sums (:func:`squared_errors`)."""
    w_err, w_sq, g_err, g_sq = sums
    weight = (w_err / w_sq) ** 0.5 if w_sq > 0 else 0.0
    grad = float("nan") if g_sq == 0 and grad_bits is not None else ((g_err / g_sq) ** 0.5 if g_sq > 0 else 0.0)
    return weight, grad
