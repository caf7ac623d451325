"""qcoll inside FSDP2: the comms against independent oracles, on 4 gloo ranks (2 nodes x 2).

Oracles: plain FSDP2 on the same mesh and policy (bit-identical when nothing is
quantized; close when quantized), the codec applied to each parameter's shard on its own
(the all-gather's blocks), and a float64 sum of the codec's values (the all-reduce).
"""
import datetime

import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll.comm import stats
from qcoll.fsdp import QuantizedAllGather, handshake, quantize_comm
from qcoll.testing import Batches, corpus, train_steps
from qcoll.testing.fsdp2 import fsdp2_transformer

STEPS = 6


def _train(rank, world, opts):
    return _train_with(rank, world, **opts)


def _train_with(rank, world, *, hsdp=False, bf16=False, rsaf=2, quantize=None, steps=STEPS, clip=None):
    topo = qcoll.Topology(2)
    model = fsdp2_transformer(hsdp=hsdp, bf16=bf16, reshard_after_forward=rsaf)
    for kwargs in quantize or []:
        quantize_comm(model, topo, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats.reset()
    losses = train_steps(model, opt, Batches(corpus(), 8, 32), steps, rank=rank, world=world, max_grad_norm=clip)
    snap = stats.snapshot()
    params = [p.to_local().detach().clone() for p in model.parameters()]
    return losses, params, snap


@pytest.mark.parametrize("hsdp,bf16", [(False, False), (True, False), (False, True)])
def test_unquantized_comms_are_bit_identical_to_fsdp2(ranks4, hsdp, bf16):
    """weight_bits=None, grad_bits=None after a quantized call: FSDP2's own collectives
    again (the second call replaces the first), so training is bit-identical."""
    plain = ranks4.run(_train, dict(hsdp=hsdp, bf16=bf16), timeout=300)
    back = ranks4.run(_train, dict(hsdp=hsdp, bf16=bf16, quantize=[{}, dict(weight_bits=None, grad_bits=None)]),
                      timeout=300)
    for (l0, p0, _), (l1, p1, s1) in zip(plain, back):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        assert s1["inter_bytes"] == 0 and not s1["calls"]


@pytest.mark.parametrize("hsdp", [False, True])
def test_quantized_training_follows_fsdp2(ranks4, hsdp):
    plain = ranks4.run(_train, dict(hsdp=hsdp, clip=1.0), timeout=300)
    quant = ranks4.run(_train, dict(hsdp=hsdp, clip=1.0, quantize=[{}]), timeout=300)
    l0, l1, snap = plain[0][0], quant[0][0], quant[0][2]
    assert l1[0] == pytest.approx(l0[0], rel=2e-3)           # the first forward: 8-bit weights only
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(l0, l1)), (l0, l1)
    assert l1 != l0                                          # it did quantize
    calls = snap["calls"]
    if hsdp:   # the cross-node all-reduce: an all-to-all and an all-gather per parameter group and step
        assert calls == {"all_to_all": 3 * STEPS, "all_gather": 3 * STEPS}
    else:      # forward gathers across nodes, node by node; hpZ's backward gathers inside the node
        assert calls["all_to_all"] >= 2 * 3 * STEPS and calls["all_gather"] >= 3 * STEPS
    assert snap["inter_bytes"] > 0
    # replicas hold the same parameters, bit for bit (HSDP: ranks 0 and 2 share shard 0)
    if hsdp:
        for a, b in zip(quant[0][1], quant[2][1]):
            assert torch.equal(a, b)


def _grads(rank, world, hsdp, quantize):
    topo = qcoll.Topology(2)
    model = fsdp2_transformer(hsdp=hsdp, reshard_after_forward=None if hsdp else 2)
    if quantize:
        quantize_comm(model, topo)
    x, y = Batches(corpus(), 8, 32).next(rank, world)
    model(x, y).backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


@pytest.mark.parametrize("hsdp", [False, True])
def test_gradients_follow_fsdp2s(ranks4, hsdp):
    """One backward: every parameter's gradient shard within 4-bit error of FSDP2's own (the
    mean over the world, not the sum: Adam would not tell the two apart)."""
    plain = ranks4.run(_grads, hsdp, False, timeout=120)
    quant = ranks4.run(_grads, hsdp, True, timeout=120)
    for rank in range(4):
        g0 = torch.cat([g.reshape(-1) for g in plain[rank]])
        g1 = torch.cat([g.reshape(-1) for g in quant[rank]])
        assert 0 < (g1 - g0).norm() < 0.2 * g0.norm()


