"""qcoll's FSDP2 comms on CUDA: the same kernels as qcoll.comm, in FSDP2's streams; needs a GPU.

A world of one in the test process (``cpu:gloo,cuda:nccl``), as in test_cuda_single_rank.
FSDP2 skips its collectives on a world of one, so the tests call the comms as FSDP2 does,
in a side stream ordered after the current one; and a group of one rank never spans
nodes, so the tests make the comms treat it as one that does (``spans_nodes``): every
kernel of the quantized path runs. The same call on CPU tensors (gloo, the torch
reference codec) is the oracle, bit for bit.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import qcoll
import qcoll.fsdp.comms as comms
from cuda_testdata import NEEDS_GPU, world_of_one

pytestmark = NEEDS_GPU


@pytest.fixture(scope="module")
def topo():
    yield from world_of_one()


def _in_side_stream(dev: str, call) -> None:
    """``call()`` as FSDP2 makes it: in a stream of its own, ordered after the current one."""
    if dev == "cpu":
        call()
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)


def test_all_gather_in_a_side_stream_matches_cpu(topo, monkeypatch):
    """The gather of a parameter group whose shards are not block multiples (each on its own blocks)."""
    monkeypatch.setattr(comms, "spans_nodes", lambda group, topology: True)
    sizes = [torch.Size([10, 3]), torch.Size([6]), torch.Size([300, 2])]
    flat = torch.cat([torch.randn(s.numel(), generator=torch.Generator().manual_seed(i)) * 10.0 ** i
                      for i, s in enumerate(sizes)])
    outs = {}
    for dev in ("cpu", "cuda"):
        out = torch.empty(flat.numel(), device=dev)
        comm = comms.QuantizedAllGather(topo, 8, 64, sizes)
        _in_side_stream(dev, lambda: comm(out, flat.to(dev), dist.group.WORLD))
        outs[dev] = out.cpu()
    assert torch.equal(outs["cuda"], outs["cpu"])
    assert not torch.equal(outs["cpu"], flat)          # quantized
    want = torch.cat([qcoll.dequantize(qcoll.quantize(piece, 8, 64)) for piece in flat.split([s.numel() for s in sizes])])
    assert torch.equal(outs["cpu"], want)


def test_reduce_scatter_in_a_side_stream_matches_cpu(topo, monkeypatch):
    monkeypatch.setattr(comms, "spans_nodes", lambda group, topology: True)
    g = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    outs = {}
    for dev in ("cpu", "cuda"):
        out = torch.empty(50_000, device=dev)
        comm = comms.QuantizedReduceScatter(topo, 4, 128)
        _in_side_stream(dev, lambda: comm(out, g.to(dev), dist.group.WORLD, dist.ReduceOp.AVG))
        outs[dev] = out.cpu()
    assert torch.equal(outs["cuda"], outs["cpu"])
    assert (outs["cpu"] - g).abs().max() <= g.abs().max() / 7 * 2
