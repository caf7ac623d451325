"""Error feedback in the quantized all-reduce (qcoll.ErrorFeedback), against float64 numpy.

The oracle is the telescoping identity of error feedback: what the group received over T calls,
plus the residuals left at the end, is exactly what the ranks were given to reduce. So the
sum of the results over many 2-bit calls stays within one call's rounding of the exact sum,
where without error feedback each call's rounding adds up.
"""
import os
import tempfile
import time

import numpy as np
import pytest
import torch

import qcoll
from qcoll.comm import framing

from test_comm_errors import header_oracle, lowbias32  # noqa: F401  (the format's oracle)

N, BLOCK, STEPS = 1000, 64, 30


def test_an_error_feedback_header_sets_flag_bit_7():
    """docs/FORMAT.md "Frames": flags bit 7 is error feedback."""
    h = framing.Header(2, 64, 1000, error_feedback=True)
    prefix = bytearray(header_oracle(2, 64, 1000)[:12])
    prefix[3] = 0x80
    w0, w1, w2 = (int.from_bytes(prefix[i:i + 4], "little") for i in (0, 4, 8))
    want = bytes(prefix) + lowbias32(lowbias32(lowbias32(w0) ^ w1) ^ w2).to_bytes(4, "little")
    assert h.to_bytes() == want
    assert framing.Header.from_bytes(want) == h
    every = framing.Header(2, 64, 7, poisoned=True, rotated=True, outliers=8, average=True, error_feedback=True)
    assert framing.Header.from_bytes(every.to_bytes()) == every
    assert "error_feedback" in h.describe()


def test_a_state_refuses_another_shape_and_another_models_state():
    ef = qcoll.ErrorFeedback()
    ef.bind(1000, 4, torch.device("cpu"))
    assert ef.nbytes == (4 * 250 + 250) * 4
    with pytest.raises(ValueError, match=r"built for an all-reduce of 1000 elements over 4 ranks, but this "
                                         r"call is an all-reduce of 999 elements over 4 ranks"):
        ef.bind(999, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="over 2 ranks"):
        ef.bind(1000, 2, torch.device("cpu"))
    ef.send.fill_(0.5)
    other = qcoll.ErrorFeedback(numel=2000, group_size=4).state_dict()
    with pytest.raises(ValueError, match="saved for another tensor or model"):
        ef.load_state_dict(other)
    bad = dict(ef.state_dict(), own=torch.full((250,), float("nan")))
    with pytest.raises(ValueError, match="non-finite"):
        ef.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"shape \(250,\)"):
        ef.load_state_dict(dict(ef.state_dict(), own=torch.zeros(3)))
    with pytest.raises(ValueError, match="not an ErrorFeedback state"):
        ef.load_state_dict({"send": 1})
    assert bool((ef.send == 0.5).all())   # nothing changed
    with pytest.raises(ValueError, match="dtype"):
        qcoll.ErrorFeedback(dtype=torch.float16)
    with pytest.raises(ValueError, match="together"):
        qcoll.ErrorFeedback(numel=10)


def _steps(rank, world, bits, op, feedback, steps=STEPS):
    """``steps`` all-reduces of fresh random tensors; returns inputs, results, residuals."""
    qcoll.Topology(2)
    ef = qcoll.ErrorFeedback() if feedback else None
    gen = torch.Generator().manual_seed(1000 + rank)
    xs, outs = [], []
    for _ in range(steps):
        x = torch.randn(N, generator=gen) * 0.1 + 0.02 * (rank + 1)   # a bias: what 2 bits round away
        y = x.clone()
        qcoll.all_reduce_quantized(y, bits=bits, block_size=BLOCK, op=op, error_feedback=ef)
        xs.append(x.numpy())
        outs.append(y.numpy())
    res = (ef.send.numpy().copy(), ef.own.numpy().copy()) if feedback else None
    return np.stack(xs), np.stack(outs), res


