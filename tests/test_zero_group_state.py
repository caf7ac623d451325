"""``FlatGroup``'s explicit schedule state: where a training step leaves each group, and
transitions that refuse to start from the wrong state."""
import pytest
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.zero.group_state import GatherState, GradState


def _states(model):
    return [(g.gather_state, g.grad_state, g.secondary is not None) for g in zero.state_of(model).groups]


def _walk(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(weight_bits=8, hpz=True, grad_bits=4, weight_block=32),
               units=[model[0], model[2]])
    seen = {"start": _states(model)}
    loss = model(torch.randn(3, 16)).square().sum()
    seen["after forward"] = _states(model)
    loss.backward()
    seen["after backward"] = _states(model)
    with torch.no_grad():
        model(torch.randn(3, 16))
    seen["after no_grad forward"] = _states(model)
    group = zero.state_of(model).groups[0]
    errors = {}
    for name, call in {"wait without a gather": group.wait_for_unshard,
                       "grad_ready while reducing": lambda: (group.reduce_grads(0)[0].wait(), group.grad_ready()),
                       "reduce twice": lambda: group.reduce_grads(0)}.items():
        try:
            call()
            errors[name] = None
        except AssertionError as e:
            errors[name] = str(e)
    group.end_backward()
    seen["after end_backward"] = _states(model)
    return seen, errors


def test_a_step_leaves_every_group_released_and_transitions_check_their_start(ranks4):
    released, idle = GatherState.RELEASED, GradState.IDLE
    for seen, errors in ranks4.run(_walk, timeout=120):
        assert seen["start"] == [(released, idle, False)] * 2
        # forward with gradients: released again, each group's hpZ secondary kept for backward
        assert seen["after forward"] == [(released, idle, True)] * 2
        for when in ("after backward", "after no_grad forward", "after end_backward"):
            assert seen[when] == [(released, idle, False)] * 2, when
        assert "wait_for_unshard expects GATHERING, but it is RELEASED" in errors["wait without a gather"]
        assert "grad_ready expects IDLE or HELD, but it is REDUCING" in errors["grad_ready while reducing"]
        assert "reduce_grads expects IDLE or HELD, but it is REDUCING" in errors["reduce twice"]
