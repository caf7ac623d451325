"""ZeRO++ converges like unquantized ZeRO-3 on a real model and real text.

A 4-layer, d=128 character-level transformer on the Python standard library's
sources (read in a fixed order), 4 ranks as 2 nodes x 2, the same batches and
AdamW for every configuration. The score is the mean training loss of the last
``TAIL`` steps (same batches across configurations), so one noisy batch does not
decide; 120 steps takes the comparison past the first fast drop of the loss, where
a run that lags by a few steps looks several percent worse. Longer runs (300+
steps) are ``qcoll-bench train``'s job (bench/RESULTS.md).

4-bit weights use blocks of 128 instead of the default 256: with only 7 levels per
sign the step is absmax/7, and on this model 256-element blocks left the 4/4 run
7% behind at step 120 on the project's machine, while 128 is on par (figures in
bench/RESULTS.md). 8-bit weights use the default.
"""
import pytest
import torch

import qcoll
from qcoll import zero
from qcoll.bench.textdata import Batches
from qcoll.bench.transformer import CharTransformer, TransformerConfig

from zero_helpers import data, global_loss

STEPS, TAIL, BATCH = 120, 20, 16
MODEL = TransformerConfig(context=64, d_model=128, n_layers=4, n_heads=4)


def _run(rank, world, config):
    topo = qcoll.Topology(2)
    torch.manual_seed(0)
    model = CharTransformer(MODEL)
    m = zero.shard(model, topo, config, units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=2e-3, weight_decay=0.0)
    batches = Batches(data(), BATCH, MODEL.context, 7)
    losses = []
    for _ in range(STEPS):
        x, y = batches.next(rank, world)
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss))
    return losses


@pytest.fixture(scope="module")
def zero3_losses(ranks4):
    return ranks4.run(_run, zero.ZeroConfig.zero3(), timeout=300)[0]


def _tail(losses):
    return sum(losses[-TAIL:]) / TAIL


@pytest.mark.slow
@pytest.mark.parametrize("weight_bits,weight_block,tolerance", [(8, 256, 0.02), (4, 128, 0.05)])
def test_zeropp_loss_within_tolerance_of_zero3(ranks4, zero3_losses, weight_bits, weight_block, tolerance):
    config = zero.ZeroConfig(weight_bits=weight_bits, hpz=True, grad_bits=4, weight_block=weight_block)
    losses = ranks4.run(_run, config, timeout=300)[0]
    base = _tail(zero3_losses)
    assert _tail(zero3_losses) < 0.8 * sum(zero3_losses[:TAIL]) / TAIL, "the baseline did not learn"
    assert abs(_tail(losses) - base) <= tolerance * base, (weight_bits, _tail(losses), base)
