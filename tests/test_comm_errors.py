"""Bad arguments fail locally and clearly; disagreeing ranks fail together; dead ranks do not hang others."""
import datetime
import math
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll.comm import framing
from distributed import PRELOAD, RankFailure, RankPool, free_port


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
        "rs hop bits": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64),
                                                              topology=topo, bits=(8, 4, 2)),
        "rs inter bits": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64),
                                                                topology=topo, bits=(8, 3)),
        "secondary from a tensor": lambda: qcoll.SecondaryShard.keep(x, topo),
        "secondary of a subgroup": lambda: qcoll.SecondaryShard.keep(
            qcoll.AllGatherResult(torch.empty(2 * 64), torch.empty(2, 16 + 68, dtype=torch.uint8), 64, 8, 64,
                                  torch.float32), topo),
        "replica of a tensor": lambda: qcoll.replica_gather(torch.empty(world * 64), x),
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
              "rs chunks": "num_chunks", "rs topology": "topology", "rs hop bits": "pair",
              "rs inter bits": "bits[1] (inter-node)", "secondary from a tensor": "AllGatherResult",
              "secondary of a subgroup": "world group", "replica of a tensor": "secondary",
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
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": "4"}, preload=PRELOAD)
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


# ---------------------------------------------------------------- frame headers (docs/FORMAT.md "Frames")
def lowbias32(x):
    """The format's mix, written from docs/FORMAT.md with numpy uint32 arithmetic."""
    x = np.uint32(x)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return int(x)


def header_oracle(bits, block_size, numel, poisoned=False):
    """The 16 header bytes, field by field as the format document lists them."""
    prefix = bytes([0x71, 0x5A, 1, int(poisoned), bits, int(math.log2(block_size))]) + numel.to_bytes(6, "little")
    w0, w1, w2 = (int.from_bytes(prefix[i:i + 4], "little") for i in (0, 4, 8))
    check = lowbias32(lowbias32(lowbias32(w0) ^ w1) ^ w2)
    return prefix + check.to_bytes(4, "little")


@pytest.mark.parametrize("fields", [(8, 256, 1000), (4, 128, 0), (2, 4096, 2**48 - 1), (6, 32, 12345678901),
                                    (8, 64, 7, True)])
def test_header_bytes_follow_the_format(fields):
    h = framing.Header(*fields)
    raw = h.to_bytes()
    assert raw == header_oracle(*fields)
    assert framing.Header.from_bytes(raw) == h


def test_every_single_bit_flip_of_a_header_is_rejected():
    raw = framing.Header(8, 256, 1000).to_bytes()
    for byte in range(16):
        for bit in range(8):
            bad = bytearray(raw)
            bad[byte] ^= 1 << bit
            with pytest.raises(ValueError):
                framing.Header.from_bytes(bytes(bad))
    with pytest.raises(ValueError, match="magic"):
        framing.Header.from_bytes(bytes(16))
    with pytest.raises(ValueError, match="numel"):
        framing.Header(8, 256, 2**48).to_bytes()


def _receipt():
    return framing.Receipt("all_gather", 5, lambda i: 10 + i)


def test_frame_and_unframe_round_trip_and_name_the_disagreeing_sender():
    expected = framing.Header(8, 256, 1000)
    payload = torch.randint(0, 256, (3, 1040), dtype=torch.uint8)
    framed = framing.frame(payload, expected)
    assert framed.shape == (3, 1056)
    assert all(bytes(framed[i, :16].tolist()) == header_oracle(8, 256, 1000) for i in range(3))
    assert torch.equal(framing.unframe(framed, expected, _receipt), payload)

    other = framed.clone()
    other[2, :16] = torch.tensor(list(header_oracle(8, 256, 1024)), dtype=torch.uint8)  # same length, other numel
    with pytest.raises(qcoll.RankMismatchError) as info:
        framing.unframe(other, expected, _receipt)
    msg = str(info.value)
    assert "qcoll all_gather: rank 5 received from rank 12" in msg and "numel=1024 (rank 5 has 1000)" in msg
    assert info.value.peer == 12 and info.value.got.numel == 1024 and info.value.expected == expected

    shorter = framed.clone()
    shorter[1, :16] = torch.tensor(list(header_oracle(4, 256, 1000)), dtype=torch.uint8)
    shorter[0, :16] = torch.tensor(list(header_oracle(8, 256, 1000, poisoned=True)), dtype=torch.uint8)
    with pytest.raises(qcoll.RankMismatchError, match="rank 10 a frame marked poisoned.*2 of the 3"):
        framing.unframe(shorter, expected, _receipt)
    with pytest.raises(qcoll.RankMismatchError, match="bits=4 .rank 5 has 8.*544 bytes where rank 5 expects 1056"):
        framing.unframe(shorter[1:], expected, _receipt)

    garbage = framed.clone()
    garbage[0, 3] ^= 1
    with pytest.raises(qcoll.RankMismatchError, match="rank 10 a buffer that does not start with a valid qcoll frame"):
        framing.unframe(garbage, expected, _receipt)


