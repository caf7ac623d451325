"""Buffers (BatchNorm running statistics) on a sharded model: the same on every rank, as DDP's
``broadcast_buffers``, and ``state_dict()`` the same on every rank either way.

Oracle: an unsharded copy in this process, run forward on rank 0's micro-batch (its running
statistics after the first forward are rank 0's, which every rank must then hold).
"""
import copy

import torch
import torch.distributed as dist
from torch import nn

import qcoll
from qcoll import zero


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 10, 10, generator=g) * (1 + rank), torch.randint(0, 10, (4,), generator=g)


def _same_on_every_rank(tensors) -> bool:
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], e) for e in every)


def _buffers_run(rank, world, broadcast):
    plain = _bn_model()
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3(broadcast_buffers=broadcast))
    opt = zero.Optimizer(model, torch.optim.SGD, lr=0.1)
    x0, _ = _batch(0, 0)
    plain.train()(x0)  # the oracle: rank 0's statistics after the first forward
    first = None
    for step in range(3):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model.train()(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation after the step computes with rank 0's statistics
            model.eval()(x)
        if step == 0:
            first = [b.clone() for b in model.buffers()]
    state = model.state_dict()
    buffer_keys = [k for k in state if "running" in k or "num_batches" in k]
    return (_same_on_every_rank(list(model.buffers())), _same_on_every_rank([state[k] for k in buffer_keys]),
            all(torch.equal(a, b) for a, b in zip(first, plain.buffers())))


def test_batchnorm_buffers_are_rank_0s_on_every_rank(ranks4):
    for same, same_state, first_is_rank0s in ranks4.run(_buffers_run, True, timeout=120):
        assert same and same_state and first_is_rank0s


def test_without_broadcast_buffers_each_rank_keeps_its_own_and_state_dict_is_rank_0s(ranks4):
    results = ranks4.run(_buffers_run, False, timeout=120)
    assert not any(same for same, _, _ in results)  # the ranks' micro-batches differ
    assert all(same_state for _, same_state, _ in results)
    assert results[0][2] and not results[1][2]  # rank 0 holds its own statistics, rank 1 its own


def _save_after_step(rank, world, path):
    model = zero.shard(_bn_model(), qcoll.Topology(2), zero.ZeroConfig.zero3())
    opt = zero.Optimizer(model, torch.optim.SGD, lr=0.1)
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model.train()(x), y).backward()
    opt.step()
    zero.save(path, model, opt)  # no forward since the training one: each rank still holds its own statistics
    fresh = zero.shard(_bn_model(), qcoll.Topology(2), zero.ZeroConfig.zero3())
    zero.load(path, fresh)
    want, got = model.state_dict(), fresh.state_dict()
    return all(torch.equal(want[k], got[k]) for k in want if "running" in k)


def test_a_checkpoint_holds_rank_0s_buffers(ranks4, tmp_path):
    assert all(ranks4.run(_save_after_step, str(tmp_path / "ckpt"), timeout=120))
