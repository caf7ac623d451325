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


def _node_by_node(rank, world, L, bits, outliers, dtype):
    """The gather with ``topology=`` against the flat gather (bit for bit: output and rows),
    the bytes each stage hands to the node links, async with ``advance()``, and a kept hpZ
    secondary that rebuilds the same output."""
    topo = qcoll.Topology(L)
    n = 700
    mine = shard_of(rank, n, dtype=dtype)
    flat, staged = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
    a = qcoll.all_gather_quantized(flat, mine, bits=bits, block_size=128, outliers=outliers)
    stats.reset()
    handle = qcoll.all_gather_quantized(staged, mine, bits=bits, block_size=128, outliers=outliers, topology=topo,
                                        async_op=True)
    N = world // L
    stages = 2 if N > 1 and L > 1 else 1
    assert stats.stats.calls["all_gather"] == 1           # the call launches the first stage only
    handle.advance()
    handle.advance()  # idempotent: the stage inside the node is launched once
    assert stats.stats.calls["all_gather"] == stages      # advance() launched the second
    b = handle.wait()
    assert stats.stats.calls["all_gather"] == stages
    assert torch.equal(flat, staged) and torch.equal(a.rows, b.rows) and b.output is staged
    if bits is None:
        assert torch.equal(staged, torch.cat([shard_of(r, n, dtype=dtype) for r in range(world)]))
    frame = a.rows[0].numel() * a.rows.element_size()
    if N > 1 and L > 1:   # each buffer crosses once per other node, then N of them inside the node
        assert (stats.stats.inter_bytes, stats.stats.intra_bytes) == ((N - 1) * frame, (L - 1) * N * frame)
    else:                 # one stage: the flat gather
        assert (stats.stats.inter_bytes if N > 1 else stats.stats.intra_bytes) == (world - 1) * frame
    secondary = qcoll.SecondaryShard.keep(b, topo)
    again = torch.empty_like(staged)
    qcoll.replica_gather(again, secondary)
    assert torch.equal(again, staged)


@pytest.mark.parametrize("L,bits,outliers,dtype", [(2, 8, 0, torch.float32), (2, 4, 2, torch.float32),
                                                   (2, None, 0, torch.float32), (2, 8, 0, torch.bfloat16),
                                                   (1, 8, 0, torch.float32), (4, 8, 0, torch.float32)])
def test_node_by_node_gather_is_the_flat_gather_with_fewer_link_bytes(ranks4, L, bits, outliers, dtype):
    ranks4.run(_node_by_node, L, bits, outliers, dtype)


def _node_by_node_bad_args(rank, world):
    topo = qcoll.Topology(2)
    out, mine = torch.empty(world * 10), torch.ones(10)
    with pytest.raises(ValueError, match="either group= or topology="):
        qcoll.all_gather_quantized(out, mine, group=topo.intra_group, topology=topo)
    with pytest.raises(TypeError, match="topology must be a qcoll Topology"):
        qcoll.all_gather_quantized(out, mine, topology="node")


def test_node_by_node_gather_rejects_a_group_and_a_non_topology(ranks4):
    ranks4.run(_node_by_node_bad_args)


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
        stats.reset()
        h = qcoll.reduce_scatter_quantized(out, x, bits=4, block_size=32, topology=topo, num_chunks=chunks,
                                           stochastic=stochastic, seed=7, async_op=True)
        if chunks == 3:  # hop 2 launched by advance() (the ZeRO layer's way) before wait()
            assert stats.stats.calls["all_to_all"] == 3   # the call: hop 1 of the 3 chunks
            h.advance()
            assert stats.stats.calls["all_to_all"] == 6   # advance(): hop 2 of each
        h.wait()
        outs.append(out)
    sync = torch.empty(1000)
    qcoll.reduce_scatter_quantized(sync, x, bits=4, block_size=32, topology=topo, stochastic=stochastic, seed=7)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]) and torch.equal(outs[0], sync)


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
def qgz_two_stage(world, L, S, block, intra, inter, seed=0, k=0, make=None):
    """What qgZ with ``bits=(intra, inter)`` must give every rank, bit for bit: the reference
    codec composed rank by rank in one process (swizzle-quantize, hop 1 to the node's ranks,
    dequantize-sum-requantize of each node's partial sums, hop 2 to the nodes, final sum)."""
    from qcoll.quant import reference as ref
    from qcoll.quant import outliers as reserve
    make = make or shard_of
    N = world // L
    b1 = intra if L > 1 else inter          # hop 1 runs only with several ranks per node
    b2 = inter if N > 1 else b1             # hop 2 only with several nodes
    if k:   # the outlier reserve's rows (checked against a float64 oracle in test_codec_outliers)
        swizzle = lambda x, *a: reserve.swizzle_quantize(x, *a, k)  # noqa: E731
        requantize = lambda b, n, bi, blk, bo, _: reserve.reduce_requantize(b, n, bi, bo, blk, k)  # noqa: E731
        reduce = lambda b, n, bits, blk: reserve.dequantize_reduce(b, n, bits, blk, k)  # noqa: E731
    else:
        swizzle, requantize, reduce = ref.swizzle_quantize, ref.reduce_requantize, ref.dequantize_reduce
    q1 = [swizzle(make(r, world * S, seed), N, L, b1, block) for r in range(world)]
    results = []
    for dst in range(world):
        n, l = divmod(dst, L)
        if N == 1:                          # the node's ranks' slices for local rank l
            got = torch.stack([q1[j][l:l + 1] for j in range(L)])
        else:
            per_node = []
            for m in range(N):              # node m's partial sum of slice (n, l), requantized to b2
                slices = torch.stack([q1[m * L + j][l * N:(l + 1) * N] for j in range(L)])
                q2 = slices[0] if L == 1 else requantize(slices, S, b1, block, b2, block)
                per_node.append(q2[n:n + 1])
            got = torch.stack(per_node)
        results.append(reduce(got, S, b2, block)[0] / world)
    return results


