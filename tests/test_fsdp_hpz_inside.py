"""hpZ's backward gather inside the node on the FSDP2 path moves codes, not fp32 (issue 41, item 1),
and the backward still sees the forward's weights bit for bit.

Oracle: the same run with the gather inside the node unquantized (``quantize_inside=False``, the
earlier behaviour): the forward's gathered weights are the same in both, so every gradient must be
equal bit for bit, while the bytes inside the node shrink by the codec's ratio. The model has
parameters whose dim 0 does not divide by the world (FSDP2 pads them) and blocks that straddle
nothing, at a small weight block so that shards end in short blocks.
"""
import pytest
import torch

import qcoll
from qcoll.comm import stats
from qcoll.fsdp import quantize_comm
from qcoll.fsdp.comms import QuantizedAllGather
from qcoll.testing.fsdp2 import mesh_for
from torch.distributed.fsdp import fully_shard


class _Odd(torch.nn.Module):
    """Blocks whose weights have dim 0 of 131 and 7 (not multiples of 4 ranks) beside aligned ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(256, 131), torch.nn.Tanh(),
                                                               torch.nn.Linear(131, 256)) for _ in range(2)])
        self.head = torch.nn.Linear(256, 7)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).pow(2).mean()


def _grads(rank, world, inside: bool, bits: int, block: int):
    model = _Odd()
    mesh = mesh_for(False, 2)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    quantize_comm(model, qcoll.Topology(2), weight_bits=bits, grad_bits=None, weight_block=block)
    gathers = [g._all_gather_comm for m in (*model.blocks, model) for g in m._get_fsdp_state()._fsdp_param_groups]
    assert all(isinstance(g, QuantizedAllGather) for g in gathers)
    for g in gathers:
        g.quantize_inside = inside
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    loss = model(x)
    intra0 = stats.stats.total_intra_bytes
    loss.backward()   # the blocks' gathers inside the node (the root stays gathered)
    intra = stats.stats.total_intra_bytes - intra0
    return [p.grad.to_local().clone() for p in model.parameters()], intra


@pytest.mark.parametrize("bits,block", [(8, 32), (4, 64)])
def test_the_coded_gather_inside_the_node_gives_backward_the_forwards_weights(ranks4, bits, block):
    plain = ranks4.run(_grads, False, bits, block, timeout=120)
    coded = ranks4.run(_grads, True, bits, block, timeout=120)
    for (g_plain, b_plain), (g_coded, b_coded) in zip(plain, coded):
        assert all(torch.equal(a, b) for a, b in zip(g_plain, g_coded))
        # codes, an fp32 scale per block, padding to blocks and 16-byte frame headers: under
        # (bits + 32 / block + 2) / 32 of fp32's bytes at these sizes
        assert 0 < b_coded < b_plain * (bits + 32 / block + 2) / 32, (b_coded, b_plain)
