"""ZeRO++ training on 4 gloo ranks (2 nodes x 2) against single-process training.

The oracle is plain torch (``qcoll.testing.check_parity``): the same model,
data and optimizer on the whole global batch in one process. Unquantized mode must
match it to fp32 tolerance; the quantized modes are checked by convergence.
"""
import copy

import pytest
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.comm import stats
from qcoll.quant.format import packed_nbytes
from qcoll.testing import BatchList, Batches, check_parity, corpus, tiny_model, train_steps

from zero_helpers import make_optimizer

BATCH = 8


def _zero3_vs_oracle(rank, world):
    model, ref = tiny_model(0), tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=model.units())
    cls, kw = make_optimizer("sgd")
    out = check_parity(m, zero.Optimizer(m, cls, **kw), ref, cls(ref.parameters(), **kw),
                       Batches(corpus(), BATCH, model.cfg.context, 1), 10, rank=rank, world=world,
                       loss_rtol=1e-5, rtol=1e-4, atol=1e-5)
    # the full state dict is the plain model's: strict load, tied weights stay tied
    plain = tiny_model(5)
    plain.load_state_dict(out.state)
    assert plain.head.weight is plain.embed.weight
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(plain(x), out.reference(x), rtol=1e-4, atol=1e-4)


def test_zero3_matches_single_process_training(ranks4):
    ranks4.run(_zero3_vs_oracle, timeout=180)


def _accumulation(rank, world, use_no_sync):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, zero.ZeroConfig.zero3(), units=model.units())
    cls, kw = make_optimizer("sgd")
    opt = zero.Optimizer(m, cls, **kw)
    batches = Batches(corpus(), BATCH, 32, 3)
    for _ in range(3):
        x, y = batches.next(rank, world)
        halves = [(x[:1], y[:1]), (x[1:], y[1:])]
        for i, (xa, ya) in enumerate(halves):
            last = i == len(halves) - 1
            ctx = m.no_sync() if (use_no_sync and not last) else _null()
            with ctx:
                (m(xa, ya) / 2).backward()
        opt.step()
        opt.zero_grad()
    ref = tiny_model(0)
    train_steps(ref, cls(ref.parameters(), **kw), Batches(corpus(), BATCH, 32, 3), 3)
    sd, ref_sd = m.state_dict(), ref.state_dict()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-4, atol=1e-5, msg=k)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("use_no_sync", [False, True], ids=["sharded-accumulate", "no_sync"])
def test_gradient_accumulation_equals_one_large_batch(ranks4, use_no_sync):
    ranks4.run(_accumulation, use_no_sync, timeout=120)


