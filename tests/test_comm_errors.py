"""Bad arguments fail locally and clearly; disagreeing ranks fail together; dead ranks do not hang others."""
import os
import time

import pytest
import torch

import qcoll
from distributed import RankFailure, RankPool


def _local_errors(rank, world):
    topo = qcoll.Topology(2)
    x = torch.randn(64)
    cases = {
        "int input": lambda: qcoll.all_gather_int8(torch.empty(world * 64), torch.arange(64)),
        "size": lambda: qcoll.all_gather_int8(torch.empty(world * 64 + 1), x),
        "bits": lambda: qcoll.all_gather_quantized(torch.empty(world * 64), x, bits=3),
        "block": lambda: qcoll.all_gather_quantized(torch.empty(world * 64), x, block_size=100),
        "noncontig": lambda: qcoll.all_gather_int8(torch.empty(2, world * 64).t(), x),
        "dtype": lambda: qcoll.all_gather_int8(torch.empty(world * 64, dtype=torch.bfloat16), x),
        "rs size": lambda: qcoll.reduce_scatter_quantized(torch.empty(63), torch.randn(world * 64), topology=topo),
        "rs op": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64), topology=topo,
                                                        op="max"),
        "rs chunks": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64),
                                                            topology=topo, num_chunks=0),
        "rs topology": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64),
                                                              topology="2x2"),
        "empty secondary": lambda: qcoll.replica_gather(torch.empty(world * 64), qcoll.SecondaryShard(topo)),
    }
    msgs = {}
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)
        else:
            msgs[name] = None
    try:
        qcoll.Topology(3)
    except ValueError as e:
        msgs["topology"] = str(e)
    return msgs


def test_bad_arguments_raise_before_communication(ranks4):
    msgs = ranks4.run(_local_errors)[0]
    expect = {"int input": "input", "size": "output", "bits": "bits", "block": "block_size",
              "noncontig": "contiguous", "dtype": "dtype", "rs size": "input", "rs op": "op",
              "rs chunks": "num_chunks", "rs topology": "topology", "empty secondary": "secondary",
              "topology": "ranks_per_node=3"}
    for name, word in expect.items():
        assert msgs[name] is not None and word in msgs[name], (name, msgs[name])


def _debug_mismatch(rank, world):
    os.environ["QCOLL_DEBUG"] = "1"
    try:
        qcoll.Topology(2)
        n = 64 if rank != 3 else 128  # rank 3 disagrees on the shard size
        try:
            qcoll.all_gather_int8(torch.empty(world * n), torch.randn(n))
        except ValueError as e:
            return str(e)
        return None
    finally:
        del os.environ["QCOLL_DEBUG"]


def test_debug_mode_mismatch_raises_on_every_rank(ranks4):
    msgs = ranks4.run(_debug_mismatch)
    assert all(m is not None and "rank 3" in m and "numel=128" in m for m in msgs), msgs
    assert len(set(msgs)) == 1


def _dead_rank(rank, world):
    qcoll.Topology(2)
    if rank == 0:
        raise RuntimeError("rank 0 fails before the collective")
    t0 = time.monotonic()
    try:
        qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64))
    except Exception as e:
        return ("raised", time.monotonic() - t0, type(e).__name__)
    return ("returned", time.monotonic() - t0, None)


def test_rank_failing_before_collective_fails_others_within_timeout():
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": "4"})
    try:
        with pytest.raises(RankFailure) as info:
            pool.run(_dead_rank, timeout=60)
        failure = info.value
        assert failure.finished, "surviving ranks hung instead of timing out"
        assert list(failure.errors) == [0] and "rank 0 fails before the collective" in failure.errors[0]
        for rank in (1, 2, 3):
            outcome, seconds, _ = failure.results[rank]
            assert outcome == "raised" and seconds < 30, failure.results
    finally:
        pool.close()
