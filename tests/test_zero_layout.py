"""The block-aligned flat layout: no quantization block mixes two parameters.

Oracle: each parameter quantized on its own by the codec (``qcoll.quantize`` of that
parameter alone, which the codec tests hold against float64 numpy). With the aligned
layout the forward's gathered weights equal it bit for bit; with the old unaligned
concatenation the blocks straddle parameters and they do not.
"""
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.testing import Batches, corpus, global_loss, tiny_model, train_steps

from zero_helpers import make_optimizer


def _odd_model():
    """Parameters of awkward sizes, a LayerNorm gain (values 1.0) next to small weights."""
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(13, 37), nn.LayerNorm(37), nn.Linear(37, 29), nn.LayerNorm(29), nn.Linear(29, 5))
    with torch.no_grad():
        for mod in m:
            if isinstance(mod, nn.Linear):
                mod.weight.mul_(0.02)
    return m


def _gathered_vs_alone(rank, world, bits, block):
    inner = _odd_model()
    expected = {n: qcoll.dequantize(qcoll.quantize(p.detach(), bits, block)) for n, p in inner.named_parameters()}
    m = zero.shard(nn.Sequential(inner), qcoll.Topology(2),
                   zero.ZeroConfig(weight_bits=bits, weight_block=block, hpz=False, grad_bits=None),
                   units=[inner])  # one unit, one group: all parameters in one flat buffer
    seen = {}

    def record(module, args):  # runs after the unit's gather (qcoll's pre-hook is prepended)
        for n, p in module.named_parameters():
            seen[n] = p.detach().clone()

    inner.register_forward_pre_hook(record)
    m(torch.randn(4, 13))
    g = next(g for g in zero.state_of(m).groups if g.params)
    layout = {"offsets": g.offsets, "shard": g.shard_numel, "numels": g.numels}
    return {n: torch.equal(seen[n], expected[n]) for n in expected}, layout


def test_every_parameter_is_quantized_on_its_own(ranks4):
    for bits, block in ((4, 256), (2, 64), (6, 32)):
        same, layout = ranks4.run(_gathered_vs_alone, bits, block, timeout=60)[0]
        assert all(same.values()), (bits, block, same)
        assert all(off % block == 0 for off in layout["offsets"]), layout
        assert layout["shard"] % block == 0, layout
        ends = [o + n for o, n in zip(layout["offsets"], layout["numels"])]
        assert all(e <= o for e, o in zip(ends, layout["offsets"][1:])), layout  # no overlap


def _padding_report(rank, world, block):
    inner = _odd_model()
    m = zero.shard(nn.Sequential(inner), qcoll.Topology(2), zero.ZeroConfig(weight_bits=4, weight_block=block),
                   units=[inner])
    g = next(g for g in zero.state_of(m).groups if g.params)
    return zero.memory_report(m)["padding"], zero.memory_report(m)["master"], g.shard_numel, g.total


def test_memory_report_counts_the_padding(ranks4):
    block = 64
    out = ranks4.run(_padding_report, block, timeout=60)
    numels = [p.numel() for p in _odd_model().parameters()]
    # independent count: each parameter rounded up to whole blocks, the world's shards whole blocks
    padded = sum(-(-n // block) * block for n in numels)
    S = -(-padded // (4 * block)) * block
    assert all(shard == S for _, _, shard, _ in out)
    assert sum(pad for pad, _, _, _ in out) == (4 * S - sum(numels)) * 4
    assert all(master == S * 4 for _, master, _, _ in out)


def _train_save(rank, world, path, config):
    torch.manual_seed(0)
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2 if world % 2 == 0 else 1), config, units=model.units())
    cls, kw = make_optimizer("adamw")
    opt = zero.Optimizer(m, cls, **kw)
    train_steps(m, opt, Batches(corpus(), 8, 32, 5), 2, rank=rank, world=world)
    zero.save(path, m, opt)
    return m.state_dict(), {k: v.clone() for s in opt.optimizer.state.values() for k, v in s.items()
                            if isinstance(v, torch.Tensor) and v.dim() == 1}


def _load_into(rank, world, path, config):
    model = tiny_model(99)
    m = zero.shard(model, qcoll.Topology(2 if world % 2 == 0 else 1), config, units=model.units())
    cls, kw = make_optimizer("adamw")
    opt = zero.Optimizer(m, cls, **kw)
    zero.load(path, m, opt)
    # the optimizer's moments, back in the full compact layout: gathered to compare across layouts
    moments = {}
    for g in zero.state_of(m).groups:
        for k, v in opt.optimizer.state[g.master].items():
            if isinstance(v, torch.Tensor) and v.shape == g.master.shape:
                full = g.gather_full(v)
                moments[(g.name, k)] = torch.cat([full[o:o + n] for o, n in zip(g.offsets, g.numels)])
    x, y = Batches(corpus(), 8, 32, 17).next(rank, world)
    return m.state_dict(), moments, global_loss(m(x, y))


def test_padded_checkpoint_reshards_across_world_and_block_size(ranks4, ranks2, tmp_path):
    """A checkpoint of 4 ranks with 256-element blocks (padded layout) loads into 2 ranks with
    64-element blocks, and into the unpadded ZeRO-3 layout: same parameters, same moments."""
    path = str(tmp_path / "ck")
    saved, _ = ranks4.run(_train_save, path, zero.ZeroConfig(weight_bits=4, weight_block=256), timeout=120)[0]
    results = [ranks2.run(_load_into, path, cfg, timeout=120)[0]
               for cfg in (zero.ZeroConfig(weight_bits=4, weight_block=64), zero.ZeroConfig.zero3())]
    for loaded, _, _ in results:
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), k
    (_, moments_a, _), (_, moments_b, _) = results
    assert moments_a.keys() == moments_b.keys() and moments_a
    for k in moments_a:
        assert torch.equal(moments_a[k], moments_b[k]), k