def test_unquantized_receipt_detects_a_quantized_frame():
    raw = torch.randn(3, 300).view(torch.uint8)
    framing.check_unframed(raw, _receipt)            # plain data passes
    raw[1, :16] = torch.tensor(list(header_oracle(8, 256, 300)), dtype=torch.uint8)
    with pytest.raises(qcoll.RankMismatchError, match="bits=None.*rank 11 a quantized frame .bits=8"):
        framing.check_unframed(raw, _receipt)


def test_receipt_checks_leave_the_callers_storage_resizable():
    """ZeRO frees a gathered buffer by resizing its storage to 0; ``.numpy()`` on it would forbid that."""
    out = torch.randn(3, 300)
    framing.check_unframed(out.view(torch.uint8), _receipt)
    out.untyped_storage().resize_(0)


# ---------------------------------------------------------------- ranks that disagree, without QCOLL_DEBUG
# (arguments of ranks 0-2, arguments of rank 3): the frames have the same length, so the
# transport delivers them and only the header can tell that rank 3 disagrees.
GATHER_CASES = {
    "numel": ({"n": 1000, "bits": 8, "block": 256}, {"n": 1024, "bits": 8, "block": 256}),
    "block_size": ({"n": 544, "bits": 8, "block": 32}, {"n": 544, "bits": 8, "block": 64}),
    "bits": ({"n": 32, "bits": 8, "block": 32}, {"n": 32, "bits": 4, "block": 64}),
}
REDUCE_CASES = {
    "numel": ({"n": 1000, "bits": 4, "block": 128}, {"n": 1024, "bits": 4, "block": 128}),
    "block_size": ({"n": 288, "bits": 4, "block": 32}, {"n": 288, "bits": 4, "block": 64}),
    "bits": ({"n": 32, "bits": 4, "block": 32}, {"n": 32, "bits": 2, "block": 64}),
}
FIELD_KEY = {"numel": "n", "block_size": "block", "bits": "bits"}


