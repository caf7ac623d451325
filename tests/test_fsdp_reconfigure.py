"""``qcoll.fsdp.reconfigure_comm``: the FSDP2 path's wire format switched between steps.

Oracle: a model given the same settings by ``quantize_comm`` before its first forward, with the same
weights (no optimizer step), computes bit for bit the gradients of the model switched to them after
it ran a step with other settings.
"""
import pytest
import torch

import qcoll
from qcoll.fsdp import comm_settings, quantize_comm, reconfigure_comm
from qcoll.testing.data import Batches, corpus
from qcoll.testing.fsdp2 import fsdp2_transformer

SETTINGS = [dict(weight_bits=8, grad_bits=4), dict(weight_bits=4, grad_bits=(8, 4)), dict(weight_bits=None, grad_bits=8),
            dict(weight_bits=None, grad_bits=None)]


def _grads(model, rank, world):
    x, y = Batches(corpus(), 8, 32, 5).next(rank, world)
    model(x, y).backward()
    out = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad()
    return out


def _switched(rank, world, hsdp, target):
    model = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
    quantize_comm(model, qcoll.Topology(2), weight_bits=6, grad_bits=2)
    _grads(model, rank, world)                  # a step with other settings first
    old = reconfigure_comm(model, **target)
    switched = _grads(model, rank, world)
    fresh = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
    quantize_comm(fresh, qcoll.Topology(2), **target)
    return old, switched, _grads(fresh, rank, world), comm_settings(model)


@pytest.mark.parametrize("hsdp", [False, True])
def test_a_switched_model_computes_what_a_model_built_with_the_settings_does(ranks4, hsdp):
    for target in SETTINGS:
        for old, switched, fresh, now in ranks4.run(_switched, hsdp, target, timeout=180):
            assert old["weight_bits"] == 6 and old["grad_bits"] == 2
            assert all(now[k] == v for k, v in target.items())
            assert all(torch.equal(a, b) for a, b in zip(switched, fresh)), target


def _residuals_carry(rank, world):
    model = fsdp2_transformer(reshard_after_forward=2)
    quantize_comm(model, qcoll.Topology(2), weight_bits=8, grad_bits=2, error_feedback=True)
    _grads(model, rank, world)
    groups = [g for m in (model.blocks[0], model) for g in m._get_fsdp_state()._fsdp_param_groups]
    before = [g._reduce_scatter_comm.feedback for g in groups]
    reconfigure_comm(model, grad_bits=4, feedback_beta=0.5)
    kept = [g._reduce_scatter_comm.feedback for g in groups]
    carried = all(a is b for a, b in zip(before, kept)) and {f.beta for f in kept} == {0.5}
    reconfigure_comm(model, hadamard=True)      # another basis: fresh residuals
    fresh = all(g._reduce_scatter_comm.feedback is not b for g, b in zip(groups, before))
    reconfigure_comm(model, weight_bits=None, grad_bits=None, hadamard=False, error_feedback=False)
    plain = [type(g._all_gather_comm).__name__ + "/" + type(g._reduce_scatter_comm).__name__ for g in groups]
    errors = {}
    for name, kwargs in (("hpz", dict(hpz=False)), ("unknown", dict(bits=4)), ("bits", dict(weight_bits=3))):
        try:
            reconfigure_comm(model, **kwargs)
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    try:
        reconfigure_comm(torch.nn.Linear(2, 2), grad_bits=4)
    except TypeError as e:
        errors["not installed"] = str(e)
    return carried, fresh, set(plain), errors


def test_residuals_carry_over_a_width_change_and_errors_name_the_setting(ranks4):
    for carried, fresh, plain, errors in ranks4.run(_residuals_carry, timeout=120):
        assert carried and fresh
        assert plain == {"DefaultAllGather/DefaultReduceScatter"}
        assert "hpz=False but the modules were sharded with hpz=True" in errors["hpz"]
        assert errors["unknown"].startswith("TypeError: reconfigure_comm: unknown setting(s) ['bits']")
        assert "bits must be one of" in errors["bits"]
        assert "has no qcoll communication" in errors["not installed"]
