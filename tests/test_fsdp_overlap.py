"""The FSDP2 path's qgZ reductions left in flight across the backward (``overlap_comm``, issue 41,
item 2) give the synchronous reductions' gradients bit for bit.

Oracle: the same training with ``overlap_comm=False`` (every reduce-scatter complete when FSDP2's
call returns, the earlier behaviour, itself checked against plain FSDP2 in test_fsdp_comms.py).
Cases: blocks sharded with hpZ under a root (the root's reduction runs in FSDP2's final callback),
a root alone, gradients accumulated into ``.grad`` over two backwards (FSDP2 adds the output at
once, so those reductions must not be deferred), and error feedback (residuals updated in order).
"""
import pytest
import torch

import qcoll
from qcoll.fsdp import quantize_comm
from qcoll.fsdp.comms import QuantizedReduceScatter
from qcoll.testing.fsdp2 import mesh_for
from torch.distributed.fsdp import fully_shard


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(64, 96)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(96, 131), torch.nn.Tanh(),
                                                               torch.nn.Linear(131, 96)) for _ in range(3)])
        self.head = torch.nn.Linear(96, 5)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).pow(2).mean()


def _train(rank, world, overlap: bool, blocks: bool, backwards: int, feedback: bool):
    model = _Net()
    mesh = mesh_for(False, 2)
    if blocks:
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    quantize_comm(model, qcoll.Topology(2), grad_bits=(8, 2) if feedback else 4, error_feedback=feedback,
                  overlap_comm=overlap, hpz=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(backwards):          # the second backward adds into .grad
            model(torch.randn(8, 64, generator=gen)).backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    comms = [g._reduce_scatter_comm for m in model.modules() if hasattr(m, "_get_fsdp_state")
             for g in m._get_fsdp_state()._fsdp_param_groups]
    assert all(isinstance(c, QuantizedReduceScatter) for c in comms)
    deferred = comms[0].deferred
    assert deferred is None or len(deferred) == 0          # nothing left in flight after backward()
    return grads, [p.detach().to_local().clone() for p in model.parameters()], 0 if deferred is None else deferred.deferred


@pytest.mark.parametrize("blocks,backwards,feedback", [(True, 1, False), (False, 1, False), (True, 2, False),
                                                       (True, 1, True)])
def test_reductions_in_flight_give_the_synchronous_gradients(ranks4, blocks, backwards, feedback):
    sync = ranks4.run(_train, False, blocks, backwards, feedback, timeout=180)
    overlapped = ranks4.run(_train, True, blocks, backwards, feedback, timeout=180)
    for (g_sync, p_sync, n_sync), (g_over, p_over, n_over) in zip(sync, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(g_sync, g_over))
        assert all(torch.equal(a, b) for a, b in zip(p_sync, p_over))
        assert n_sync == 0
        modules = 4 if blocks else 1
        # 3 steps; with two backwards a step, only the first (into a .grad of None) is deferred
        assert n_over == 3 * modules, n_over