class Twice(nn.Module):
    """One block applied twice per forward, plus a parameter on the root."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.block = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h)) * self.scale
        return self.out(h).pow(2).mean()


def _twice(rank, world):
    topo = qcoll.Topology(2)
    torch.manual_seed(0)
    net = Twice()
    ref = copy.deepcopy(net)
    m = zero.shard(net, topo, zero.ZeroConfig.zero3())
    g = torch.Generator().manual_seed(9)
    inputs = BatchList((torch.randn(8, 6, generator=g),) for _ in range(4))  # rank r: rows 2r, 2r+1
    check_parity(m, zero.Optimizer(m, torch.optim.SGD, lr=0.1), ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                 inputs, 4, rank=rank, world=world, rtol=1e-5, atol=1e-6)
    # eval under no_grad: same output as the plain model, nothing left gathered
    x = torch.randn(3, 6, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-6)
    assert all(grp.gathered_nbytes() == 0 for grp in zero.state_of(m).groups)
    assert all(grp.secondary is None for grp in zero.state_of(m).groups)


def test_module_called_twice_and_root_parameters(ranks4):
    ranks4.run(_twice, timeout=60)


def _nonfinite(rank, world, grad_bits):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, zero.ZeroConfig(grad_bits=grad_bits), units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    before = [g.master.detach().clone() for g in zero.state_of(m).groups]
    x, y = Batches(corpus(), BATCH, 32, 0).next(rank, world)
    loss = m(x, y)
    if rank == 1:
        loss = loss * float("inf")
    loss.backward()
    assert opt.step() is False
    assert opt.skipped_steps == 1 and opt.last_step_skipped
    for g, b in zip(zero.state_of(m).groups, before):
        assert torch.equal(g.master.detach(), b)
        assert g.master.grad is None
    loss = m(x, y)
    loss.backward()
    assert opt.step() is True
    assert any(not torch.equal(g.master.detach(), b) for g, b in zip(zero.state_of(m).groups, before))


@pytest.mark.parametrize("grad_bits", [4, None])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(ranks4, grad_bits):
    ranks4.run(_nonfinite, grad_bits, timeout=60)


def _bytes_per_step(rank, world, config):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, config, units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    x, y = Batches(corpus(), BATCH, 32, 0).next(rank, world)
    stats.reset()
    m(x, y).backward()
    opt.step()
    snap = stats.snapshot()
    return snap["intra_bytes"], snap["inter_bytes"], [g.shard_numel for g in zero.state_of(m).groups]


def test_bytes_per_step_follow_the_design(ranks4):
    """Byte counters against DESIGN.md's accounting, derived per flat group of S elements.

    With W=4, L=2, N=2. The gathers run node by node (``hierarchical_gather``, the default):
    across nodes among ranks of equal local index, (N-1) buffers per rank (inter), then
    inside the node the N received ones, (L-1)*N buffers (intra). ZeRO-3 (fp32): a forward
    and a backward gather of 4S-byte buffers each; reduce-scatter over the world (W-1)/W *
    W*4S = (W-1)*4S inter; the 8-byte non-finite all-reduce is not counted. With
    ``hierarchical_gather=False`` each gather is one all-gather over the world: (W-1)*4S
    inter. ZeRO++: forward qwZ8 F8(S) buffers gathered node by node; backward replica gather
    (L-1)*N*F8(S) intra; qgZ hop 1 (L-1)*(H + N*P4(S)) intra, hop 2 (N-1)*F4(S) inter, where
    P_b(n) is one packed row of n elements, H the 16-byte frame header (docs/FORMAT.md
    "Frames") and F_b(n) = H + P_b(n) one framed row.
    """
    W, L, N = 4, 2, 2
    z3 = ranks4.run(_bytes_per_step, zero.ZeroConfig.zero3(), timeout=60)
    z3_flat = ranks4.run(_bytes_per_step, zero.ZeroConfig.zero3(hierarchical_gather=False), timeout=60)
    zpp = ranks4.run(_bytes_per_step, zero.ZeroConfig(), timeout=60)
    zpp_flat = ranks4.run(_bytes_per_step, zero.ZeroConfig(hierarchical_gather=False), timeout=60)
    fp32 = [4 * S for S in z3[0][2]]
    want_z3 = (sum(2 * (L - 1) * N * b for b in fp32), sum(2 * (N - 1) * b + (W - 1) * b for b in fp32))
    want_z3_flat = (0, sum(3 * (W - 1) * b for b in fp32))
    shards = zpp[0][2]  # the block-aligned layout: whole 256-element blocks per shard (ZeRO-3's are not)
    assert all(S % 256 == 0 for S in shards) and len(shards) == len(z3[0][2])
    H = 16
    f8 = [H + packed_nbytes(S, 8, 256) for S in shards]
    p4 = [packed_nbytes(S, 4, 128) for S in shards]
    grads_inter = sum((N - 1) * (H + b) for b in p4)
    grads_intra = sum((L - 1) * (H + N * b) for b in p4)
    backward_intra = sum((L - 1) * N * a for a in f8)
    want_zpp = (sum((L - 1) * N * a for a in f8) + backward_intra + grads_intra,
                sum((N - 1) * a for a in f8) + grads_inter)
    want_zpp_flat = (backward_intra + grads_intra, sum((W - 1) * a for a in f8) + grads_inter)
    for r in range(W):
        assert z3[r][:2] == want_z3
        assert z3_flat[r][:2] == want_z3_flat
        assert zpp[r][:2] == want_zpp
        assert zpp_flat[r][:2] == want_zpp_flat
    assert zpp[0][1] / z3[0][1] <= 0.25 and zpp_flat[0][1] / z3_flat[0][1] <= 0.25
    # per-hop gradient bits (8, 4): hop 1 inside the node at 8 bits, hop 2 across nodes at 4
    hop = ranks4.run(_bytes_per_step, zero.ZeroConfig(grad_bits=(8, 4)), timeout=60)
    g8 = [packed_nbytes(S, 8, 128) for S in shards]
    want_intra_hop = want_zpp[0] - grads_intra + sum((L - 1) * (H + N * c) for c in g8)
    for r in range(W):
        assert hop[r][:2] == (want_intra_hop, want_zpp[1])


def _first_grads(rank, world, config):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, config, units=model.units())
    x, y = Batches(corpus(), BATCH, 32, 0).next(rank, world)
    m(x, y).backward()
    return torch.cat([g.master.grad for g in zero.state_of(m).groups if g.master.grad is not None])


def test_hadamard_gradients_are_wired_through_and_accurate(ranks4):
    """grad_hadamard reaches qgZ (the gradients differ from plain 4-bit) and the reduced
    gradients stay close to the unquantized ones (the same weights: weight_bits=None)."""
    exact = ranks4.run(_first_grads, zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=None), timeout=60)
    plain = ranks4.run(_first_grads, zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=4), timeout=60)
    rotated = ranks4.run(_first_grads, zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=4,
                                                       grad_hadamard=True), timeout=60)
    for e, p, r in zip(exact, plain, rotated):
        assert not torch.equal(p, r)
        assert (r - e).norm() <= 0.2 * e.norm(), ((r - e).norm() / e.norm(), (p - e).norm() / e.norm())


def _masters_after(rank, world, config, steps):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, config, units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    losses = train_steps(m, opt, Batches(corpus(), BATCH, 32, 0), steps, rank=rank, world=world)
    return losses, torch.cat([g.master.detach().clone() for g in zero.state_of(m).groups])


@pytest.mark.parametrize("fields", [dict(), dict(hpz=False, prefetch=2), dict(weight_bits=None, hpz=False,
                                                                             grad_bits=None)])
def test_node_by_node_gathers_train_exactly_like_the_flat_gather(ranks4, fields):
    """The hierarchical gathers (and the stages launched at the engine's hooks) change how the
    bytes travel, not the values: three steps give bit-identical losses and master weights."""
    staged = ranks4.run(_masters_after, zero.ZeroConfig(**fields), 3, timeout=120)
    flat = ranks4.run(_masters_after, zero.ZeroConfig(hierarchical_gather=False, **fields), 3, timeout=120)
    for (loss_a, a), (loss_b, b) in zip(staged, flat):
        assert loss_a == loss_b and torch.equal(a, b)


def _bucketed(rank, world, config, steps):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, config, units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    calls = []
    losses = train_steps(m, opt, Batches(corpus(), BATCH, 32, 0), steps, rank=rank, world=world,
                         before_step=lambda i: stats.reset(),
                         after_step=lambda i, losses: calls.append(dict(stats.stats.calls)))
    sizes = [g.topology.world_size * g.shard_numel for g in zero.state_of(m).groups]
    return losses, torch.cat([g.master.detach().clone() for g in zero.state_of(m).groups]), calls[-1], sizes


@pytest.mark.parametrize("fields", [dict(), dict(weight_bits=None, hpz=False), dict(weight_bits=None, hpz=False,
                                                                                    grad_bits=None)])
def test_coalesced_reductions_train_exactly_like_one_per_group(ranks4, fields):
    """reduce_bucket_numel: the groups' gradients reduced together in fewer collectives, with the
    values of one reduce-scatter per group, bit for bit (with weight_bits=None the groups' slices
    are not block-aligned by the layout: the bucket aligns them). A bucket larger than the model
    holds every group until the end of the backward: one reduction; one a little larger than
    the largest group is launched during the backward: more than one, fewer than the groups."""
    alone = ranks4.run(_bucketed, zero.ZeroConfig(**fields), 3, timeout=120)
    sizes = alone[0][3]
    op = "reduce_scatter" if fields.get("grad_bits", 4) is None else "all_to_all"
    per_call = 1 if op == "reduce_scatter" else 2   # qgZ: two hops
    for limit in (sum(sizes) + 1, max(sizes) + 1):
        together = ranks4.run(_bucketed, zero.ZeroConfig(reduce_bucket_numel=limit, **fields), 3, timeout=120)
        for (loss_a, a, calls_a, _), (loss_b, b, calls_b, _) in zip(alone, together):
            assert loss_a == loss_b and torch.equal(a, b)
            assert calls_a[op] == per_call * len(sizes)
            if limit > sum(sizes):
                assert calls_b[op] == per_call
            else:
                assert per_call < calls_b[op] < calls_a[op]
