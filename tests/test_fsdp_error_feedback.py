"""quantize_comm(error_feedback=True): FSDP2's qgZ (1-D mesh) and HSDP's quantized all-reduce with
qgZ's residuals, against FSDP2's own unquantized reduction as the oracle.

The same batch backpropagated several times: with error feedback the 2-bit gradients sum to
the unquantized ones' sum within one reduction's rounding; without it, the roundings add up.
"""
import pytest
import torch

import qcoll
from qcoll.fsdp import quantize_comm
from qcoll.testing.data import Batches, corpus
from qcoll.testing.fsdp2 import fsdp2_transformer

REPEATS = 6


def _summed(rank, world, hsdp, grad_bits, feedback):
    topo = qcoll.Topology(2)
    model = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
    if grad_bits is not None:
        quantize_comm(model, topo, weight_bits=None, grad_bits=grad_bits, error_feedback=feedback)
    x, y = Batches(corpus(), 8, 32).next(rank, world)
    total = None
    for _ in range(REPEATS):
        model(x, y).backward()
        g = torch.cat([p.grad.to_local().reshape(-1).double() for p in model.parameters()])
        total = g if total is None else total + g
        model.zero_grad()
    return total


@pytest.mark.parametrize("hsdp", [False, True])
def test_2_bit_gradients_with_feedback_sum_to_fsdp2s(ranks4, hsdp):
    exact = ranks4.run(_summed, hsdp, None, False, timeout=120)
    fed = ranks4.run(_summed, hsdp, 2, True, timeout=120)
    plain = ranks4.run(_summed, hsdp, 2, False, timeout=120)
    for rank in range(4):
        err_fed = (fed[rank] - exact[rank]).abs().mean().item()
        err_plain = (plain[rank] - exact[rank]).abs().mean().item()
        assert err_fed * 2 < err_plain, (rank, err_fed, err_plain)


def test_error_feedback_needs_quantized_gradients():
    with pytest.raises(ValueError, match="error_feedback=True needs quantized gradients"):
        quantize_comm(torch.nn.Linear(2, 2), grad_bits=None, error_feedback=True)
    with pytest.raises(TypeError, match="error_feedback"):
        quantize_comm(torch.nn.Linear(2, 2), error_feedback=1)


def _betas(rank, world, hsdp):
    from qcoll.fsdp.comms import QuantizedReduceScatter
    from qcoll.fsdp.hybrid import QuantizedAllReduceHook
    model = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
    quantize_comm(model, qcoll.Topology(2), grad_bits=2, error_feedback=True, feedback_beta=0.8)
    groups = [g for m in (model.blocks[0], model) for g in m._get_fsdp_state()._fsdp_param_groups]
    hooks = [g._all_reduce_hook if hsdp else g._reduce_scatter_comm for g in groups]
    kinds = {type(h).__name__ for h in hooks}
    return kinds, {h.feedback.beta for h in hooks}


@pytest.mark.parametrize("hsdp", [False, True])
def test_the_feedback_beta_reaches_each_modules_residual(ranks4, hsdp):
    for kinds, betas in ranks4.run(_betas, hsdp, timeout=120):
        assert kinds == {"QuantizedAllReduceHook" if hsdp else "QuantizedReduceScatter"} and betas == {0.8}
    with pytest.raises(ValueError, match="feedback_beta=0.5 needs error_feedback=True"):
        quantize_comm(torch.nn.Linear(2, 2), grad_bits=2, feedback_beta=0.5)
    with pytest.raises(ValueError, match="feedback_beta must be in"):
        quantize_comm(torch.nn.Linear(2, 2), grad_bits=2, error_feedback=True, feedback_beta=1.5)