def _gather_params(rank, world, sizes, bits, block, aligned):
    topo = qcoll.Topology(2)
    gen = torch.Generator().manual_seed(rank)
    shards = [torch.randn(-(-s[0] // world), *s[1:], generator=gen) * (10.0 ** i) for i, s in enumerate(sizes)]
    flat = torch.cat([s.reshape(-1) for s in shards])
    out = torch.empty(world * flat.numel())
    comm = QuantizedAllGather(topo, bits, block, sizes if aligned else None)
    comm(out, flat, dist.group.WORLD)
    return flat, out


def test_all_gather_quantizes_each_parameter_on_its_own_blocks(ranks4):
    """Oracle: the codec applied to each rank's shard of each parameter alone. Shards of
    very different magnitudes: a block shared by two of them would lose the small one."""
    sizes = [torch.Size([10, 3]), torch.Size([6]), torch.Size([300, 2])]
    got = ranks4.run(_gather_params, sizes, 8, 64, True, timeout=120)
    flats = [g[0] for g in got]
    numels = [-(-s[0] // 4) * s[1:].numel() for s in sizes]
    want = torch.stack([torch.cat([qcoll.dequantize(qcoll.quantize(piece, 8, 64)).reshape(-1)
                                   for piece in f.split(numels)]) for f in flats]).reshape(-1)
    for _, out in got:
        assert torch.equal(out, want)
    straddled = ranks4.run(_gather_params, sizes, 8, 64, False, timeout=120)[0][1]
    assert not torch.equal(straddled, want)


def _all_reduce(rank, world, bits, op, inter):
    topo = qcoll.Topology(2)
    group = topo.inter_group if inter else None
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    y = x.clone()
    qcoll.all_reduce_quantized(y, bits, 128, group=group, op=op)
    return x, y


@pytest.mark.parametrize("inter,op", [(True, "avg"), (False, "sum")])
def test_all_reduce_quantized_matches_the_codec_oracle(ranks4, inter, op):
    """Every rank ends with the same values: each group rank's slice summed (fp32, in rank
    order) from the codec's values of the members' slices, then the codec's value of that
    sum; and within the 4-bit error of the float64 sum."""
    got = ranks4.run(_all_reduce, 4, op, inter, timeout=120)
    members = [[0, 2], [1, 3]] if inter else [[0, 1, 2, 3]]
    for group in members:
        g, n = len(group), 1000
        S = -(-n // g)
        padded = [torch.cat([got[r][0], torch.zeros(g * S - n)]).view(g, S) for r in group]
        want = []
        for j in range(g):
            total = torch.zeros(S)
            for p in padded:          # an fp32 left fold in rank order, as the reduction is specified
                total = total + qcoll.dequantize(qcoll.quantize(p[j], 4, 128))
            total = total / g if op == "avg" else total
            want.append(qcoll.dequantize(qcoll.quantize(total, 4, 128)))
        want = torch.cat(want)[:n]
        exact = sum(got[r][0].double() for r in group) / (g if op == "avg" else 1)
        for r in group:
            assert torch.equal(got[r][1], want)
        assert (want.double() - exact).abs().max() < 0.25 * exact.abs().max()


def _bad_input(rank, world, case):
    topo = qcoll.Topology(2)
    if case == "no fsdp":
        quantize_comm(torch.nn.Linear(2, 2), topo)
    if case == "no hpz":
        quantize_comm(fsdp2_transformer(reshard_after_forward=True), topo)
    if case == "hpz unset":
        quantize_comm(fsdp2_transformer(), topo)
    if case == "hpz off":
        quantize_comm(fsdp2_transformer(reshard_after_forward=2), topo, hpz=False)
    if case == "bits":
        quantize_comm(fsdp2_transformer(reshard_after_forward=2), topo, weight_bits=3)
    if case == "block":
        quantize_comm(fsdp2_transformer(reshard_after_forward=2), topo, grad_block=100)
    if case == "topology":
        quantize_comm(fsdp2_transformer(hsdp=True), qcoll.Topology(4))
    if case == "topology vs hpz":   # one node of 4: nothing would be quantized, but the group is no node's
        quantize_comm(fsdp2_transformer(ranks_per_node=4, reshard_after_forward=2), qcoll.Topology(4), hpz=False,
                      weight_bits=None)
    if case == "module":
        quantize_comm("model", topo)


@pytest.mark.parametrize("case,error,words", [
    ("no fsdp", ValueError, "no FSDP2 module under Linear"),
    ("no hpz", ValueError, "reshard_after_forward is True (the world)"),
    ("hpz unset", ValueError, "reshard_after_forward=2"),
    ("hpz off", ValueError, "hpz=False"),
    ("bits", ValueError, "bits must be one of"),
    ("block", ValueError, "block_size must be a power of two"),
    ("topology", ValueError, "init_device_mesh(device, (1, 4)"),
    ("topology vs hpz", ValueError, "reshard_after_forward=2 keeps its shard on ranks"),
    ("module", TypeError, "module must be a torch.nn.Module, got str"),
])
def test_bad_input_is_a_clear_error(ranks4, case, error, words):
    with pytest.raises(Exception) as e:
        ranks4.run(_bad_input, case, timeout=120)
    assert error.__name__ in str(e.value) and words in str(e.value)


def _user_hook_on_hsdp(rank, world):
    from qcoll.fsdp import hybrid

    model = fsdp2_transformer(hsdp=True)
    model.blocks[1].set_all_reduce_hook(lambda grad: None)
    try:
        quantize_comm(model, qcoll.Topology(2))
    except ValueError as e:
        groups = [g for m in (model.blocks[0], model) for g in m._get_fsdp_state()._fsdp_param_groups]
        untouched = all(not hasattr(g.mesh_info, hybrid.ORIGINAL_ATTR) and g._all_reduce_hook is None for g in groups)
        return str(e), untouched
    return None, None


def test_an_error_leaves_the_model_as_it_was(ranks4):
    """A user's all-reduce hook on one HSDP block: a ValueError naming it, and no other group was
    changed (every check runs before any comm is installed)."""
    for message, untouched in ranks4.run(_user_hook_on_hsdp, timeout=120):
        assert message and "already has an all-reduce hook of the user's" in message
        assert untouched


def _some_ranks_only(rank, world):
    topo = qcoll.Topology(2)                 # (building one is collective: every rank does)
    model = fsdp2_transformer(reshard_after_forward=2)
    if rank < 2:
        quantize_comm(model, topo, timeout=datetime.timedelta(seconds=3))
    else:      # (test only: keep the ranks' call counts equal, so the pool serves the next tests)
        handshake.AGREEMENT.skip()


def _other_arguments(rank, world):
    quantize_comm(fsdp2_transformer(reshard_after_forward=2), qcoll.Topology(2), grad_bits=4 if rank else 8)


def test_quantize_comm_on_some_ranks_only_names_them(ranks4):
    """Ranks 0-1 call it, 2-3 do not: the callers name ranks 2 and 3 (which, were they to go
    on, would time out in FSDP2's own all-gather: nothing of qcoll's runs there)."""
    with pytest.raises(Exception) as e:
        ranks4.run(_some_ranks_only, timeout=120)
    assert set(e.value.errors) == {0, 1}
    for rank in (0, 1):
        assert "ranks [2, 3] did not call it within 0:00:03" in e.value.errors[rank]


def test_quantize_comm_with_other_arguments_on_one_rank(ranks4):
    with pytest.raises(Exception) as e:
        ranks4.run(_other_arguments, timeout=120)
    assert set(e.value.errors) == {0, 1, 2, 3}
    assert "ranks [1, 2, 3] passed other arguments" in e.value.errors[0] and "grad_bits=4" in e.value.errors[0]


def _edges(rank, world):
    """quantize_comm after a forward; on one node (twice: one warning); FSDP2's PREMUL_SUM by name."""
    import warnings
    from qcoll.fsdp import install
    from qcoll.fsdp.comms import reduce_op_name

    out = {}
    model = fsdp2_transformer(reshard_after_forward=2)
    x, y = Batches(corpus(), 8, 32).next(rank, world)
    model(x, y)
    try:
        quantize_comm(model, qcoll.Topology(2))
    except RuntimeError as e:
        out["after forward"] = str(e)
    install._warned_one_node = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            quantize_comm(fsdp2_transformer(ranks_per_node=4, reshard_after_forward=True), qcoll.Topology(4))
    out["one node"] = [str(w.message) for w in caught if "quantize_comm" in str(w.message)]
    try:
        reduce_op_name(dist._make_nccl_premul_sum(0.5))
    except ValueError as e:
        out["premul"] = str(e)
    return out


def test_quantize_comm_edges_say_what_happens(ranks4):
    """Issue 39, item 13: refused after the first forward (its docstring's rule), a warning when
    nothing crosses nodes (nothing is quantized), and a reduce op named, not an object address."""
    for out in ranks4.run(_edges, timeout=120):
        assert "has run a forward already" in out.get("after forward", ""), out
        assert len(out["one node"]) == 1 and "nothing is quantized" in out["one node"][0], out["one node"]
        assert "ReduceOp.PREMUL_SUM (factor 0.5)" in out["premul"] and "object at" not in out["premul"], out
