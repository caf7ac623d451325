"""Sharded checkpoints through torch.distributed.checkpoint: resume and reshard."""
import torch

import qcoll
from qcoll import zero
from qcoll.testing import BatchList, Batches, corpus, tiny_model, train_steps

from zero_helpers import make_optimizer

BATCH = 8
ZPP = zero.ZeroConfig(stochastic_grad_rounding=True)


def _setup(world, config, model_seed, kind="adamw"):
    topo = qcoll.Topology(2 if world % 2 == 0 else 1)
    model = tiny_model(model_seed)
    m = zero.shard(model, topo, config, units=model.units())
    cls, kw = make_optimizer(kind)
    return m, zero.Optimizer(m, cls, **kw)


def _resume(rank, world, path):
    m, opt = _setup(world, ZPP, 0)
    batches = Batches(corpus(), BATCH, 32, 11)
    train_steps(m, opt, batches, 3, rank=rank, world=world)
    zero.save(path, m, opt)
    rng = batches.state()
    first = train_steps(m, opt, batches, 3, rank=rank, world=world)
    # a fresh model with other initial values and a fresh optimizer, loaded from the checkpoint
    m2, opt2 = _setup(world, ZPP, 123)
    zero.load(path, m2, opt2)
    batches.set_state(rng)
    second = train_steps(m2, opt2, batches, 3, rank=rank, world=world)
    return first, second


def test_resume_same_world_is_bit_identical(ranks4, tmp_path):
    first, second = ranks4.run(_resume, str(tmp_path / "ck"), timeout=120)[0]
    assert first == second


def _save_for_reshard(rank, world, path):
    m, opt = _setup(world, zero.ZeroConfig.zero3(), 0)
    batches = Batches(corpus(), BATCH, 32, 5)
    train_steps(m, opt, batches, 2, rank=rank, world=world)
    zero.save(path, m, opt)
    saved = m.state_dict()
    after = train_steps(m, opt, batches, 2, rank=rank, world=world)
    return saved, after, m.state_dict(), batches.state()


def _load_resharded(rank, world, path, rng):
    m, opt = _setup(world, zero.ZeroConfig.zero3(), 77)
    zero.load(path, m, opt)
    loaded = m.state_dict()
    batches = Batches(corpus(), BATCH, 32, 5)
    batches.set_state(rng)
    after = train_steps(m, opt, batches, 2, rank=rank, world=world)
    return loaded, after, m.state_dict()


def test_checkpoint_from_4_ranks_loads_into_2(ranks4, ranks2, tmp_path):
    path = str(tmp_path / "ck4")
    rng = Batches(corpus(), BATCH, 32, 5)
    for _ in range(2):
        rng.next()
    saved, after4, final4, _ = ranks4.run(_save_for_reshard, path, timeout=120)[0]
    loaded, after2, final2 = ranks2.run(_load_resharded, path, rng.state(), timeout=120)[0]
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    # the optimizer state came along: the next steps agree up to the reduction order
    for a, b in zip(after4, after2):
        assert abs(a - b) <= 1e-5 * abs(a)
    for k in final4:
        torch.testing.assert_close(final2[k], final4[k], rtol=1e-4, atol=1e-5, msg=k)


def _save_before_the_first_step(rank, world, path):
    batches = Batches(corpus(), BATCH, 32, 23)
    xs = [batches.next() for _ in range(2)]  # global batches; BatchList gives each rank its rows
    states = []
    for save_first in (False, True):
        m, opt = _setup(world, ZPP, 0)
        if save_first:
            zero.save(path, m, opt)  # before any step: the optimizer has no state yet
        train_steps(m, opt, BatchList(xs), 2, rank=rank, world=world)
        states.append(m.state_dict())
    m, opt = _setup(world, ZPP, 5)
    zero.load(path, m, opt)  # the checkpoint holds a fresh optimizer: training from it matches too
    train_steps(m, opt, BatchList(xs), 2, rank=rank, world=world)
    states.append(m.state_dict())
    return [all(torch.equal(s[k], states[0][k]) for k in states[0]) for s in states[1:]]


def test_a_save_before_the_first_step_changes_nothing(ranks4, tmp_path):
    """The zero-lr step that creates the optimizer's state for DCP must not count as a step
    (AdamW's step counter and bias correction), neither live nor in the checkpoint."""
    assert ranks4.run(_save_before_the_first_step, str(tmp_path / "ck"), timeout=120)[0] == [True, True]
