"""Gradient accumulation without re-gathering: ``ZeroConfig(reshard_after_backward=False)``.

4 gloo ranks as 2 nodes x 2, ZeRO++ (qwZ 8-bit, hpZ, qgZ 4-bit), 3 micro-batches per step
(two under ``no_sync()``). Oracles: the same training with the default
``reshard_after_backward=True`` (which tests/test_zero_training.py checks against one process):
the losses and the weights must be the same bits; and the inter-node bytes of one
forward's weight gathers, measured by the test alone (a no-grad forward), which the pinned
step must send once instead of once per micro-batch.
"""
import pytest
import torch

import qcoll
from qcoll import zero
from qcoll.comm.stats import stats
from qcoll.testing import Batches, corpus, tiny_model

MICRO = 3
TIMEOUT = 120


def _train(rank, world, reshard_after_backward, step_inside=False):
    model = tiny_model(0)
    cfg = zero.ZeroConfig(weight_bits=8, hpz=True, grad_bits=4, reshard_after_backward=reshard_after_backward)
    m = zero.shard(model, qcoll.Topology(2), cfg, units=model.units())
    opt = zero.Optimizer(m, torch.optim.SGD, lr=0.3)
    groups = zero.state_of(m).groups
    batches = Batches(corpus(), world * 2 * MICRO, 32, 5)
    x, _ = batches.next(rank, world)
    with torch.no_grad():                      # one forward's weight gathers, across nodes
        before = stats.total_inter_bytes
        m(x[:1])
        gather_bytes = stats.total_inter_bytes - before
    out = {"losses": [], "step_inter": [], "held_between": [], "released_after": [], "gather_bytes": gather_bytes}
    for _ in range(2):
        x, y = batches.next(rank, world)
        before = stats.total_inter_bytes
        for i in range(MICRO):
            last = i == MICRO - 1
            xa, ya = x[2 * i: 2 * i + 2], y[2 * i: 2 * i + 2]
            if last:
                loss = m(xa, ya) / MICRO
                loss.backward()
            else:
                with m.no_sync():
                    loss = m(xa, ya) / MICRO
                    loss.backward()
                out["held_between"].append(sum(g.gathered_nbytes() for g in groups))
                if step_inside and i == 0:         # new weights between micro-batches: the kept ones are stale
                    m.load_state_dict({k: v * 0.9 for k, v in m.state_dict().items()})
            out["losses"].append(float(loss.detach()))
        out["step_inter"].append(stats.total_inter_bytes - before)
        opt.step()
        opt.zero_grad()
        out["released_after"].append(sum(g.gathered_nbytes() for g in groups) + sum(g.pinned for g in groups))
    out["full"] = sum(g.full_nbytes for g in groups)
    out["peak"] = zero.memory_report(m)["gathered_peak"]
    out["master"] = [g.master.detach().clone() for g in groups]
    return out


def test_kept_weights_cross_the_link_once_per_step_with_the_same_bits(ranks4):
    plain = ranks4.run(_train, True, timeout=TIMEOUT)
    kept = ranks4.run(_train, False, timeout=TIMEOUT)
    for p, k in zip(plain, kept):
        assert k["losses"] == p["losses"]
        for a, b in zip(k["master"], p["master"]):
            assert torch.equal(a, b)
        G = p["gather_bytes"]
        assert G > 0
        # without the pin every micro-batch's forward gathers across nodes; with it, only the first
        for sp, sk in zip(p["step_inter"], k["step_inter"]):
            assert sp - sk == (MICRO - 1) * G, (sp, sk, G)
        assert p["held_between"] == [0] * 4 and k["held_between"] == [k["full"]] * 4
        assert k["released_after"] == [0, 0] and p["released_after"] == [0, 0]
        assert k["peak"] >= k["full"]


def test_new_weights_between_micro_batches_are_gathered_again(ranks4):
    """Weights loaded inside the accumulation make the kept ones stale: the next forward gathers
    again, so the training equals the default's with the same load."""
    plain = ranks4.run(_train, True, True, timeout=TIMEOUT)
    kept = ranks4.run(_train, False, True, timeout=TIMEOUT)
    for p, k in zip(plain, kept):
        assert k["losses"] == p["losses"]
        for a, b in zip(k["master"], p["master"]):
            assert torch.equal(a, b)


def _generation_inside(rank, world):
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(reshard_after_backward=False), units=model.units())
    x = torch.randint(0, 256, (2, 16))
    with m.no_sync():
        m(x, x).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation holds the gathered weights"):
        with m.generation_mode():
            pass
    m(x, x).backward()
    with m.generation_mode():   # after the step's last backward: allowed
        with torch.no_grad():
            m(x)
    with pytest.raises(TypeError, match="reshard_after_backward must be a bool, got 1"):
        zero.ZeroConfig(reshard_after_backward=1)
    return True


def test_generation_mode_inside_an_accumulation_is_refused(ranks4):
    assert all(ranks4.run(_generation_inside, timeout=TIMEOUT))