def packed_len(n, bits, block):
    return math.ceil(n / block) * (block * bits // 8 + 4)


def field_text(case, theirs, mine, rank):
    key = FIELD_KEY[case]
    return f"{case}={theirs[key]} (rank {rank} has {mine[key]})"


def _outcome(call):
    """('mismatch' | 'transport' | 'returned', seconds, message or call's result)."""
    t0 = time.monotonic()
    try:
        result = call()
    except qcoll.RankMismatchError as e:
        return "mismatch", time.monotonic() - t0, str(e)
    except RuntimeError as e:
        return "transport", time.monotonic() - t0, "\n".join([str(e), *getattr(e, "__notes__", [])])
    return "returned", time.monotonic() - t0, result


def _still_in_step(rank, world):
    """A matching collective right after the failed one works (nothing was left in flight)."""
    out = torch.empty(world * 64)
    qcoll.all_gather_quantized(out, torch.full((64,), float(rank + 1)), bits=8, block_size=64)
    return bool(torch.allclose(out.view(world, 64)[:, 0], torch.arange(1.0, world + 1), rtol=1e-6))


def _gather_mismatch(rank, world, case, node_by_node):
    topo = qcoll.Topology(2)
    a = GATHER_CASES[case][rank == 3]
    x = torch.randn(a["n"], generator=torch.Generator().manual_seed(rank))
    out = torch.empty(world * a["n"])
    kind, seconds, msg = _outcome(lambda: qcoll.all_gather_quantized(out, x, bits=a["bits"], block_size=a["block"],
                                                                     topology=topo if node_by_node else None))
    return kind, seconds, msg if kind != "returned" else None, _still_in_step(rank, world)


@pytest.mark.parametrize("node_by_node", [False, True])
@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_all_gather_disagreeing_rank_raises_on_every_rank(ranks4, case, node_by_node):
    """Also gathered node by node: rank 3's frame reaches rank 0 through rank 1, and still names rank 3."""
    others, odd = GATHER_CASES[case]
    assert packed_len(**others) == packed_len(**odd)
    for rank, (kind, seconds, msg, in_step) in enumerate(ranks4.run(_gather_mismatch, case, node_by_node)):
        assert kind == "mismatch", (rank, kind, msg)
        peer, mine, theirs = (0, odd, others) if rank == 3 else (3, others, odd)
        assert f"qcoll all_gather: rank {rank} received from rank {peer} a frame with" in msg, msg
        assert field_text(case, theirs, mine, rank) in msg, msg
        assert in_step


def _replica_mismatch(rank, world, case):
    """Every rank fills two secondaries consistently; rank 3 then gathers the other one."""
    topo = qcoll.Topology(2)
    kept = []
    for a in GATHER_CASES[case]:
        fwd = torch.empty(world * a["n"])
        x = torch.randn(a["n"], generator=torch.Generator().manual_seed(rank))
        sec = qcoll.SecondaryShard.keep(qcoll.all_gather_quantized(fwd, x, bits=a["bits"], block_size=a["block"]),
                                        topo)
        kept.append((sec, fwd))
    sec, fwd = kept[rank == 3]
    out = torch.full_like(fwd, float("nan"))
    kind, seconds, msg = _outcome(lambda: qcoll.replica_gather(out, sec))
    return kind, seconds, msg if kind != "returned" else bool(torch.equal(out, fwd)), _still_in_step(rank, world)


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_replica_gather_disagreeing_rank_raises_on_its_node(ranks4, case):
    others, odd = GATHER_CASES[case]
    outcomes = ranks4.run(_replica_mismatch, case)
    for rank in (0, 1):  # node 0 received nothing from rank 3
        assert outcomes[rank][0] == "returned" and outcomes[rank][2] is True, outcomes[rank]
    for rank, peer, shard in ((2, 3, 2), (3, 2, 0)):  # local rank l keeps the shards of ranks 2l, 2l+1
        kind, seconds, msg, in_step = outcomes[rank]
        assert kind == "mismatch", (rank, kind, msg)
        mine, theirs = (odd, others) if rank == 3 else (others, odd)
        assert (f"qcoll replica_gather: rank {rank} received from rank {peer} (its hpZ copy of rank {shard}'s shard) "
                f"a frame with") in msg, msg
        assert field_text(case, theirs, mine, rank) in msg, msg
    assert all(o[3] for o in outcomes)


def _reduce_mismatch(rank, world, case, num_chunks):
    topo = qcoll.Topology(2)
    a = REDUCE_CASES[case][rank == 3]
    out = torch.empty(a["n"])
    x = torch.randn(world * a["n"], generator=torch.Generator().manual_seed(rank))

    def call():
        qcoll.reduce_scatter_quantized(out, x, bits=a["bits"], block_size=a["block"], topology=topo,
                                       num_chunks=num_chunks, async_op=True).wait()
    kind, seconds, msg = _outcome(call)
    return kind, seconds, msg if kind != "returned" else None, _still_in_step(rank, world)


@pytest.mark.parametrize("case", list(REDUCE_CASES))
def test_reduce_scatter_disagreeing_rank_raises_on_every_rank(ranks4, case):
    """Ranks 2 and 3 (node 1) exchange mismatching hop-1 frames; they pass poisoned hop-2
    frames to ranks 0 and 1, which raise at once instead of timing out."""
    others, odd = REDUCE_CASES[case]
    assert packed_len(**others) == packed_len(**odd)
    outcomes = ranks4.run(_reduce_mismatch, case, 1)
    for rank, peer in ((2, 3), (3, 2)):
        kind, seconds, msg, _ = outcomes[rank]
        assert kind == "mismatch", (rank, kind, msg)
        mine, theirs = (odd, others) if rank == 3 else (others, odd)
        assert f"qcoll reduce_scatter (intra-node hop): rank {rank} received from rank {peer} a frame with" in msg
        assert field_text(case, theirs, mine, rank) in msg, msg
    for rank, peer in ((0, 2), (1, 3)):
        kind, seconds, msg, _ = outcomes[rank]
        assert kind == "mismatch" and seconds < 10, (rank, kind, seconds, msg)
        assert (f"qcoll reduce_scatter (inter-node hop): rank {rank} received from rank {peer} a frame marked "
                f"poisoned") in msg, msg
    assert all(o[3] for o in outcomes)


def test_reduce_scatter_mismatch_in_a_later_chunk(ranks4):
    """S=1000 vs 1024 in two chunks: chunk 0 ([0, 512)) agrees, chunk 1 has 488 vs 512 elements."""
    outcomes = ranks4.run(_reduce_mismatch, "numel", 2)
    assert "numel=512 (rank 2 has 488)" in outcomes[2][2] and "numel=488 (rank 3 has 512)" in outcomes[3][2]
    assert all(o[0] == "mismatch" for o in outcomes) and all(o[3] for o in outcomes)


# (arguments of ranks 0-2, arguments of rank 3) giving frames of different lengths
SIZE_CASES = {
    "all_gather bits": ({"n": 1000, "bits": 8, "block": 256}, {"n": 1000, "bits": 4, "block": 256}),
    "all_gather bits=None": ({"n": 1000, "bits": 8, "block": 256}, {"n": 1000, "bits": None, "block": 256}),
    "replica_gather numel": ({"n": 1000, "bits": 8, "block": 256}, {"n": 2000, "bits": 8, "block": 256}),
    "reduce_scatter block_size": ({"n": 1000, "bits": 4, "block": 128}, {"n": 1000, "bits": 4, "block": 64}),
}
FRAGILE_TIMEOUT = 4


def _size_mismatch(rank, world, case):
    topo = qcoll.Topology(2)
    others, odd = SIZE_CASES[case]
    a = odd if rank == 3 else others
    n, bits, block = a["n"], a["bits"], a["block"]
    x = torch.randn(world * n, generator=torch.Generator().manual_seed(rank))
    if case.startswith("all_gather"):
        out = torch.empty(world * n)
        return _outcome(lambda: qcoll.all_gather_quantized(out, x[:n], bits=bits, block_size=block))
    if case.startswith("replica_gather"):
        kept = []
        for b in (others, odd):
            fwd = torch.empty(world * b["n"])
            sec = qcoll.SecondaryShard.keep(
                qcoll.all_gather_quantized(fwd, x[:b["n"]], bits=b["bits"], block_size=b["block"]), topo)
            kept.append((sec, fwd))
        sec, fwd = kept[rank == 3]
        out = torch.empty_like(fwd)
        return _outcome(lambda: torch.equal(qcoll.replica_gather(out, sec, async_op=True).wait(), fwd))
    out = torch.empty(n)
    return _outcome(lambda: qcoll.reduce_scatter_quantized(out, x, bits=bits, block_size=block, topology=topo))


@pytest.fixture(scope="module")
def fragile4():
    """Four ranks with a short group timeout, for runs in which gloo aborts a rank (it restarts)."""
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": str(FRAGILE_TIMEOUT)}, preload=PRELOAD)
    yield pool
    pool.close(graceful=False)


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_frames_of_different_lengths_end_in_errors_never_garbage(fragile4, case):
    """gloo aborts a process that receives more bytes than it posted; every other rank the
    disagreement reaches raises (the header's error, or the transport's with qcoll's note)
    within the group timeout. No rank returns decoded garbage."""
    try:
        outcomes, dead = dict(enumerate(fragile4.run(_size_mismatch, case, timeout=60))), {}
    except RankFailure as failure:
        assert failure.finished and not failure.errors, failure
        outcomes, dead = failure.results, failure.dead
    op = case.split()[0]
    involved = {2, 3} if op == "replica_gather" else {0, 1, 2, 3}
    for rank in sorted({0, 1, 2, 3} - involved):   # node 0 of the replica gather received nothing from rank 3
        assert outcomes[rank][0] == "returned" and outcomes[rank][2] is True, outcomes[rank]
    for rank in sorted(involved):
        if rank in dead:
            assert dead[rank] == -signal.SIGABRT, dead
            continue
        kind, seconds, msg = outcomes[rank]
        assert kind in ("mismatch", "transport"), (rank, kind, msg)
        assert seconds < FRAGILE_TIMEOUT + 3, (rank, seconds)
        assert f"qcoll {op}" in msg and f"rank {rank}" in msg, msg
        if kind == "transport":
            assert "failed in the transport" in msg, msg
    assert len(dead) < len(involved)


# ---------------------------------------------------------------- a destroyed process group
def _stale_topology(rank, world, port):
    old = qcoll.Topology(1)
    x = torch.randn(64)
    gathered = qcoll.all_gather_quantized(torch.empty(world * 64), x)
    sec = qcoll.SecondaryShard.keep(gathered, old)
    old_group = old.inter_group
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    calls = {
        "reduce_scatter": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64),
                                                                 topology=old),
        "current topology": lambda: qcoll.reduce_scatter_quantized(torch.empty(64), torch.randn(world * 64)),
        "replica_gather": lambda: qcoll.replica_gather(torch.empty(world * 64), sec),
        "SecondaryShard": lambda: qcoll.SecondaryShard.keep(gathered, old),
        "all_gather group": lambda: qcoll.all_gather_quantized(torch.empty(world * 64), x, group=old_group),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
            msgs[name] = None
        except Exception as e:
            msgs[name] = (type(e).__name__, str(e))
    out = torch.empty(64)  # what the message says to do works
    qcoll.reduce_scatter_quantized(out, torch.ones(world * 64), bits=8, topology=qcoll.Topology(1))
    msgs["new topology"] = float(out.min()), float(out.max())
    return msgs


