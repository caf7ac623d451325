"""``qcoll.tune.AutoTune`` on FSDP2 with ``qcoll.fsdp.quantize_comm`` (issue 41, item 3): the same policy
and budgets as on ``qcoll.zero``, switching with ``reconfigure_comm``.

Oracles: the collectives FSDP2 runs (the comm objects on every parameter group) against the configuration
AutoTune says it runs, the same on every rank at every step; the codec's error on the live shards
recomputed here in float64 from the codec; the budget's verdict on 2-bit gradients without feedback.
"""
import math

import pytest
import torch

import qcoll
from qcoll.fsdp import comm_settings, quantize_comm
from qcoll.quant import dequantize, quantize
from qcoll.testing.data import Batches, corpus
from qcoll.testing.fsdp2 import fsdp2_transformer
from qcoll.tune import AutoTune, Knob, Space

STEPS = 12


def _wire(model) -> list:
    """What FSDP2 will run, per parameter group: (all-gather bits or None, reduce-scatter bits or None)."""
    out = []
    for m in (*model.blocks, model):
        for g in m._get_fsdp_state()._fsdp_param_groups:
            out.append((getattr(g._all_gather_comm, "bits", None), getattr(g._reduce_scatter_comm, "bits", None)))
    return out


def _run(rank, world, feedback, space):
    model = fsdp2_transformer(reshard_after_forward=2)
    quantize_comm(model, qcoll.Topology(2), weight_bits=8, grad_bits=4, error_feedback=feedback)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    auto = AutoTune(model, space=space, window=1, explore=6, abort=100.0, drift_tolerance=1000.0, seed=2)
    batches, ran, losses = Batches(corpus(), 8, 32, 3), [], []
    for _ in range(STEPS):
        chosen = auto.space.config(auto.point)   # what AutoTune decided to run
        ran.append((chosen["weight_bits"], chosen["grad_bits"], _wire(model)))
        assert (auto.config.weight_bits, auto.config.grad_bits) == (chosen["weight_bits"], chosen["grad_bits"])
        x, y = batches.next(rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        auto.update()
        opt.zero_grad()
        losses.append(loss.item())
    return ran, losses, auto.switches, comm_settings(model)["grad_bits"], auto.last_errors


@pytest.mark.parametrize("feedback", [False, True])
def test_autotune_switches_fsdp2s_wire_format_on_every_rank(ranks4, feedback):
    space = Space([Knob("weight_bits", (4, 8, None)), Knob("grad_bits", (2, 4, 8, None))])
    results = ranks4.run(_run, feedback, space, timeout=300)
    ran0 = [r[:2] for r in results[0][0]]
    for ran, losses, switches, _, _ in results:
        assert [r[:2] for r in ran] == ran0 and switches >= 1 and all(math.isfinite(v) for v in losses)
        for w, g, wire in ran:   # the collectives FSDP2 runs are the configuration AutoTune reports
            assert {a for a, _ in wire} == {w} and {b for _, b in wire} == {g}
    used = {g for _, g in ran0}
    if feedback:   # 2-bit gradients pass the feedback budget (1.25) and run
        assert 2 in used, ran0
    else:          # without feedback they are over grad_error (0.25): never run
        assert 2 not in used, ran0


def _errors(rank, world):
    model = fsdp2_transformer(reshard_after_forward=2)
    quantize_comm(model, qcoll.Topology(2), weight_bits=8, grad_bits=4)
    x, y = Batches(corpus(), 8, 32, 3).next(rank, world)
    model(x, y).backward()
    auto = AutoTune(model)
    got = auto.driver.errors(auto._config_of(auto.point))
    local = [(p.to_local().detach().double(), p.grad.to_local().double()) for p in model.parameters()]
    sums = torch.zeros(4, dtype=torch.float64)
    for w, g in local:
        if not w.numel():
            continue
        sums[0] += (dequantize(quantize(w.float().reshape(-1), 8, 256), dtype=torch.float32).double() - w.reshape(-1)).pow(2).sum()
        sums[1] += w.pow(2).sum()
        sums[2] += 2 * (dequantize(quantize(g.float().reshape(-1), 4, 128), dtype=torch.float32).double() - g.reshape(-1)).pow(2).sum()
        sums[3] += g.pow(2).sum()
    torch.distributed.all_reduce(sums)
    return got, ((sums[0] / sums[1]).sqrt().item(), (sums[2] / sums[3]).sqrt().item())


def test_the_live_error_is_the_codecs_on_the_local_shards(ranks4):
    for got, want in ranks4.run(_errors, timeout=120):
        assert got == pytest.approx(want, rel=1e-6)


def test_a_model_without_qcoll_comms_is_refused():
    with pytest.raises(TypeError, match="AutoTune drives a model sharded by qcoll.zero.shard, or an FSDP2 model"):
        AutoTune(torch.nn.Linear(2, 2))


def _fixed_knob(rank, world):
    model = fsdp2_transformer(reshard_after_forward=2)
    quantize_comm(model, qcoll.Topology(2))
    try:
        AutoTune(model, space=Space([Knob("grad_bits", (4, 8)), Knob("prefetch", (0, 1))]))
    except ValueError as e:
        return str(e)


def test_a_knob_fsdp2_cannot_switch_is_refused_by_name(ranks4):
    for message in ranks4.run(_fixed_knob, timeout=120):
        assert message.startswith("space knobs ['prefetch'] cannot be switched on FSDP2"), message


def _default_spaces(rank, world):
    out = []
    for hsdp in (False, True):
        model = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
        quantize_comm(model, qcoll.Topology(2))
        out.append([(k.name, k.values) for k in AutoTune(model).space.knobs])
    return out


def test_the_default_fsdp2_space_switches_weights_only_where_they_cross_nodes(ranks4):
    for flat, hsdp in ranks4.run(_default_spaces, timeout=120):
        assert flat == [("weight_bits", (4, 8, None)), ("grad_bits", (4, (8, 4), 8, None))]
        assert hsdp == [("grad_bits", (4, (8, 4), 8, None))]
