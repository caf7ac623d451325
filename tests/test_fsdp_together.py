"""qcoll's comms with what FSDP2 users combine them with, on 4 gloo ranks (2 nodes x 2):
bf16 MixedPrecisionPolicy, torch.compile'd blocks, gradient accumulation with
set_requires_gradient_sync(False), clip_grad_norm_, a torch optimizer, DCP's
get_state_dict / set_state_dict. The oracle is plain FSDP2 with the same setup."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import qcoll
from qcoll.comm import stats
from qcoll.fsdp import quantize_comm
from qcoll.testing import Batches, char_transformer, corpus, global_loss
from qcoll.testing.fsdp2 import mesh_for, shard_fsdp2
from qcoll.testing.models import TINY

MICRO, STEPS = 2, 4


def _model(hsdp, quantized, compiled=False):
    topo = qcoll.Topology(2)
    model = char_transformer(TINY, 0)
    if compiled:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    shard_fsdp2(model, model.blocks, mesh_for(hsdp, 2), bf16=True, reshard_after_forward=None if hsdp else 2)
    if quantized:
        quantize_comm(model, topo)
    return model


def _accumulating_steps(model, opt, batches, steps, rank, world):
    losses = []
    for _ in range(steps):
        total = 0.0
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            x, y = batches.next(rank, world)
            loss = model(x, y) / MICRO
            loss.backward()
            total += global_loss(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _together(rank, world, hsdp, quantized):
    model = _model(hsdp, quantized, compiled=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    stats.reset()
    losses = _accumulating_steps(model, opt, Batches(corpus(), 8, 32), STEPS, rank, world)
    return losses, dict(stats.snapshot()["calls"])


@pytest.mark.parametrize("hsdp", [False, True])
def test_bf16_compiled_accumulating_training_follows_fsdp2(ranks4, hsdp):
    plain = ranks4.run(_together, hsdp, False, timeout=300)[0][0]
    quant, calls = ranks4.run(_together, hsdp, True, timeout=300)[0]
    assert quant != plain
    assert all(abs(a - b) <= 0.03 * a for a, b in zip(plain, quant)), (plain, quant)
    assert plain[-1] < 0.95 * plain[0]   # it learns
    groups = 3  # two blocks and the root
    if hsdp:    # one quantized all-reduce per group per step: none in the micro-batches that accumulate
        assert calls == {"all_to_all": groups * STEPS, "all_gather": groups * STEPS}
    else:       # qgZ's two hops once per group per step (not per micro-batch)
        assert calls["all_to_all"] == 2 * groups * STEPS


def _resume(rank, world, path, hsdp):
    batches = Batches(corpus(), 8, 32)
    model = _model(hsdp, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _accumulating_steps(model, opt, batches, 2, rank, world)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=path)
    state = batches.state()
    straight = _accumulating_steps(model, opt, batches, 2, rank, world)

    fresh = _model(hsdp, True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    _accumulating_steps(fresh, fresh_opt, Batches(corpus(), 8, 32, seed=5), 1, rank, world)  # other values
    loaded = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt)))
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    batches.set_state(state)
    return straight, _accumulating_steps(fresh, fresh_opt, batches, 2, rank, world)


@pytest.mark.parametrize("hsdp", [False, True])
def test_dcp_state_dict_round_trip_resumes_exactly(ranks4, tmp_path, hsdp):
    straight, resumed = ranks4.run(_resume, str(tmp_path / "ckpt"), hsdp, timeout=300)[0]
    assert resumed == straight