def _qgz_per_hop(rank, world, L, intra, inter):
    topo = qcoll.Topology(L)
    S, block = 700, 128
    x = shard_of(rank, world * S)
    out, same_width = torch.empty(S), torch.empty(S)
    stats.reset()
    qcoll.reduce_scatter_quantized(out, x, bits=(intra, inter), block_size=block, topology=topo, op="avg")
    intra_bytes, inter_bytes = stats.stats.intra_bytes, stats.stats.inter_bytes
    qcoll.reduce_scatter_quantized(same_width, x, bits=(intra, intra), block_size=block, topology=topo, op="avg")
    plain = torch.empty(S)
    qcoll.reduce_scatter_quantized(plain, x, bits=intra, block_size=block, topology=topo, op="avg")
    return out, intra_bytes, inter_bytes, bool(torch.equal(same_width, plain))


@pytest.mark.parametrize("L,intra,inter", [(2, 8, 4), (4, 8, 4), (1, 8, 4), (2, 4, 2)])
def test_per_hop_bits_equal_the_two_stage_reference(ranks4, L, intra, inter):
    world, S, block = 4, 700, 128
    N = world // L
    expected = qgz_two_stage(world, L, S, block, intra, inter)
    for rank, (out, intra_bytes, inter_bytes, same_width_is_plain) in enumerate(ranks4.run(_qgz_per_hop, L, intra,
                                                                                                 inter)):
        assert torch.equal(out, expected[rank]), (rank, (out - expected[rank]).abs().max())
        assert same_width_is_plain
        # each hop's frames carry its own width
        b1 = intra if L > 1 else inter
        b2 = inter if N > 1 else b1
        assert intra_bytes == (L - 1) * (HEADER + N * qcoll.quant.packed_nbytes(S, b1, block))
        assert inter_bytes == (N - 1) * (HEADER + qcoll.quant.packed_nbytes(S, b2, block))


def spiky(rank, n, seed=0):
    """Gradient-like data: small Gaussian values with rare spikes 50x larger (heavy tails)."""
    g = torch.Generator().manual_seed(7000 + 1000 * seed + rank)
    x = torch.randn(n, generator=g) * 0.01
    spikes = torch.rand(n, generator=g) < 0.01
    return torch.where(spikes, torch.randn(n, generator=g) * 0.5, x)


def _qgz_hadamard(rank, world, L, bits):
    topo = qcoll.Topology(L)
    S, block = 1000, 128
    x = spiky(rank, world * S)
    rotated, plain = torch.empty(S), torch.empty(S)
    qcoll.reduce_scatter_quantized(rotated, x, bits=bits, block_size=block, topology=topo, hadamard=True)
    qcoll.reduce_scatter_quantized(plain, x, bits=bits, block_size=block, topology=topo)
    bf16 = torch.empty(S, dtype=torch.bfloat16)
    qcoll.reduce_scatter_quantized(bf16, x.bfloat16(), bits=bits, block_size=block, topology=topo, hadamard=True)
    return rotated, plain, bf16


