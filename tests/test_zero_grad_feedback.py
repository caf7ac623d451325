"""qgZ's error feedback inside qcoll.zero (ZeroConfig.grad_error_feedback), against the
unquantized reduce-scatter of plain ZeRO-3 as the oracle.

The same batch backpropagated T times: with error feedback the T reduced gradients sum to T
times the exact one within one reduction's rounding; without it, each reduction's rounding adds
up. A coalesced reduction (reduce_bucket_numel) lays the groups' residuals side by side and must
give exactly what each group's own reduction gives.
"""
import numpy as np
import pytest
import torch

import qcoll
from qcoll import zero
from qcoll.testing.data import Batches, corpus
from qcoll.testing.models import tiny_model
from qcoll.zero.state import state_of

REPEATS = 8


def _summed_grads(rank, world, grad_bits, feedback, bucket):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    config = zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=grad_bits, grad_error_feedback=feedback,
                             reduce_bucket_numel=bucket)
    m = zero.shard(model, topo, config, units=model.units())
    x, y = Batches(corpus(), 8, 32, 4).next(rank, world)
    groups = [g for g in state_of(m).groups if g.trainable and not g.replicated]
    total = [torch.zeros_like(g.master, dtype=torch.float64) for g in groups]
    for _ in range(REPEATS):
        m(x, y).backward()
        for t, g in zip(total, groups):
            t += g.master.grad.double()
            g.master.grad = None
    report = zero.memory_report(m)
    last = [g.master.grad for g in groups]
    return [t.numpy() for t in total], report["grad_feedback"], sum(g.total for g in groups)


def test_summed_2_bit_gradients_track_the_exact_ones_with_feedback(ranks4):
    exact = ranks4.run(_summed_grads, None, False, 0)
    fed = ranks4.run(_summed_grads, 2, True, 0)
    plain = ranks4.run(_summed_grads, 2, False, 0)
    for rank in range(4):
        ref = np.concatenate([t.ravel() for t in exact[rank][0]])
        err_fed = np.abs(np.concatenate([t.ravel() for t in fed[rank][0]]) - ref).mean()
        err_plain = np.abs(np.concatenate([t.ravel() for t in plain[rank][0]]) - ref).mean()
        assert err_fed * 3 < err_plain, (rank, err_fed, err_plain)
        # memory: each group's whole size plus nodes / world of it, fp32 (padding included)
        assert fed[rank][1] >= fed[rank][2] * 4 * 1.5 and plain[rank][1] == 0


def test_a_coalesced_reduction_carries_each_groups_residual_bit_for_bit(ranks4):
    alone = ranks4.run(_summed_grads, 2, True, 0)
    bucketed = ranks4.run(_summed_grads, 2, True, 10 ** 9)   # every group in one reduction
    for a, b in zip(alone, bucketed):
        for x, y in zip(a[0], b[0]):
            assert np.array_equal(x, y)


def test_the_config_refuses_what_cannot_be_fed_back():
    with pytest.raises(ValueError, match="grad_error_feedback=True needs quantized gradients"):
        zero.ZeroConfig(grad_bits=None, grad_error_feedback=True)
    with pytest.raises(ValueError, match="grad_outliers=2"):
        zero.ZeroConfig(grad_bits=2, grad_outliers=2, grad_error_feedback=True)
    with pytest.raises(TypeError, match="grad_error_feedback"):
        zero.ZeroConfig(grad_error_feedback="yes")


def _reconfigured(rank, world):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, zero.ZeroConfig(grad_bits=2, grad_error_feedback=True), units=model.units())
    x, y = Batches(corpus(), 8, 32, 4).next(rank, world)
    m(x, y).backward()
    groups = [g for g in state_of(m).groups if not g.replicated and g.trainable]
    held = [g.grad_feedback.send.abs().sum().item() for g in groups]
    zero.reconfigure(m, zero.ZeroConfig(grad_bits=4, grad_error_feedback=True))
    kept = [g.grad_feedback.send.abs().sum().item() for g in groups]
    zero.reconfigure(m, zero.ZeroConfig(grad_bits=4))
    dropped = [g.grad_feedback for g in groups]
    return held, kept, dropped, zero.memory_report(m)["grad_feedback"]


def test_reconfigure_keeps_residuals_across_widths_and_frees_them_when_turned_off(ranks4):
    for held, kept, dropped, nbytes in ranks4.run(_reconfigured):
        assert all(h > 0 for h in held) and kept == held
        assert all(d is None for d in dropped) and nbytes == 0


# ------------------------------------------------------------------ checkpoints