def test_topology_of_a_destroyed_process_group_is_a_clear_error():
    pool = RankPool(2, env={"QCOLL_TEST_GROUP_TIMEOUT": "10"}, preload=PRELOAD)
    try:
        msgs = pool.run(_stale_topology, free_port(), timeout=60)[0]
    finally:
        pool.close()
    for name in ("reduce_scatter", "current topology", "replica_gather", "SecondaryShard"):
        kind, msg = msgs[name]
        assert kind == "RuntimeError" and "Topology(world=2" in msg and "destroy_process_group" in msg, (name, msgs)
        assert "build a new qcoll.Topology after init_process_group" in msg, msg
    kind, msg = msgs["all_gather group"]
    assert kind == "ValueError" and msg.startswith("group <") and "destroyed" in msg, msgs
    assert msgs["new topology"] == pytest.approx((2.0, 2.0), rel=1e-6)


# ---------------------------------------------------------------- a rank that rotates alone
def _rotation_mismatch(rank, world):
    topo = qcoll.Topology(2)
    x = torch.randn(world * 256, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(256)
    kind, seconds, msg = _outcome(lambda: qcoll.reduce_scatter_quantized(out, x, topology=topo,
                                                                         hadamard=rank == 3))
    return kind, msg, _still_in_step(rank, world)


def test_a_rank_rotating_alone_makes_every_rank_raise(ranks4):
    outcomes = ranks4.run(_rotation_mismatch, timeout=60)
    for rank, (kind, msg, in_step) in enumerate(outcomes):
        assert kind == "mismatch", (rank, kind, msg)
        assert in_step
    msg = outcomes[2][1]  # rank 3's node peer names the flag
    assert "rotated=True (rank 2 has False)" in msg and "hadamard" in msg, msg


def _topologies_share_groups(rank, world):
    a, b, c = qcoll.Topology(2), qcoll.Topology(2), qcoll.Topology(4)
    return (a.intra_group is b.intra_group and a.inter_group is b.inter_group,
            c.intra_group is not a.intra_group)


def test_topologies_of_one_layout_reuse_their_process_groups(ranks4):
    """A process group costs threads (gloo: three each); building the same layout again must not
    add groups (the test suite builds hundreds of topologies in one process)."""
    for same, other in ranks4.run(_topologies_share_groups, timeout=60):
        assert same and other