@pytest.mark.parametrize("L,bits", [(2, 4), (2, (8, 4)), (4, 4), (1, 4)])
def test_hadamard_reduce_scatter_within_the_rotated_bound_and_smaller_than_plain(ranks4, L, bits):
    """Oracle: the inputs rotated in float64 (Sylvester matrix), the codec's per-element bound
    applied there hop by hop, and the error vector's norm carried back per block (rotation
    is orthogonal); the tail past the last full block is not rotated."""
    world, S, block = 4, 1000, 128
    N = world // L
    b1, b2 = (bits, bits) if isinstance(bits, int) else bits
    b1 = b1 if L > 1 else b2
    b2 = b2 if N > 1 else b1
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(block)
    full = S // block * block
    inputs = np.stack([spiky(r, world * S).double().numpy() for r in range(world)]).reshape(world, world, S)
    rot = inputs.copy()
    for a in range(0, full, block):
        rot[..., a:a + block] = rot[..., a:a + block] @ h.T
    exact = inputs.sum(axis=0)                              # [dst, S]
    rplain_err, rhad_err = 0.0, 0.0
    for dst, (rotated, plain, bf16) in enumerate(ranks4.run(_qgz_hadamard, L, bits)):
        sl = rot[:, dst]                                    # every source's rotated slice for dst
        hop1 = np.stack([block_halfscale(sl[s], block, b1) for s in range(world)])
        bound = hop1.sum(axis=0)
        if L > 1 and N > 1:
            for node in range(N):
                part = sl[node * L:(node + 1) * L].sum(axis=0)
                bound += block_halfscale(np.abs(part) + hop1[node * L:(node + 1) * L].sum(axis=0), block, b2)
        err = rotated.double().numpy() - exact[dst]
        slack = 1e-5 * (np.abs(exact[dst]) + 1)
        for a in range(0, full, block):                     # norm of the error, carried through the rotation
            assert np.linalg.norm(err[a:a + block]) <= np.linalg.norm(bound[a:a + block] + slack[a:a + block])
        assert np.all(np.abs(err[full:]) <= bound[full:] + slack[full:])
        assert torch.allclose(bf16.float(), rotated, rtol=2e-2, atol=2e-2 * rotated.abs().max().item())
        rhad_err += float(np.sum(err ** 2))
        rplain_err += float(np.sum((plain.double().numpy() - exact[dst]) ** 2))
    # spread spikes make smaller scales: the rotated reduction is more accurate on heavy-tailed data
    assert rhad_err <= 0.7 ** 2 * rplain_err, (rhad_err / rplain_err) ** 0.5


def _outlier_collectives(rank, world, L, k):
    topo = qcoll.Topology(L)
    S, block = 700, 128
    x = spiky(rank, world * S)
    out, plain = torch.empty(S), torch.empty(S)
    stats.reset()
    qcoll.reduce_scatter_quantized(out, x, bits=4, block_size=block, topology=topo, op="avg", outliers=k)
    qgz_bytes = stats.stats.intra_bytes + stats.stats.inter_bytes
    qcoll.reduce_scatter_quantized(plain, x, bits=4, block_size=block, topology=topo, op="avg")
    n = 300
    fwd = torch.empty(world * n)
    gathered = qcoll.all_gather_quantized(fwd, spiky(rank, n, seed=1), bits=2, block_size=64, outliers=k)
    bwd = torch.full_like(fwd, float("nan"))
    qcoll.replica_gather(bwd, qcoll.SecondaryShard.keep(gathered, topo))
    return out, plain, qgz_bytes, fwd, bool(torch.equal(fwd, bwd))


@pytest.mark.parametrize("L", [2, 1])
def test_outlier_reserve_in_every_collective(ranks4, L):
    from qcoll.quant import outliers as reserve
    world, S, block, k = 4, 700, 128, 2
    N = world // L
    expected = qgz_two_stage(world, L, S, block, 4, 4, k=k, make=spiky)
    exact = np.stack([spiky(r, world * S).double().numpy() for r in range(world)]).sum(axis=0).reshape(world, S)
    err_k = err_plain = 0.0
    for rank, (out, plain, qgz_bytes, fwd, replica_same) in enumerate(ranks4.run(_outlier_collectives, L, k)):
        assert torch.equal(out, expected[rank])
        frame = HEADER + reserve.packed_nbytes(S, 4, block, k)
        assert qgz_bytes == (L - 1) * (HEADER + N * (frame - HEADER)) + (N - 1) * frame
        err_k += float(np.sum((out.double().numpy() - exact[rank] / world) ** 2))
        err_plain += float(np.sum((plain.double().numpy() - exact[rank] / world) ** 2))
        for src in range(world):   # qwZ: every shard decodes as the codec's round trip of it; hpZ the same
            shard = spiky(src, 300, seed=1).reshape(1, -1)
            want = reserve.dequantize_rows_fp32(reserve.quantize_rows(shard, 2, 64, k), 300, 2, 64, k)[0]
            assert torch.equal(fwd[src * 300:(src + 1) * 300], want)
        assert replica_same
    assert err_k < 0.5 * err_plain, (err_k / err_plain) ** 0.5   # spikes kept exactly: far smaller error


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
