"""qcoll.testing's own contracts, in one process: the loop, the batches, the parity check's verdicts.

Oracles: a hand-written copy of the loop (SGD with clipping) for ``train_steps``; row
slices of the global batch for ``BatchList``; two identical runs (must pass) and runs that
differ by a known perturbation (must fail, naming what differs) for ``check_parity``.
"""
import copy

import pytest
import torch

from qcoll.testing import TINY, BatchList, Batches, check_parity, corpus, tiny_model, train_steps


def test_train_steps_is_the_plain_loop():
    model = tiny_model(0)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    seen = []
    losses = train_steps(model, opt, Batches(corpus(), 4, TINY.context, 3), 3, max_grad_norm=1.0,
                         after_step=lambda i, l: seen.append((i, len(l))))
    batches, want = Batches(corpus(), 4, TINY.context, 3), []
    for _ in range(3):
        loss = ref(*batches.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(loss.detach()))
    assert losses == want and seen == [(0, 1), (1, 2), (2, 3)]
    sd, rsd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], rsd[k]) for k in rsd)
    stopped = train_steps(model, opt, Batches(corpus(), 4, TINY.context, 3), 5, after_step=lambda i, l: i == 1)
    assert len(stopped) == 2


def test_batch_list_serves_each_rank_its_rows():
    x, y = torch.arange(24).reshape(8, 3), torch.arange(8)
    for rank in range(4):
        mine = slice(2 * rank, 2 * rank + 2)
        got = BatchList([(x, None, y)]).next(rank, 4)
        assert torch.equal(got[0], x[mine]) and got[1] is None and torch.equal(got[2], y[mine])
    with pytest.raises(ValueError, match="not divisible"):
        BatchList([(x,)]).next(0, 3)
    served = BatchList([(x,)])
    served.next()
    with pytest.raises(IndexError, match="all 1 batches"):
        served.next()
    # a global batch of Batches, sliced, is what Batches gives each rank
    a, b = Batches(corpus(), 8, 16, 2), Batches(corpus(), 8, 16, 2)
    for rank in range(4):
        mine, sliced = a.next(rank, 4), BatchList([b.next()]).next(rank, 4)
        assert all(torch.equal(u, v) for u, v in zip(mine, sliced))


def _parity(lr_b=0.5, steps=2, **tol):
    a, b = tiny_model(0), tiny_model(0)
    return check_parity(a, torch.optim.SGD(a.parameters(), lr=0.5), b, torch.optim.SGD(b.parameters(), lr=lr_b),
                        Batches(corpus(), 4, TINY.context, 1), steps, rank=0, world=1, **tol)


def test_check_parity_passes_identical_runs_and_names_what_differs():
    out = _parity(rtol=0, atol=0, loss_rtol=0, loss_atol=0)
    assert out.losses == out.reference_losses and len(out.losses) == 2
    with pytest.raises(AssertionError, match=r"after 2 steps, sharded vs single-process"):
        _parity(lr_b=0.4, rtol=1e-4, atol=1e-5)
    with pytest.raises(AssertionError, match=r"step 2 of 2: sharded loss"):  # step 1's losses agree: same start
        _parity(lr_b=0.4, rtol=1e-4, atol=1e-5, loss_rtol=1e-5)
