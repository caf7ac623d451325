"""The collectives and the ZeRO++ wrapper on CUDA tensors (NCCL + kernels), needs a GPU.

One GPU cannot hold several NCCL ranks, so this runs a world of one in the test
process with the ``cpu:gloo,cuda:nccl`` backend: the same call on CPU tensors
(gloo, torch reference) is the oracle for the CUDA call (NCCL, CUDA kernels),
which must agree bit for bit since the kernels reproduce the reference's bytes.
The world of one still runs every kernel of both paths: quantize, gather,
dequantize; swizzle+quantize, both all-to-all hops, reduce+requantize, the final
dequantize-reduce.
"""
from __future__ import annotations


import pytest
import torch

import qcoll
from cuda_testdata import BITS, NEEDS_GPU, awkward_rows, world_of_one

pytestmark = NEEDS_GPU


@pytest.fixture(scope="module")
def topo():
    yield from world_of_one()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(ib), b.view(ib))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_all_gather_and_replica_match_cpu(topo, bits, dtype):
    x = (torch.randn(10_000) * 3).to(dtype)
    outs = {}
    for dev in ("cpu", "cuda"):
        out = torch.empty(10_000, dtype=dtype, device=dev)
        sec = qcoll.SecondaryShard.keep(qcoll.all_gather_quantized(out, x.to(dev), bits=bits, block_size=256), topo)
        again = torch.empty_like(out)
        qcoll.replica_gather(again, sec)
        assert _same_bits(again, out), "replica gather differs from the forward gather"
        outs[dev] = out
    assert _same_bits(outs["cuda"], outs["cpu"])
    err = (outs["cpu"].double() - x.double()).abs().max()
    assert err <= x.double().abs().max() / (2 ** (bits - 1) - 1)  # a sanity bound against garbage


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("stochastic", [False, True])
def test_reduce_scatter_matches_cpu(topo, stochastic, num_chunks):
    g = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    outs = {}
    for dev in ("cpu", "cuda"):
        out = torch.empty(50_000, device=dev)
        qcoll.reduce_scatter_quantized(out, g.to(dev), bits=4, block_size=128, topology=topo, op="avg",
                                       stochastic=stochastic, seed=11, num_chunks=num_chunks)
        outs[dev] = out
    assert _same_bits(outs["cuda"], outs["cpu"])
    assert (outs["cpu"] - g).abs().max() <= g.abs().max() / 7 * 2  # two 4-bit roundings at most


def test_zero_training_on_cuda_tracks_cpu(topo):
    """A few AdamW steps of ZeRO++ (8-bit weights, hpZ, 4-bit gradients) on the GPU follow
    the same run on the CPU: GPU matmuls round differently, so losses agree closely, not bitwise."""
    from qcoll.testing import TINY, Batches, corpus, tiny_model, train_steps

    losses = {}
    for dev in ("cpu", "cuda"):
        model = qcoll.zero.shard(tiny_model(0).to(dev), config=qcoll.zero.ZeroConfig())
        opt = qcoll.zero.Optimizer(model, torch.optim.AdamW, lr=3e-3)
        losses[dev] = train_steps(model, opt, Batches(corpus(), 8, TINY.context, 5), 8,
                                  loss_fn=lambda m, x, y, dev=dev: m(x.to(dev), y.to(dev)))
    assert all(torch.isfinite(torch.tensor(losses["cuda"])))
    assert losses["cuda"][-1] < losses["cuda"][0]
    for a, b in zip(losses["cuda"], losses["cpu"]):
        assert abs(a - b) <= 2e-2 * abs(b), (losses["cuda"], losses["cpu"])


def test_reference_on_cuda_matches_cpu(monkeypatch):
    """QCOLL_BACKEND=reference runs the torch reference on CUDA tensors, with the CPU's bytes."""
    from qcoll.quant import reference, rows

    monkeypatch.setenv("QCOLL_BACKEND", "reference")
    x = awkward_rows(3, 1000, 64, torch.float32, seed=1)
    for bits in BITS:
        want = reference.quantize_rows(x, bits, 64, True, 3, 0)
        got = rows.quantize_rows(x.cuda(), bits, 64, True, 3, 0)
        assert torch.equal(got.cpu(), want), bits
        assert _same_bits(rows.dequantize_rows(got, 1000, bits, 64, torch.float32).nan_to_num(7.0),
                          reference.dequantize_rows(want, 1000, bits, 64, torch.float32).nan_to_num(7.0))
