"""Ranks agree through the store before they build groups (a Topology that differs on one rank is a
ValueError on every rank at once, not a 30-minute hang in new_group), and a survivor of a dead
peer is told which rank died."""
import datetime
import os
import signal
import time

import pytest
import torch

import qcoll
from qcoll.fsdp import quantize_comm
from qcoll.testing.fsdp2 import fsdp2_transformer
from distributed import RankFailure, RankPool


def _topologies(rank, world, odd):
    t0 = time.monotonic()
    try:
        qcoll.Topology(odd if rank == 3 else 2)
    except (ValueError, TypeError) as e:
        outcome = ("raised", type(e).__name__, str(e))
    else:
        outcome = ("built", None, None)
    # the pool goes on: a Topology of one layout on every rank still works afterwards
    topo = qcoll.Topology(2)
    out = torch.empty(world * 64)
    qcoll.all_gather_quantized(out, torch.full((64,), float(rank)), bits=8, block_size=64, topology=topo)
    return outcome, time.monotonic() - t0, bool(torch.equal(out.view(world, 64)[:, 0], torch.arange(4.0)))


@pytest.mark.parametrize("case", ["other layout", "invalid on one rank", "wrong type on one rank"])
def test_a_topology_that_differs_on_one_rank_raises_on_every_rank_at_once(ranks4, case):
    odd = {"other layout": 4, "invalid on one rank": 3, "wrong type on one rank": "2"}[case]
    results = ranks4.run(_topologies, odd, timeout=60)
    messages = {r[0][2] for r in results}
    assert len(messages) == 1, messages          # the same error on every rank
    for (kind, error, message), seconds, works in results:
        assert kind == "raised" and error == "ValueError" and seconds < 10, (kind, message, seconds)
        assert f"ranks [0, 1, 2] passed ranks_per_node=2; ranks [3] passed ranks_per_node={odd!r}" in message, message
        assert works


def _quantize_comm_with_topologies(rank, world):
    try:
        model = fsdp2_transformer(reshard_after_forward=2)
        quantize_comm(model, qcoll.Topology(1 if rank == 1 else 2), timeout=datetime.timedelta(seconds=20))
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def test_quantize_comm_with_a_topology_of_its_own_on_one_rank_names_the_rank(ranks4):
    """Before, the ranks whose groups were cached went on into quantize_comm and blamed rank 1 for
    not calling it, while rank 1 hung in new_group."""
    for kind, message in ranks4.run(_quantize_comm_with_topologies, timeout=90):
        assert kind == "ValueError" and "ranks [1] passed ranks_per_node=1" in message, message
        assert "did not call it" not in message


def _killed_before_reducing(rank, world):
    qcoll.Topology(2)
    x = torch.randn(world * 256)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        qcoll.reduce_scatter_quantized(torch.empty(256), x, bits=4, block_size=64)
    except RuntimeError as e:
        return time.monotonic() - t0, "\n".join([str(e), *getattr(e, "__notes__", [])])
    return time.monotonic() - t0, None


def test_a_survivor_is_told_which_rank_died():
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": "10"})
    try:
        with pytest.raises(RankFailure) as info:
            pool.run(_killed_before_reducing, timeout=90)
        failure = info.value
        assert list(failure.dead) == [3] and failure.finished
        pid = None
        for rank in (1, 2):      # rank 3's peers: its node (hop 1) and its local index (hop 2)
            seconds, message = failure.results[rank]
            assert message is not None and seconds < 30, (rank, seconds, message)
            assert "is no longer running on this host" in message and "rank 3 (pid " in message, message
            assert "qcoll reduce_scatter" in message
        seconds, message = failure.results[0]  # waits for rank 2's hop 2, which never comes; rank 2 lives
        assert message is not None and "rank 3" not in message.split("Of the group's other ranks")[-1], message
    finally:
        pool.close(graceful=False)