FED = dict(weight_bits=None, hpz=False, grad_bits=2, grad_error_feedback=True)


def _fed_model(seed, **config):
    model = tiny_model(seed)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(**{**FED, **config}), units=model.units())
    return m, zero.Optimizer(m, torch.optim.SGD, lr=0.5, momentum=0.9)


def _residuals(m):
    return [torch.cat([g.grad_feedback.send, g.grad_feedback.own]).clone()
            for g in state_of(m).groups if g.grad_feedback is not None]


def _resume_with_residuals(rank, world, path):
    from qcoll.testing import train_steps
    m, opt = _fed_model(0)
    batches = Batches(corpus(), 8, 32, 11)
    train_steps(m, opt, batches, 3, rank=rank, world=world)
    zero.save(path, m, opt)
    saved = _residuals(m)
    rng = batches.state()
    first = train_steps(m, opt, batches, 3, rank=rank, world=world)
    m2, opt2 = _fed_model(123)   # other weights; its residuals after one step are not the saved ones
    train_steps(m2, opt2, Batches(corpus(), 8, 32, 99), 1, rank=rank, world=world)
    zero.load(path, m2, opt2)
    loaded = _residuals(m2)
    batches.set_state(rng)
    second = train_steps(m2, opt2, batches, 3, rank=rank, world=world)
    return first, second, [torch.equal(a, b) for a, b in zip(saved, loaded)], float(sum(a.abs().sum() for a in saved))


def test_a_resume_restores_each_ranks_residuals_and_continues_bit_for_bit(ranks4, tmp_path):
    """Oracle: the same run without the interruption."""
    for first, second, same, size in ranks4.run(_resume_with_residuals, str(tmp_path / "ck"), timeout=120):
        assert size > 0 and same and all(same)
        assert first == second


def _save_plain_then_load_fed(rank, world, path, other_layout):
    import warnings
    from qcoll.testing import train_steps
    if other_layout:   # saved with error feedback on 4 ranks, loaded on 2
        if world == 4:
            m, opt = _fed_model(0)
            train_steps(m, opt, Batches(corpus(), 8, 32, 3), 2, rank=rank, world=world)
            zero.save(path, m, opt)
            return None
        m, opt = _fed_model(0)
    else:   # saved without error feedback, loaded into a model that has residuals already
        m, opt = _fed_model(0, grad_bits=4, grad_error_feedback=False)
        zero.save(path, m, opt)
        m, opt = _fed_model(0)
    train_steps(m, opt, Batches(corpus(), 8, 32, 3), 1, rank=rank, world=world)
    before = float(sum(r.abs().sum() for r in _residuals(m)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero.load(path, m, opt)
    after = float(sum(r.abs().sum() for r in _residuals(m)))
    return before, after, [str(w.message) for w in caught]


@pytest.mark.parametrize("other_layout", [False, True])
def test_residuals_of_no_or_another_layout_start_at_zero_with_a_warning(ranks4, ranks2, tmp_path, other_layout):
    path = str(tmp_path / "ck")
    if other_layout:
        ranks4.run(_save_plain_then_load_fed, path, True, timeout=120)
        results = ranks2.run(_save_plain_then_load_fed, path, True, timeout=120)
        why = "saved on 4 ranks in 2 nodes, this run has 2 ranks in 1 node:"
    else:
        results = ranks4.run(_save_plain_then_load_fed, path, False, timeout=120)
        why = "holds no error-feedback residuals"
    for before, after, caught in results:
        assert before > 0 and after == 0
        assert any("residuals start at zero" in w and why in w for w in caught), caught


def _betas(rank, world):
    m, _ = _fed_model(0, grad_feedback_beta=0.8)
    groups = [g for g in state_of(m).groups if g.grad_feedback is not None]
    first = {g.grad_feedback.beta for g in groups}
    zero.reconfigure(m, zero.ZeroConfig(**{**FED, "grad_bits": 4, "grad_feedback_beta": 0.5}))
    second = {g.grad_feedback.beta for g in groups}
    cfg = zero.reconfigure.__globals__["with_knobs"](state_of(m).config, grad_bits=None)
    return first, second, cfg.grad_feedback_beta


def test_the_feedback_beta_reaches_every_groups_residual_and_follows_reconfigure(ranks4):
    for first, second, dropped in ranks4.run(_betas):
        assert first == {0.8} and second == {0.5} and dropped == 0.0
    with pytest.raises(ValueError, match="grad_feedback_beta=0.5 needs grad_error_feedback=True"):
        zero.ZeroConfig(grad_feedback_beta=0.5)
