"""The reductions' ``op`` ("sum" / "avg") is part of what ranks must agree on: a rank that averages
where its peers sum makes every rank raise (frames, and QCOLL_DEBUG=1), never a silently wrong sum."""
import os
import time

import numpy as np
import pytest
import torch

import qcoll
from qcoll.comm import framing

from test_comm_errors import header_oracle, lowbias32  # noqa: F401  (the format's oracle)


def test_an_averaging_header_sets_flag_bit_6():
    """docs/FORMAT.md "Frames": flags bit 6 is a reduction's op="avg"."""
    h = framing.Header(4, 128, 1000, average=True)
    plain = header_oracle(4, 128, 1000)
    prefix = bytearray(plain[:12])
    prefix[3] = 0x40
    w0, w1, w2 = (int.from_bytes(prefix[i:i + 4], "little") for i in (0, 4, 8))
    want = bytes(prefix) + lowbias32(lowbias32(lowbias32(w0) ^ w1) ^ w2).to_bytes(4, "little")
    assert h.to_bytes() == want
    assert framing.Header.from_bytes(want) == h and framing.Header.from_bytes(plain).average is False
    both = framing.Header(2, 64, 7, poisoned=True, rotated=True, outliers=8, average=True)
    assert framing.Header.from_bytes(both.to_bytes()) == both
    assert "op=avg" in h.describe()


def test_a_frame_with_the_other_op_is_a_mismatch_naming_both():
    expected = framing.Header(4, 128, 1000)
    payload = torch.zeros(2, expected.payload_nbytes(), dtype=torch.uint8)
    framed = framing.frame(payload, expected)
    framed[1, :16] = framing.header_tensor(framing.Header(4, 128, 1000, average=True), framed.device)
    receipt = lambda: framing.Receipt("reduce_scatter (inter-node hop)", 0, lambda i: 2 * i)  # noqa: E731
    with pytest.raises(qcoll.RankMismatchError, match=r"rank 0 received from rank 2 a frame with op=avg "
                                                       r"\(rank 0 has sum\)"):
        framing.unframe(framed, expected, receipt)


def _outcome(call):
    t0 = time.monotonic()
    try:
        call()
    except qcoll.RankMismatchError as e:
        return "mismatch", time.monotonic() - t0, str(e)
    return "returned", time.monotonic() - t0, None


def _op_disagreement(rank, world, debug):
    """Rank 3 averages, ranks 0-2 sum: qgZ (2 nodes x 2 ranks) and the quantized all-reduce."""
    if debug:
        os.environ["QCOLL_DEBUG"] = "1"
    try:
        topo = qcoll.Topology(2)
        op = "avg" if rank == 3 else "sum"
        x = torch.randn(world * 256, generator=torch.Generator().manual_seed(rank))
        out = torch.empty(256)
        rs = _outcome(lambda: qcoll.reduce_scatter_quantized(out, x, bits=4, block_size=64, topology=topo, op=op))
        y = x[:300].clone()
        ar = _outcome(lambda: qcoll.all_reduce_quantized(y, bits=8, block_size=64, op=op))
        plain = _outcome(lambda: qcoll.all_reduce_quantized(x[:300].clone(), bits=None, op=op))
        return rs, ar, plain
    finally:
        os.environ.pop("QCOLL_DEBUG", None)


def test_ranks_disagreeing_on_op_raise_on_every_rank(ranks4):
    outcomes = ranks4.run(_op_disagreement, False)
    for rank, (rs, ar, _) in enumerate(outcomes):
        assert rs[0] == "mismatch" and rs[1] < 10, (rank, rs)
        assert ar[0] == "mismatch" and ar[1] < 10, (rank, ar)
    # node 1 exchanges hop-1 frames that disagree; node 0 gets poisoned hop-2 frames
    assert "rank 2 received from rank 3 a frame with op=avg (rank 2 has sum)" in outcomes[2][0][2]
    assert "rank 3 received from rank 2 a frame with op=sum (rank 3 has avg)" in outcomes[3][0][2]
    assert "poisoned" in outcomes[0][0][2] and "poisoned" in outcomes[1][0][2]
    for rank in (0, 1, 2):
        assert "received from rank 3 a frame with op=avg" in outcomes[rank][1][2], outcomes[rank][1]
    assert "op=sum (rank 3 has avg)" in outcomes[3][1][2]


def test_debug_mode_compares_the_op_for_every_reduction(ranks4):
    outcomes = ranks4.run(_op_disagreement, True)
    for rank, results in enumerate(outcomes):
        for kind, _, msg in results:
            assert kind == "mismatch" and "QCOLL_DEBUG check" in msg, (rank, kind, msg)
            assert "rank 3: " in msg and "op=avg" in msg and "op=sum" in msg, msg
    for call in range(3):   # the same message on every rank
        assert len({results[call][2] for results in outcomes}) == 1


def _debug_all_reduce(rank, world, bits, op):
    """The quantized all-reduce under QCOLL_DEBUG=1 with matching arguments, and without it."""
    qcoll.Topology(2)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    results = []
    for debug in (True, False):
        if debug:
            os.environ["QCOLL_DEBUG"] = "1"
        try:
            y = x.clone()
            qcoll.all_reduce_quantized(y, bits=bits, block_size=128, op=op)
            results.append(y)
        finally:
            os.environ.pop("QCOLL_DEBUG", None)
    return results[0].numpy(), results[1].numpy(), x.numpy()


@pytest.mark.parametrize("bits,op", [(4, "sum"), (8, "avg"), (None, "avg")])
def test_debug_mode_runs_the_all_reduce_as_without_it(ranks4, bits, op):
    outcomes = ranks4.run(_debug_all_reduce, bits, op)
    inputs = np.stack([o[2] for o in outcomes]).astype(np.float64)
    exact = inputs.sum(0) / (4 if op == "avg" else 1)
    for debugged, plain, _ in outcomes:
        assert np.array_equal(debugged, plain)   # the check changes nothing
        bound = 0.2 if bits == 4 else 0.02 if bits == 8 else 1e-5
        assert np.abs(debugged - exact).max() <= bound * np.abs(inputs).max() * 4
