"""SimiGrad inside qgZ: the half-batch cosine measured in the reduction, its quantization-noise
correction, the bytes it costs, and the adaptive-batch controller.

Oracles: the two half-batch gradients summed directly in float64 (every rank regenerates
every rank's input), the unquantized measurement for the quantized one, scripted cosines
for the controller, an uninterrupted run for checkpoint resume.
"""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll import zero
from qcoll.comm import similarity as sim
from qcoll.comm import stats
from qcoll.testing import Batches, corpus, global_loss, tiny_model

from distributed import RankPool

S = 1000  # elements per rank's slice: not a multiple of the block


def _inputs(world: int) -> torch.Tensor:
    """Every rank's input, correlated (a shared direction plus rank noise): [world, world * S] float64."""
    g = torch.Generator().manual_seed(42)
    common = torch.randn(world * S, generator=g, dtype=torch.float64)
    return torch.stack([common + 1.5 * torch.randn(world * S, generator=g, dtype=torch.float64)
                        for _ in range(world)])


def _half_a_ranks(world: int, per_node: int) -> list[int]:
    nodes = world // per_node
    if nodes > 1:
        return [r for r in range(world) if r // per_node < nodes // 2]
    return [r for r in range(world) if r < per_node // 2]


def _cosine_of_halves(x: torch.Tensor, half_a: list[int]) -> float:
    a = x[half_a].sum(0)
    b = x[[r for r in range(x.shape[0]) if r not in half_a]].sum(0)
    return float(a @ b / (a.norm() * b.norm()))


def _plain_measurement(rank, world, per_node):
    topo = qcoll.Topology(per_node)
    x = _inputs(world)
    out = torch.empty(S)
    acc = sim.new_stats()
    stats.reset()
    qcoll.reduce_scatter_quantized(out, x[rank].float(), bits=None, topology=topo, op="avg", similarity=acc)
    total = acc.clone()
    dist.all_reduce(total)
    want_out = x.sum(0)[rank * S:(rank + 1) * S] / world
    return (sim.cosine(*sim.corrected(total)), _cosine_of_halves(x, _half_a_ranks(world, per_node)),
            float((out.double() - want_out).abs().max()))


@pytest.mark.parametrize("per_node", [2, 4], ids=["2x2", "1x4"])
def test_unquantized_measurement_equals_the_float64_half_batch_cosine(ranks4, per_node):
    for got, want, out_err in ranks4.run(_plain_measurement, per_node, timeout=60):
        assert abs(got - want) < 1e-6, (got, want)
        assert 0.2 < want < 0.9  # a cosine that says something
        assert out_err < 1e-5    # and the reduce-scatter's output is still the average


@pytest.mark.long   # 6 ranks on 2 cores: ~35 s
def test_unquantized_measurement_with_an_odd_node_count():
    pool = RankPool(6)
    try:
        for got, want, out_err in pool.run(_plain_measurement, 2, timeout=90):  # 3 nodes x 2: halves of 1 and 2
            assert abs(got - want) < 1e-6, (got, want)
            assert out_err < 1e-5
    finally:
        pool.close()


def _quantized_correction(rank, world, steps):
    """The char transformer trained on exact all-reduced gradients; each step its local gradients
    are also reduced with qgZ (4 bits) and without quantization, both measuring."""
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    batches = Batches(corpus(), 8, model.cfg.context, 13)
    rows = []
    for _ in range(steps):
        x, y = batches.next(rank, world)
        model(x, y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % world)])
        measured = []
        for bits in (4, None):
            acc = sim.new_stats()
            qcoll.reduce_scatter_quantized(torch.empty(flat.numel() // world), flat, bits=bits, topology=topo,
                                           op="avg", similarity=acc)
            dist.all_reduce(acc)
            measured.append(acc)
        q, exact = measured
        s = q.tolist()
        rows.append((sim.cosine(*sim.corrected(exact)), sim.cosine(*sim.corrected(q)),
                     sim.cosine(s[sim.DOT], s[sim.AA], s[sim.BB])))
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    return rows


def test_quantization_noise_correction_removes_the_bias(ranks4):
    """4-bit noise inflates |A|^2 and |B|^2, not dot(A, B): the raw cosine is biased low;
    subtracting the noise energy the scales predict brings it back to the exact one."""
    rows = ranks4.run(_quantized_correction, 50, timeout=180)[0]
    exact, corrected, raw = (torch.tensor(c, dtype=torch.float64) for c in zip(*rows))
    corrected_err = float((corrected - exact).abs().mean())
    raw_err = float((raw - exact).abs().mean())
    raw_bias, corrected_bias = float((raw - exact).mean()), float((corrected - exact).mean())
    why = (corrected_err, raw_err, corrected_bias, raw_bias)  # measured: 0.008, 0.016, +0.0002, -0.014
    assert corrected_err < 0.02, why
    assert raw_err > 1.5 * corrected_err, why
    assert raw_bias < -0.005 and abs(corrected_bias) < 0.25 * abs(raw_bias), why  # biased low, as derived


def _bytes_of_a_step(rank, world, measure):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    m = zero.shard(model, topo, zero.ZeroConfig(), units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-3)
    if measure:
        zero.AdaptiveBatch(opt, target=0.8)
    x, y = Batches(corpus(), 8, 32, 0).next(rank, world)
    stats.reset()
    m(x, y).backward()
    snap = stats.snapshot()
    return snap["intra_bytes"], snap["inter_bytes"], snap["calls"], zero.state_of(m).engine.last_similarity


def test_a_measurement_costs_one_12_byte_all_reduce_and_nothing_else(ranks4):
    plain = ranks4.run(_bytes_of_a_step, False, timeout=60)
    measured = ranks4.run(_bytes_of_a_step, True, timeout=60)
    for (intra0, inter0, calls0, cos0), (intra1, inter1, calls1, cos1) in zip(plain, measured):
        assert intra1 == intra0 and inter1 == inter0 + 12
        extra = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in set(calls0) | set(calls1)}
        assert {k: v for k, v in extra.items() if v} == {"similarity_all_reduce": 1}
        assert cos0 is None and -1 <= cos1 <= 1


