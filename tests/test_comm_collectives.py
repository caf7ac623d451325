"""qwZ / hpZ / qgZ on 4 gloo ranks against the unquantized torch.distributed collectives.

Every rank builds every rank's input from a seed, so the float64 numpy oracle
(exact sums, per-block error bounds from the codec's scale/2 bound) is computed
independently of the code under test.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll.comm import stats

QMAX = {8: 127, 6: 31, 4: 7, 2: 1}
HEADER = 16  # the frame header in front of every quantized buffer sent (docs/FORMAT.md, "Frames")


def shard_of(rank, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def block_halfscale(x64, block, bits):
    """Per-element scale/2 bound of a 1-D float64 array quantized in blocks."""
    nb = -(-x64.size // block)
    pad = np.zeros(nb * block)
    pad[: x64.size] = np.abs(x64)
    amax = pad.reshape(nb, block).max(axis=1)
    return np.repeat(amax / QMAX[bits] / 2, block)[: x64.size]


# ---------------------------------------------------------------- qwZ
def _all_gather(rank, world, bits, n, block, dtype):
    qcoll.Topology(2)
    mine = shard_of(rank, n, dtype=dtype)
    out = torch.empty(world * n, dtype=dtype)
    ref = torch.empty(world * n, dtype=dtype)
    qcoll.all_gather_quantized(out, mine, bits=bits, block_size=block)
    dist.all_gather_into_tensor(ref, mine)
    exact = np.concatenate([shard_of(r, n, dtype=dtype).double().numpy() for r in range(world)])
    assert np.array_equal(ref.double().numpy(), exact)
    got = out.double().numpy()
    if bits is None:
        assert torch.equal(out, ref)
        return
    bound = np.concatenate([block_halfscale(shard_of(r, n, dtype=dtype).double().numpy(), block, bits)
                            for r in range(world)])
    slack = np.abs(exact) * (2**-8 if dtype != torch.float32 else 2**-22) + 1e-30
    assert np.all(np.abs(got - exact) <= bound + slack)


@pytest.mark.parametrize("bits", [8, 6, 4, 2, None])
def test_all_gather_quantized_within_codec_bound(ranks4, bits):
    ranks4.run(_all_gather, bits, 1000, 256, torch.float32)


def test_all_gather_int8_bf16(ranks4):
    ranks4.run(_all_gather, 8, 777, 64, torch.bfloat16)


def _int8_alias(rank, world):
    qcoll.Topology(2)
    mine = shard_of(rank, 300)
    a, b = torch.empty(world * 300), torch.empty(world * 300)
    qcoll.all_gather_int8(a, mine)
    h = qcoll.all_gather_quantized(b, mine, bits=8, async_op=True)
    h.wait()
    assert torch.equal(a, b)


def test_all_gather_int8_is_bits8_and_async(ranks4):
    ranks4.run(_int8_alias)


# ---------------------------------------------------------------- hpZ
def _replica(rank, world, L, bits):
    topo = qcoll.Topology(L)
    n = 500
    mine = shard_of(rank, n)
    fwd = torch.empty(world * n)
    gathered = qcoll.all_gather_quantized(fwd, mine, bits=bits)
    assert gathered.output is fwd and gathered.rows.shape[0] == world
    sec = qcoll.SecondaryShard.keep(gathered, topo)
    stats.reset()
    bwd = torch.full((world * n,), float("nan"))
    qcoll.replica_gather(bwd, sec)
    assert torch.equal(fwd, bwd)
    assert stats.stats.inter_bytes == 0
    assert stats.stats.intra_bytes == (L - 1) * sec.nbytes
    if bits is not None:
        per_shard = qcoll.quant.packed_nbytes(n, bits, 256)
        assert sec.nbytes == topo.num_nodes * (HEADER + per_shard)


@pytest.mark.parametrize("L", [2, 4, 1])
@pytest.mark.parametrize("bits", [8, None])
def test_replica_gather_bit_identical_and_node_local(ranks4, L, bits):
    ranks4.run(_replica, L, bits)


# ---------------------------------------------------------------- qgZ
def qgz_oracle(world, L, S, block, bits, seed=0):
    """Exact fp64 reduce-scatter result for every rank and a per-element error bound."""
    N = world // L
    inputs = np.stack([shard_of(r, world * S, seed).double().numpy() for r in range(world)])  # [src, W*S]
    exact = inputs.sum(axis=0).reshape(world, S)
    bound = np.zeros((world, S))
    for dst in range(world):
        sl = inputs[:, dst * S:(dst + 1) * S]
        hop1 = np.stack([block_halfscale(sl[s], block, bits) for s in range(world)])
        bound[dst] = hop1.sum(axis=0)
        if L > 1 and N > 1:  # partial sums are requantized between the hops
            for node in range(N):
                part = sl[node * L:(node + 1) * L].sum(axis=0)
                err1 = hop1[node * L:(node + 1) * L].sum(axis=0)
                bound[dst] += block_halfscale(np.abs(part) + err1, block, bits)
    return exact, bound


def _qgz(rank, world, L, bits, S, block, op, num_chunks):
    topo = qcoll.Topology(L)
    x = shard_of(rank, world * S)
    out = torch.empty(S)
    qcoll.reduce_scatter_quantized(out, x, bits=bits, block_size=block, topology=topo, op=op, num_chunks=num_chunks)
    exact, bound = qgz_oracle(world, L, S, block, bits or 8)
    div = world if op == "avg" else 1
    got = out.double().numpy()
    if bits is None:
        assert np.allclose(got, exact[rank] / div, rtol=1e-5, atol=1e-5)
    else:
        slack = 1e-5 * (np.abs(exact[rank]) + 1)
        assert np.all(np.abs(got - exact[rank] / div) <= bound[rank] / div + slack), np.max(
            np.abs(got - exact[rank] / div) - bound[rank] / div)
    return out


@pytest.mark.parametrize("L", [2, 4, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_reduce_scatter_quantized_placement_and_bound(ranks4, L, bits):
    ranks4.run(_qgz, L, bits, 700, 128, "sum", 1)


def test_reduce_scatter_avg_and_baseline(ranks4):
    ranks4.run(_qgz, 2, 4, 640, 64, "avg", 1)
    ranks4.run(_qgz, 2, None, 640, 64, "sum", 1)


def _qgz_chunked(rank, world, stochastic):
    topo = qcoll.Topology(2)
    x = shard_of(rank, world * 1000)
    outs = []
    for chunks in (1, 3, 100):
        out = torch.empty(1000)
        h = qcoll.reduce_scatter_quantized(out, x, bits=4, block_size=32, topology=topo, num_chunks=chunks,
                                           stochastic=stochastic, seed=7, async_op=True)
        h.wait()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("stochastic", [False, True])
def test_reduce_scatter_chunked_equals_unchunked(ranks4, stochastic):
    ranks4.run(_qgz_chunked, stochastic)


def _qgz_nan(rank, world):
    topo = qcoll.Topology(2)
    S, block = 512, 128
    x = shard_of(rank, world * S)
    if rank == 1:
        x[2 * S + 130] = float("nan")  # slice of rank 2, its second block
    out = torch.empty(S)
    qcoll.reduce_scatter_quantized(out, x, bits=4, block_size=block, topology=topo)
    nan = torch.isnan(out)
    if rank == 2:
        assert nan[128:256].all() and not nan[:128].any() and not nan[256:].any()
    else:
        assert not nan.any()


def test_reduce_scatter_nan_reaches_owner_block(ranks4):
    ranks4.run(_qgz_nan)


# ---------------------------------------------------------------- byte accounting
def _bytes(rank, world):
    topo = qcoll.Topology(2)
    N, L = topo.num_nodes, topo.ranks_per_node
    n = 4096
    packed = qcoll.quant.packed_nbytes(n, 8, 256)
    stats.reset()
    qcoll.all_gather_int8(torch.empty(world * n), shard_of(rank, n))
    assert stats.stats.inter_bytes == (world - 1) * (HEADER + packed) and stats.stats.intra_bytes == 0
    assert stats.stats.header_bytes == (world - 1) * HEADER
    stats.reset()
    qcoll.all_gather_quantized(torch.empty(world * n), shard_of(rank, n), bits=None)
    assert stats.stats.inter_bytes == (world - 1) * n * 4 and stats.stats.header_bytes == 0
    S = 8192
    slice_bytes = qcoll.quant.packed_nbytes(S, 4, 128)  # = S/2 codes + S/128*4 scales
    assert slice_bytes == S // 2 + S // 128 * 4
    stats.reset()
    qcoll.reduce_scatter_quantized(torch.empty(S), shard_of(rank, world * S), topology=topo)
    # one frame per peer and hop: hop 1 carries the N slices for one local peer behind one header
    assert stats.stats.intra_bytes == (L - 1) * (HEADER + N * slice_bytes)
    assert stats.stats.inter_bytes == (N - 1) * (HEADER + slice_bytes)
    assert stats.stats.header_bytes == (L - 1 + N - 1) * HEADER
    stats.reset()
    qcoll.reduce_scatter_quantized(torch.empty(S), shard_of(rank, world * S), topology=topo, num_chunks=4)
    assert stats.stats.header_bytes == 4 * (L - 1 + N - 1) * HEADER  # a frame per chunk
    stats.reset()
    qcoll.reduce_scatter_quantized(torch.empty(S), shard_of(rank, world * S), bits=None, topology=topo)
    assert stats.stats.inter_bytes == (world - 1) * S * 4 and stats.stats.header_bytes == 0


def test_byte_counters_equal_analytic_volume(ranks4):
    ranks4.run(_bytes)
