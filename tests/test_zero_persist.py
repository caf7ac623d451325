"""``ZeroConfig(persist_threshold=N)``: small parameters replicated on every rank (DeepSpeed's
parameter persistence), against single-process training and the sharded layout."""
import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll import zero
from qcoll.comm import stats
from qcoll.testing import Batches, check_parity, corpus, tiny_model

from zero_helpers import make_optimizer

BATCH = 8
THRESHOLD = 1000  # the tiny model's LayerNorm gains and biases and the small biases, not the matrices


def _small_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.numel() < THRESHOLD)


def _parity(rank, world, kind):
    model, ref = tiny_model(0), tiny_model(0)
    cfg = zero.ZeroConfig.zero3(persist_threshold=THRESHOLD)
    m = zero.shard(model, qcoll.Topology(2), cfg, units=model.units())
    groups = zero.state_of(m).groups
    persistent = [g for g in groups if g.replicated]
    cls, kw = make_optimizer(kind)
    check_parity(m, zero.Optimizer(m, cls, **kw), ref, cls(ref.parameters(), **kw),
                 Batches(corpus(), BATCH, model.cfg.context, 1), 6, rank=rank, world=world,
                 loss_rtol=1e-5, rtol=1e-4, atol=1e-5, max_grad_norm=0.5)
    # every rank holds the same replicated master (the same optimizer step on the same bytes)
    master = persistent[0].master.detach()
    every = [torch.empty_like(master) for _ in range(world)]
    dist.all_gather(every, master)
    return (len(persistent), persistent[0].total, _small_numel(ref),
            all(torch.equal(e, every[0]) for e in every),
            all(n >= THRESHOLD for g in groups if not g.replicated for n in g.numels))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_persistent_parameters_train_like_one_process(ranks4, kind):
    for n_groups, total, small, same, rest_large in ranks4.run(_parity, kind, timeout=180):
        assert n_groups == 1 and total == small > 0
        assert same and rest_large


def _traffic(rank, world, threshold):
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(persist_threshold=threshold), units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-3)
    x, y = Batches(corpus(), BATCH, 32, 0).next(rank, world)
    ops = {}
    real = stats.stats.add

    def record(op, group, nbytes, header_bytes=0):   # calls and bytes per collective kind
        calls, total = ops.get(op, (0, 0))
        ops[op] = (calls + 1, total + nbytes)
        real(op, group, nbytes, header_bytes)

    stats.stats.add = record
    try:
        m(x, y).backward()
        opt.step()
    finally:
        stats.stats.add = real
    return ops, _small_numel(tiny_model(0))


def test_persistent_parameters_leave_the_gathers_for_one_all_reduce(ranks4):
    (ops_plain, small), = ranks4.run(_traffic, 0, timeout=120)[:1]
    (ops_persist, _), = ranks4.run(_traffic, THRESHOLD, timeout=120)[:1]
    W = 4
    assert "all_reduce" not in ops_plain
    assert ops_persist["all_reduce"] == (1, 2 * (W - 1) * small * 4 // W)   # every small gradient, one call
    for op in ("all_gather", "replica_gather"):         # groups that held only small parameters are gone
        assert ops_persist[op][0] <= ops_plain[op][0]
        assert ops_persist[op][1] < ops_plain[op][1]
    assert sum(c for c, _ in ops_persist.values()) < sum(c for c, _ in ops_plain.values())


def _checkpoint(rank, world, path):
    cfg = zero.ZeroConfig(persist_threshold=THRESHOLD)
    a = zero.shard(tiny_model(0), qcoll.Topology(2), cfg)
    opt = zero.Optimizer(a, torch.optim.AdamW, lr=1e-2)
    batches = Batches(corpus(), BATCH, 32, 2)
    x, y = batches.next(rank, world)
    a(x, y).backward()
    opt.step()
    opt.zero_grad()
    zero.save(path, a, opt)
    b = zero.shard(tiny_model(7), qcoll.Topology(2), cfg)   # other values until loaded
    opt_b = zero.Optimizer(b, torch.optim.AdamW, lr=1e-2)
    zero.load(path, b, opt_b)
    loaded = all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    x, y = batches.next(rank, world)   # one more step each: the optimizer state came back too
    for m, o in ((a, opt), (b, opt_b)):
        m(x, y).backward()
        o.step()
    sa, sb = a.state_dict(), b.state_dict()
    return loaded, all(torch.equal(sa[k], sb[k]) for k in sa)


def test_checkpoint_round_trip_with_persistent_parameters(ranks4, tmp_path):
    """Saved as each rank's slice of the compact layout, loaded back whole on every rank
    (a checkpoint is tied to the grouping: the units and the threshold, as before)."""
    for loaded, stepped in ranks4.run(_checkpoint, str(tmp_path / "ckpt"), timeout=180):
        assert loaded and stepped


def test_config_and_deepspeed_mapping():
    assert zero.ZeroConfig().persist_threshold == 0
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100000}}
    assert zero.ZeroConfig.from_deepspeed(ds).persist_threshold == 100000
    with pytest.raises(ValueError, match="persist_threshold"):
        zero.ZeroConfig(persist_threshold=-1)
    with pytest.raises(TypeError, match="persist_threshold"):
        zero.ZeroConfig(persist_threshold=1.5)


def test_bucket_and_hierarchical_gather_config_and_deepspeed_mapping():
    cfg = zero.ZeroConfig()
    assert cfg.reduce_bucket_numel == 0 and cfg.hierarchical_gather is True
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 500000000}}
    assert zero.ZeroConfig.from_deepspeed(ds).reduce_bucket_numel == 500000000
    assert zero.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}}).reduce_bucket_numel == 0
    with pytest.raises(ValueError, match="reduce_bucket_numel"):
        zero.ZeroConfig(reduce_bucket_numel=-1)
    with pytest.raises(TypeError, match="hierarchical_gather"):
        zero.ZeroConfig(hierarchical_gather=1)


def test_deepspeed_counts_accept_floats_and_auto_and_name_bad_values():
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e4}}
    cfg = zero.ZeroConfig.from_deepspeed(ds)
    assert (cfg.reduce_bucket_numel, cfg.persist_threshold) == (500_000_000, 10_000)
    auto = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}
    with pytest.warns(UserWarning, match="is 'auto'") as caught:
        cfg = zero.ZeroConfig.from_deepspeed(auto)
    said = " ".join(str(w.message) for w in caught)
    assert "reduce_bucket_size is 'auto'" in said and "stage3_param_persistence_threshold is 'auto'" in said
    assert (cfg.reduce_bucket_numel, cfg.persist_threshold) == (0, 0)
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(ValueError, match=r"zero_optimization.reduce_bucket_size must be .*got"):
            zero.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "reduce_bucket_size": bad}})