# ---------------------------------------------------------------------------- the controller
def _scripted(rank, world):
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=model.units())
    opt = zero.Optimizer(m, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="target"):
        zero.AdaptiveBatch(opt, target=1.5)
    with pytest.raises(ValueError, match="accumulation"):
        zero.AdaptiveBatch(opt, accumulation=9, max_accumulation=8)
    ctl = zero.AdaptiveBatch(opt, target=0.5, max_accumulation=8)
    trace = [ctl.update(c) for c in [0.1] * 9 + [math.nan] + [0.9] * 4]
    lrs = [pg["lr"] for pg in opt.param_groups]
    smooth = zero.AdaptiveBatch(opt, target=0.5, window=3, accumulation=4, max_accumulation=8)
    smoothed = [smooth.update(c) for c in (0.9, 0.1, 0.1, 0.1)]  # means 0.9, 0.5, 0.367, 0.1
    return trace, lrs, smoothed


def test_controller_grows_below_target_shrinks_above_and_keeps_its_bounds(ranks4):
    trace, lrs, smoothed = ranks4.run(_scripted, timeout=60)[0]
    # below target: b -> max(b + 1, 1.1 b), capped at 8; NaN (a skipped step): unchanged;
    # above: b -> max(1, min(b - 1, 0.9 b))
    assert trace == [2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 7, 6, 5, 4]
    assert lrs == [pytest.approx(0.1 * math.sqrt(4))] * len(lrs)
    assert smoothed == [3, 2, 3, 4]  # b=4: shrink (0.9), shrink (0.5 is not below), grow, grow


def _adaptive_steps(m, opt, ctl, batches, rank, world, n):
    out = []
    for _ in range(n):
        k = ctl.accumulation_steps
        total = 0.0
        for i in range(k):
            x, y = batches.next(rank, world)
            with m.no_sync() if i < k - 1 else contextlib.nullcontext():
                loss = m(x, y) / k
                loss.backward()
            total += global_loss(loss)
        opt.step()
        ctl.update()
        opt.zero_grad()
        out.append((total, k, ctl.last_cosine, opt.param_groups[0]["lr"]))
    return out


def _adaptive_resume(rank, world, path):
    def setup(seed):
        model = tiny_model(seed)
        m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(stochastic_grad_rounding=True), units=model.units())
        opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
        return m, opt, zero.AdaptiveBatch(opt, target=0.99, max_accumulation=6)  # grows at every step

    m, opt, ctl = setup(0)
    batches = Batches(corpus(), 8, 32, 17)
    before = _adaptive_steps(m, opt, ctl, batches, rank, world, 3)
    zero.save(path, m, opt, adaptive=ctl)
    rng = batches.state()
    first = _adaptive_steps(m, opt, ctl, batches, rank, world, 3)
    m2, opt2, ctl2 = setup(99)
    zero.load(path, m2, opt2, adaptive=ctl2)
    batches.set_state(rng)
    second = _adaptive_steps(m2, opt2, ctl2, batches, rank, world, 3)
    return before, first, second


def test_adaptive_batching_resumes_bit_exactly(ranks4, tmp_path):
    before, first, second = ranks4.run(_adaptive_resume, str(tmp_path / "ck"), timeout=180)[0]
    assert first == second, (before, first, second)
    assert [k for _, k, _, _ in before + first] == [1, 2, 3, 4, 5, 6]
