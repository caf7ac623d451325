"""ZeRO++ converges like unquantized ZeRO-3 on a real model and real text.

A 4-layer, d=128 character-level transformer on the Python standard library's
sources (read in a fixed order), 4 ranks as 2 nodes x 2, the same batches and AdamW
(lr 1e-3) for every configuration. ZeRO++ runs at the defaults: weight block 256,
hpZ, 4-bit round-to-nearest gradients in blocks of 128; 8-bit and 4-bit weights.

The score is the mean training loss of steps 161-200 (the same batches for every run).
The bound is the run-to-run noise of ZeRO-3 itself: the test trains ZeRO-3 from two
initialization seeds and checks (1) that they differ by less than ``TOLERANCE`` (if
not, the setup has become too noisy for the comparison to mean anything) and (2) that
each ZeRO++ run from seed A is within ``TOLERANCE`` of ZeRO-3 from seed A.
Measured on the project's machine (bench/RESULTS.md, "Convergence at the default block"):
ZeRO-3 from 4 seeds scores 2.349-2.405 (sd 1.2%, largest pair 2.4%); paired with
ZeRO-3 on the same seed, 8/4 is within 0.3% on all four, 4/4 within 0.4-2.3% on
three. ``TOLERANCE`` = 3% is the largest ZeRO-3 seed pair rounded up, about 2.5 sd.

Why this setup, and not the earlier lr 2e-3 / 120 steps / last-20 score: at lr 2e-3
the model sits on a plateau near 3.17 (the unigram loss) and leaves it at a step that
is chaotic: the same configuration leaves it at step 25-120 depending on the seed,
and a run that leaves it 30 steps late scores ~8% worse at step 120, so the old test
was a coin flip of escape timing (bench/RESULTS.md has the escape steps). At lr 1e-3
every configuration and seed tried leaves the plateau at steps 36-43 and the loss is
lower at every step than at 2e-3. The score is taken at step 200 because the 4-bit
weights' lag is transient: 3-4% around step 100, about 1% from step 200 on.

The test can fail: with the same score and bound, a gradient reduction that keeps
each rank's own micro-batch gradient (no communication) is 9.7% behind and 4-bit
weights with 4096-element blocks 4.3% behind. It is not a precision instrument: 2-bit
gradients, or one rank's gradients scaled x4, stay within it (Adam is forgiving), and
2-bit weights from scratch are within 1% at step 200 and fall behind only later
(3.6% at step 300). ``bench/convergence_sweep.py`` runs the longer comparisons.
"""
import pytest
import torch

import qcoll
from qcoll import zero
from qcoll.testing import Batches, TransformerConfig, char_transformer, corpus, train_steps

pytestmark = pytest.mark.long   # ~5.5 min on 2 cores: outside the default run (pytest -m long runs it)

STEPS, TAIL, BATCH, LR, BATCH_SEED = 200, 40, 16, 1e-3, 7
SEED_A, SEED_B = 0, 1
TOLERANCE = 0.03
MODEL = TransformerConfig(context=64, d_model=128, n_layers=4, n_heads=4)


def _run(rank, world, config, seed=SEED_A):
    topo = qcoll.Topology(2)
    model = char_transformer(MODEL, seed)
    m = zero.shard(model, topo, config, units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=LR, weight_decay=0.0)
    return train_steps(m, opt, Batches(corpus(), BATCH, MODEL.context, BATCH_SEED), STEPS, rank=rank, world=world)


def _score(losses):
    return sum(losses[-TAIL:]) / TAIL


@pytest.fixture(scope="module")
def zero3_scores(ranks4):
    runs = {seed: ranks4.run(_run, zero.ZeroConfig.zero3(), seed, timeout=600)[0] for seed in (SEED_A, SEED_B)}
    for seed, losses in runs.items():
        assert _score(losses) < 0.8 * sum(losses[:TAIL]) / TAIL, f"ZeRO-3 from seed {seed} did not learn"
    return {seed: _score(losses) for seed, losses in runs.items()}


@pytest.mark.slow
def test_zero3_seed_noise_is_within_the_tolerance(zero3_scores):
    a, b = zero3_scores[SEED_A], zero3_scores[SEED_B]
    assert abs(b - a) <= TOLERANCE * a, (
        f"ZeRO-3 from seeds {SEED_A} and {SEED_B} scores {a:.4f} and {b:.4f}: the run-to-run noise is above "
        f"{TOLERANCE:.0%}, so the ZeRO++ comparison below is not meaningful; revisit the setup")


@pytest.mark.slow
@pytest.mark.parametrize("weight_bits", [8, 4])
def test_zeropp_within_zero3_seed_noise(ranks4, zero3_scores, weight_bits):
    config = zero.ZeroConfig(weight_bits=weight_bits, hpz=True, grad_bits=4)
    assert config.weight_block == 256 and not config.stochastic_grad_rounding
    score = _score(ranks4.run(_run, config, SEED_A, timeout=600)[0])
    base = zero3_scores[SEED_A]
    assert abs(score - base) <= TOLERANCE * base, (
        f"{weight_bits}-bit weights / 4-bit gradients score {score:.4f} against ZeRO-3's {base:.4f} "
        f"({score / base:.3f}x; ZeRO-3 from seed {SEED_B}: {zero3_scores[SEED_B]:.4f})")


def _run_fsdp2(rank, world, seed=SEED_A):
    """FSDP2 (blocks resharded inside the node after forward) with quantize_comm's defaults:
    8-bit weights in blocks of 256, hpZ, 4-bit gradients in blocks of 128."""
    from qcoll.fsdp import quantize_comm
    from qcoll.testing.fsdp2 import mesh_for, shard_fsdp2

    topo = qcoll.Topology(2)
    model = char_transformer(MODEL, seed)
    shard_fsdp2(model, model.blocks, mesh_for(False, 2), reshard_after_forward=2)
    quantize_comm(model, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return train_steps(model, opt, Batches(corpus(), BATCH, MODEL.context, BATCH_SEED), STEPS, rank=rank, world=world)


@pytest.mark.slow
def test_fsdp2_with_qcoll_comms_within_zero3_seed_noise(ranks4, zero3_scores):
    score = _score(ranks4.run(_run_fsdp2, SEED_A, timeout=600)[0])
    base = zero3_scores[SEED_A]
    assert abs(score - base) <= TOLERANCE * base, (
        f"FSDP2 + quantize_comm scores {score:.4f} against ZeRO-3's {base:.4f} ({score / base:.3f}x; ZeRO-3 "
        f"from seed {SEED_B}: {zero3_scores[SEED_B]:.4f})")