@pytest.mark.parametrize("bits,op", [(2, "sum"), (4, "avg")])
def test_results_plus_residuals_are_the_exact_sums(ranks4, bits, op):
    outcomes = ranks4.run(_steps, bits, op, True)
    g = len(outcomes)
    inputs = np.stack([o[0] for o in outcomes]).astype(np.float64)        # [rank, step, N]
    exact = inputs.sum(0) / (g if op == "avg" else 1)                       # [step, N]
    for _, outs, _ in outcomes[1:]:
        assert np.array_equal(outs, outcomes[0][1])                         # every rank, the same values
    received = outcomes[0][1].astype(np.float64).sum(0)
    S = -(-N // g)
    send = np.stack([o[2][0] for o in outcomes]).astype(np.float64).reshape(g, g, S)   # [rank, slice, S]
    own = np.stack([o[2][1] for o in outcomes]).astype(np.float64)                      # [owner, S]
    left = send.sum(0) / (g if op == "avg" else 1) + own                                # [slice, S]
    left = left.reshape(-1)[:N]
    scale = np.abs(inputs).max() * g
    # the identity, up to fp32 arithmetic over STEPS calls
    assert np.abs(received + left - exact.sum(0)).max() <= 1e-5 * STEPS * scale
    # so the cumulative error is one call's residual, not STEPS calls' rounding
    one_call = np.abs(outcomes[0][1][-1] - exact[-1]).max()
    assert np.abs(received - exact.sum(0)).max() <= 3 * one_call + 1e-6


def test_feedback_removes_the_drift_of_2_bit_sums(ranks4):
    fed = ranks4.run(_steps, 2, "sum", True)
    plain = ranks4.run(_steps, 2, "sum", False)
    inputs = np.stack([o[0] for o in fed]).astype(np.float64)
    assert np.array_equal(inputs, np.stack([o[0] for o in plain]))
    exact = inputs.sum(0).sum(0)
    drift_fed = np.abs(fed[0][1].astype(np.float64).sum(0) - exact).mean()
    drift_plain = np.abs(plain[0][1].astype(np.float64).sum(0) - exact).mean()
    assert drift_fed * 4 < drift_plain, (drift_fed, drift_plain)


def _mixed(rank, world):
    qcoll.Topology(2)
    ef = qcoll.ErrorFeedback() if rank != 3 else None
    y = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    t0 = time.monotonic()
    try:
        qcoll.all_reduce_quantized(y, bits=2, block_size=BLOCK, error_feedback=ef)
    except qcoll.RankMismatchError as e:
        return "mismatch", time.monotonic() - t0, str(e)
    return "returned", time.monotonic() - t0, None


def test_one_rank_without_feedback_is_named_on_every_rank(ranks4):
    outcomes = ranks4.run(_mixed)
    for rank, (kind, seconds, msg) in enumerate(outcomes):
        assert kind == "mismatch" and seconds < 10, (rank, kind, msg)
    for rank in (0, 1, 2):
        assert "received from rank 3 a frame with error feedback off (rank %d has it on)" % rank in outcomes[rank][2]
    assert "error feedback on (rank 3 has it off)" in outcomes[3][2]


def _wrong_shape(rank, world):
    qcoll.Topology(2)
    ef = qcoll.ErrorFeedback(numel=N, group_size=world)
    try:
        qcoll.all_reduce_quantized(torch.zeros(N + 1), bits=4, error_feedback=ef)
    except ValueError as e:
        return str(e)


def test_a_state_for_another_tensor_is_refused_before_sending(ranks4):
    for msg in ranks4.run(_wrong_shape):
        assert "built for an all-reduce of 1000 elements" in msg and "1001 elements" in msg


def _non_finite(rank, world):
    qcoll.Topology(2)
    ef = qcoll.ErrorFeedback()
    outs = []
    for step in range(3):
        x = torch.randn(N, generator=torch.Generator().manual_seed(step * 10 + rank))
        if step == 1 and rank == 2:
            x[5] = float("inf")
        with_ef, without = x.clone(), x.clone()
        qcoll.all_reduce_quantized(with_ef, bits=2, block_size=BLOCK, error_feedback=ef)
        qcoll.all_reduce_quantized(without, bits=2, block_size=BLOCK)
        outs.append((with_ef.numpy(), without.numpy()))
    return outs, bool(torch.isfinite(ef.send).all() and torch.isfinite(ef.own).all())


def test_a_non_finite_input_stays_non_finite_and_does_not_poison_the_next_call(ranks4):
    for outs, residual_finite in ranks4.run(_non_finite):
        assert residual_finite
        for with_ef, without in outs:
            assert np.array_equal(np.isfinite(with_ef), np.isfinite(without))
        assert not np.isfinite(outs[1][0]).all()
        assert np.isfinite(outs[2][0]).all()


def _save_resume(rank, world, path):
    """5 calls, a DCP save of each rank's residual, 5 more; then the saved state into a new one."""
    import torch.distributed.checkpoint as dcp
    qcoll.Topology(2)
    xs = [torch.randn(N, generator=torch.Generator().manual_seed(100 * s + rank)) for s in range(10)]

    def run(ef, steps):
        out = []
        for x in steps:
            y = x.clone()
            qcoll.all_reduce_quantized(y, bits=2, block_size=BLOCK, error_feedback=ef)
            out.append(y)
        return torch.stack(out)

    ef = qcoll.ErrorFeedback()
    run(ef, xs[:5])
    dcp.save({f"error_feedback.rank{rank}": ef.state_dict()}, checkpoint_id=path)
    first = run(ef, xs[5:])
    fresh = qcoll.ErrorFeedback()
    state = {f"error_feedback.rank{rank}": qcoll.ErrorFeedback(numel=N, group_size=world).state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state[f"error_feedback.rank{rank}"])
    second = run(fresh, xs[5:])
    return torch.equal(first, second), fresh.calls


def test_the_state_saves_and_resumes_with_dcp_bit_for_bit(ranks4):
    with tempfile.TemporaryDirectory() as d:
        for same, calls in ranks4.run(_save_resume, os.path.join(d, "ckpt")):
            assert same and calls == 10


# ---------------------------------------------------------------- qgZ (2 nodes x 2 ranks)

def _qgz_steps(rank, world, bits, feedback, steps=STEPS):
    topo = qcoll.Topology(2)
    ef = qcoll.ErrorFeedback() if feedback else None
    gen = torch.Generator().manual_seed(2000 + rank)
    xs, outs = [], []
    for _ in range(steps):
        x = torch.randn(world * N, generator=gen) * 0.1 + 0.02 * (rank + 1)
        out = torch.empty(N)
        qcoll.reduce_scatter_quantized(out, x, bits=bits, block_size=BLOCK, topology=topo, error_feedback=ef)
        xs.append(x.numpy())
        outs.append(out.numpy())
    res = (ef.send.numpy().copy(), ef.own.numpy().copy(), ef.nbytes) if feedback else None
    return np.stack(xs), np.stack(outs), res


@pytest.mark.parametrize("bits", [2, (4, 2)])
def test_qgz_results_plus_both_hops_residuals_are_the_exact_sums(ranks4, bits):
    outcomes = ranks4.run(_qgz_steps, bits, True)
    W, Nn, L = 4, 2, 2
    inputs = np.stack([o[0] for o in outcomes]).astype(np.float64).reshape(W, STEPS, Nn, L, N)
    exact = inputs.sum(0).sum(0)                                   # [n, l, N]: summed over ranks and steps
    r1 = np.stack([o[2][0] for o in outcomes]).astype(np.float64).reshape(W, Nn, L, N)
    r2 = np.stack([o[2][1] for o in outcomes]).astype(np.float64).reshape(Nn, L, Nn, N)   # [m, l, n, S]
    assert outcomes[0][2][2] == (W * N + Nn * N) * 4               # memory: the input's size + N x S, fp32
    scale = np.abs(inputs).max() * W
    for rank in range(W):
        n, l = divmod(rank, L)
        received = outcomes[rank][1].astype(np.float64).sum(0)
        left = r1[:, n, l].sum(0) + r2[:, l, n].sum(0)
        assert np.abs(received + left - exact[n, l]).max() <= 1e-5 * STEPS * scale, rank
        one_call = np.abs(outcomes[rank][1][-1] - inputs[:, -1, n, l].sum(0)).max()
        assert np.abs(received - exact[n, l]).max() <= 3 * one_call + 1e-6


def test_qgz_feedback_removes_the_drift_of_2_bit_gradients(ranks4):
    fed = ranks4.run(_qgz_steps, 2, True)
    plain = ranks4.run(_qgz_steps, 2, False)
    inputs = np.stack([o[0] for o in fed]).astype(np.float64).reshape(4, STEPS, 4, N)
    for rank in range(4):
        exact = inputs[:, :, rank].sum(0).sum(0)
        drift_fed = np.abs(fed[rank][1].astype(np.float64).sum(0) - exact).mean()
        drift_plain = np.abs(plain[rank][1].astype(np.float64).sum(0) - exact).mean()
        assert drift_fed * 4 < drift_plain, (rank, drift_fed, drift_plain)


def _qgz_mixed(rank, world):
    topo = qcoll.Topology(2)
    ef = qcoll.ErrorFeedback() if rank != 1 else None
    try:
        qcoll.reduce_scatter_quantized(torch.empty(N), torch.randn(world * N), bits=2, block_size=BLOCK,
                                       topology=topo, error_feedback=ef)
    except qcoll.RankMismatchError as e:
        return str(e)


def test_qgz_one_rank_without_feedback_raises_on_every_rank(ranks4):
    msgs = ranks4.run(_qgz_mixed)
    assert all(m is not None for m in msgs), msgs
    assert "received from rank 1 a frame with error feedback off (rank 0 has it on)" in msgs[0]
    assert "error feedback on (rank 1 has it off)" in msgs[1]


def test_qgz_feedback_refuses_what_it_cannot_feed_back():
    ef = qcoll.ErrorFeedback()
    ef.bind(4000, 4, torch.device("cpu"), collective="reduce_scatter", nodes=2)
    with pytest.raises(ValueError, match=r"built for a qgZ reduce-scatter of 4000 elements over 4 ranks in 2 nodes, "
                                         r"but this call is an all-reduce of 4000"):
        ef.bind(4000, 4, torch.device("cpu"))
    state = ef.state_dict()
    other = qcoll.ErrorFeedback()
    other.load_state_dict(state)
    assert other.send.shape == (4000,) and other.own.shape == (2000,)


def test_beta_keeps_a_moving_average_of_the_losses():
    """LoCo's residual, against float64 arithmetic: r = beta r + (1 - beta) (compensated - decoded)."""
    gen = torch.Generator().manual_seed(3)
    old, comp, dec = (torch.randn(64, generator=gen) for _ in range(3))
    for beta in (0.0, 0.8):
        ef = qcoll.ErrorFeedback(64, 1, beta=beta)
        ef.send.copy_(old)
        ef.keep(ef.send, comp.view(4, 16), dec.view(4, 16))
        want = beta * old.double() + (1 - beta) * (comp.double() - dec.double())
        assert torch.allclose(ef.send.double(), want, atol=1e-6), beta
    for bad, error in ((1.0, ValueError), (-0.1, ValueError), ("0.8", TypeError), (True, TypeError)):
        with pytest.raises(error, match="beta must"):
            qcoll.ErrorFeedback(beta=bad)
