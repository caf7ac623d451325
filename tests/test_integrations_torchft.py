"""qcoll inside torchft: QuantizedProcessGroup as the Manager's process group, two replica
groups (processes) and torchft's in-process lighthouse, on CPU/gloo.

Oracles: float64 numpy for the outer all-reduce; the same DiLoCo run on torchft's own
ProcessGroupGloo (unquantized) for training.
"""
import multiprocessing as mp
import os
import threading
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch

torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install 'qcoll[torchft]'")

from torchft._torchft import LighthouseServer  # noqa: E402

TIMEOUT_S = 120


def _manager(replica_id, lighthouse, pg, state, timeout=20):
    import torch.distributed as dist
    from torchft import Manager
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=lambda sd: state["load"](sd),
                      state_dict=lambda: state["save"](), replica_id=f"replica{replica_id}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      use_async_quorum=False, timeout=timedelta(seconds=timeout),
                      quorum_timeout=timedelta(seconds=30))
    return manager, store


def _pg(kind, timeout=20):
    from torchft.process_group import ProcessGroupGloo
    from qcoll.integrations.torchft import QuantizedProcessGroup
    if kind == "gloo":
        return ProcessGroupGloo(timeout=timedelta(seconds=timeout))
    bits, feedback = kind
    return QuantizedProcessGroup(bits=bits, error_feedback=feedback, timeout=timedelta(seconds=timeout))


def _allreduce(replica_id, lighthouse, kind):
    """Three outer all-reduces of seeded tensors through Manager.allreduce (an average)."""
    pg = _pg(kind)
    state = {"load": lambda sd: None, "save": lambda: {}}
    manager, _store = _manager(replica_id, lighthouse, pg, state)
    if kind != "gloo":
        pg.attach(manager)
    sent, got = [], []
    try:
        for step in range(3):
            manager.start_quorum()
            x = torch.randn(3000, generator=torch.Generator().manual_seed(10 * step + replica_id))
            sent.append(x.numpy().copy())
            manager.allreduce(x).wait()
            assert manager.should_commit(), manager.errored()
            got.append(x.numpy())
        counts = (pg.quantized_calls, dict(pg.passed), pg.resets, pg.residual_bytes) if kind != "gloo" else None
        return np.stack(sent), np.stack(got), counts
    finally:
        manager.shutdown(wait=False)


def _diloco(replica_id, lighthouse, kind, fragments, steps):
    """DiLoCo on a small MLP: AdamW inside, SGD Nesterov outside, H=4 (Streaming with 2 fragments)."""
    from torchft.local_sgd import DiLoCo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = [torch.optim.SGD(model.parameters() if fragments == 1 else f.parameters(), lr=0.7, momentum=0.9,
                             nesterov=True) for f in ([model] if fragments == 1 else [model[0], model[2]])]
    state = {"load": model.load_state_dict, "save": model.state_dict}
    pg = _pg(kind)
    manager, _store = _manager(replica_id, lighthouse, pg, state)
    if kind != "gloo":
        pg.attach(manager, fragments=fragments)
    gen = torch.Generator().manual_seed(100 + replica_id)
    target = torch.nn.Linear(32, 32)
    torch.nn.init.normal_(target.weight, generator=torch.Generator().manual_seed(5))
    frags = [model] if fragments == 1 else [model[0], model[2]]
    try:
        with DiLoCo(manager, frags, inner, outer if fragments > 1 else outer[0], sync_every=4,
                    fragment_sync_delay=1 if fragments > 1 else 0) as diloco:
            for _ in range(steps):
                x = torch.randn(16, 32, generator=gen)
                loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
                inner.zero_grad()
                loss.backward()
                inner.step()
        # the global parameters (each fragment's anchor): what every replica must agree on
        anchors = {f"{i}.{k}": v.numpy().copy() for i, f in enumerate(diloco._fragments)
                   for k, v in f.original_parameters.items()}
        return anchors, manager.current_step()
    finally:
        manager.shutdown(wait=False)


def _child(fn, args, out):
    try:
        out.put(("ok", fn(*args)))
    except BaseException:
        out.put(("error", traceback.format_exc()))
    out.close()
    out.join_thread()   # the result reaches the pipe before the process ends
    os._exit(0)         # (no wait for torchft's manager threads)


def _run_replicas(fn, *args):
    """``fn(replica_id, lighthouse_address, *args)`` on two replica processes."""
    return _spawn([(fn, args, True), (fn, args, True)])


def _spawn(jobs, **lighthouse):
    """One process per ``(fn, args, reports)``: ``fn(index, lighthouse_address, *args)``; returns the
    results of those that report (the others may die), every process joined or killed."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, **lighthouse)
    ctx = mp.get_context("spawn")
    out = [ctx.Queue() for _ in jobs]
    procs = [ctx.Process(target=_child, args=(fn, (r, lighthouse.address()) + args, out[r]))
             for r, (fn, args, _) in enumerate(jobs)]
    try:
        for p in procs:
            p.start()
        results = []
        for r, (_, _, reports) in enumerate(jobs):
            if reports:
                status, value = out[r].get(timeout=TIMEOUT_S)
                assert status == "ok", f"replica {r}:\n{value}"
                results.append(value)
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


@pytest.mark.parametrize("bits", [pytest.param(8, marks=pytest.mark.long), 2])   # 8 bits: the DiLoCo test below
def test_the_managers_all_reduce_is_qcolls_quantized_average(bits):
    results = _run_replicas(_allreduce, (bits, True))
    sent = np.stack([r[0] for r in results]).astype(np.float64)   # [replica, step, n]
    exact = sent.mean(0)
    assert np.array_equal(results[0][1], results[1][1])            # both replicas, the same values
    # 2 bits is 3 levels (-1, 0, 1) x the block's absmax: each stage may round by half of it,
    # on values with the last call's residual added
    bound = {8: 0.02, 2: 2.5}[bits] * np.abs(sent).max()
    assert np.abs(results[0][1] - exact).max() <= bound
    calls, passed, resets, residual = results[0][2]
    assert calls == 3 and resets >= 1
    assert residual == (2 * 1500 + 1500) * 4                        # one slot: (g + 1) * S fp32
    if bits == 2:   # with error feedback, three calls' results sum to the exact sums within one call's error
        one = np.abs(results[0][1][-1] - exact[-1]).max()
        assert np.abs(results[0][1].sum(0) - exact.sum(0)).max() <= 3 * one


def test_quantization_off_passes_through_and_is_counted():
    results = _run_replicas(_allreduce, (None, False))
    sent = np.stack([r[0] for r in results]).astype(np.float64)
    assert np.allclose(results[0][1], sent.mean(0), atol=1e-6)
    calls, passed, _, residual = results[0][2]
    assert calls == 0 and passed["allreduce"] == 3 and residual == 0


def test_diloco_with_qcolls_8_bit_outer_sync_tracks_torchfts_own():
    plain = _run_replicas(_diloco, "gloo", 1, 12)
    quant = _run_replicas(_diloco, (8, True), 1, 12)
    for run in (plain, quant):
        assert run[0][1] == run[1][1] == 3                       # three outer steps committed
        for k in run[0][0]:
            assert np.array_equal(run[0][0][k], run[1][0][k])     # the replicas agree exactly
    for k, ref in plain[0][0].items():
        assert np.abs(quant[0][0][k] - ref).max() <= 0.02 * np.abs(ref).max(), k


def test_streaming_diloco_with_2_bit_feedback_commits_every_fragment():
    run = _run_replicas(_diloco, (2, True), 2, 12)
    assert run[0][1] == run[1][1] == 6                           # 2 fragments, every 2 steps
    for k in run[0][0]:
        assert np.array_equal(run[0][0][k], run[1][0][k])
        assert np.isfinite(run[0][0][k]).all()


def test_arguments_are_checked():
    from torchft.process_group import ProcessGroupDummy
    from qcoll.integrations.torchft import QuantizedProcessGroup
    with pytest.raises(ValueError, match="bits must be 8, 4, 2 or None, got 6"):
        QuantizedProcessGroup(bits=6)
    with pytest.raises(TypeError, match="ProcessGroupWrapper"):
        QuantizedProcessGroup(pg=ProcessGroupDummy(0, 1))
    with pytest.raises(TypeError, match="torchft Manager"):
        QuantizedProcessGroup().attach(object())


class _Steps:
    """What QuantizedProcessGroup reads of a torchft Manager: its step."""

    def __init__(self):
        self.step = 0

    def current_step(self):
        return self.step


def test_a_new_quorum_forgets_every_residual_and_a_wrong_fragment_count_is_named():
    import torch.distributed as dist
    from qcoll.integrations.torchft import QuantizedProcessGroup
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = QuantizedProcessGroup(bits=2)
    pg.configure(f"localhost:{store.port}/q1", "r0", 0, 1)
    steps = _Steps()
    pg.attach(steps, fragments=2)
    pg.size = lambda: 2            # the residual slots as two replicas would key them (no peer needed)
    a = pg._slot(torch.zeros(100))
    a.bind(100, 2, torch.device("cpu"))
    a.send.fill_(1.0)
    assert pg._slot(torch.zeros(50)) is not a and pg._slot(torch.zeros(7)) is not a   # positions 1, 2
    steps.step = 2                 # the same fragment (step % 2), its first all-reduce: the same residual
    assert pg._slot(torch.zeros(100)) is a
    steps.step = 4
    with pytest.raises(ValueError, match=r"all-reduce 0 of fragment 0 reduces 99 elements over 2 replicas, but its "
                                         r"residual was kept for 100 over 2: pass attach\(manager, fragments=\)"):
        pg._slot(torch.zeros(99))
    pg.configure(f"localhost:{store.port}/q2", "r0", 0, 1)   # a new quorum
    assert pg.resets == 2 and pg.residual_bytes == 0
    assert pg._slot(torch.zeros(100)) is not a
    pg.shutdown()


def test_torchfts_own_quantization_through_the_group_is_refused():
    """torchft's should_quantize=True (FP8 through triton) reaches the group as an all-to-all from
    torchft.collectives: refused by name, never quantized twice."""
    from qcoll.integrations.torchft import QuantizedProcessGroup
    pg = QuantizedProcessGroup(bits=4)
    caller = {"__name__": "torchft.collectives", "pg": pg, "torch": torch}
    with pytest.raises(ValueError, match="should_quantize=True"):
        exec("pg.alltoall_base(torch.empty(4), torch.empty(4), [], [], None)", caller)


# ---------------------------------------------------------------- a replica lost in the middle of an outer sync

def _member(replica_id, lighthouse):
    """A 2-bit QuantizedProcessGroup with error feedback (timeout 5 s) and its Manager (10 s)."""
    pg = _pg((2, True), timeout=5)
    manager, store = _manager(replica_id, lighthouse, pg, {"load": lambda sd: None, "save": lambda: {}}, timeout=10)
    return pg.attach(manager), manager, store


def _survivor(replica_id, lighthouse, issued, left):
    """Step 0 with replica 1; step 1's all-reduce is in flight when replica 1 goes; then step 1
    again with replica 2, which joins the new quorum."""
    pg, manager, _store = _member(replica_id, lighthouse)
    try:
        manager.start_quorum()
        manager.allreduce(torch.randn(3000, generator=torch.Generator().manual_seed(1))).wait()
        assert manager.should_commit() and pg.residual_bytes > 0
        manager.start_quorum()
        work = manager.allreduce(torch.randn(3000, generator=torch.Generator().manual_seed(2)))
        issued.set()
        t0 = time.monotonic()
        work.wait()
        seconds = time.monotonic() - t0
        failed = (str(manager.errored()), str(pg.errored()), pg.residual_bytes, manager.should_commit())
        left.set()               # replica 2 may join (and replica 1, if alive, end)
        manager.start_quorum()   # the new quorum: replica 2 joins
        x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
        sent = x.clone()
        manager.allreduce(x).wait()
        assert manager.should_commit(), manager.errored()
        slot = pg._slots[(0, 0)]
        return seconds, failed, (pg.resets, slot.calls, pg.residual_bytes), sent.numpy(), x.numpy()
    finally:
        manager.shutdown(wait=False)


def _leaver(replica_id, lighthouse, issued, left, how):
    """Step 0, then goes while the survivor's step-1 all-reduce is in flight: the process exits,
    or its manager shuts down (the process, and its gloo group, stay)."""
    pg, manager, _store = _member(replica_id, lighthouse)
    manager.start_quorum()
    manager.allreduce(torch.randn(3000, generator=torch.Generator().manual_seed(11))).wait()
    assert manager.should_commit()
    manager.start_quorum()
    assert issued.wait(60)
    time.sleep(0.5)                 # the survivor's all-to-all is on the wire, waiting for this replica
    if how == "exit":
        os._exit(0)
    manager.shutdown(wait=False)
    assert left.wait(60)


def _joiner(replica_id, lighthouse, issued, left):
    """Joins once the survivor's step 1 has failed: heals to step 1 and syncs it."""
    assert left.wait(60)
    pg, manager, _store = _member(replica_id, lighthouse)
    try:
        manager.start_quorum()
        x = torch.randn(3000, generator=torch.Generator().manual_seed(23))
        sent = x.clone()
        manager.allreduce(x).wait()
        assert manager.should_commit(), manager.errored()
        return manager.current_step(), pg.resets, sent.numpy(), x.numpy()
    finally:
        manager.shutdown(wait=False)


@pytest.mark.parametrize("how", ["exit", "shutdown"])
def test_a_replica_lost_mid_sync_fails_the_step_by_name_and_a_joiner_starts_clean(how):
    ctx = mp.get_context("spawn")
    issued, left = ctx.Event(), ctx.Event()
    survivor, joiner = _spawn([(_survivor, (issued, left), True), (_leaver, (issued, left, how), False),
                               (_joiner, (issued, left), True)], join_timeout_ms=200, heartbeat_timeout_ms=1000)
    seconds, (manager_error, pg_error, residual, committed), (resets, calls, kept), sent, got = survivor
    # no hang: the survivor's wait ends within the manager's timeout (10 s; the group's is 5 s)
    assert seconds < 10, seconds
    # the step is not committed, and the error names the sync and its cause
    assert not committed
    assert "the outer all-reduce 0 of fragment 0, step 1 failed: " in manager_error, manager_error
    assert "the outer all-reduce 0 of fragment 0, step 1 failed: " in pg_error, pg_error
    assert residual == 0                         # the failed sync's residuals are not kept
    # the new quorum: configured again, one fresh residual slot on each side, the same values on both
    step, joiner_resets, joiner_sent, joiner_got = joiner
    assert step == 2 and resets == 2 and joiner_resets == 1
    assert calls == 1 and kept == (2 * 1500 + 1500) * 4
    assert np.array_equal(got, joiner_got)
    exact = (sent.astype(np.float64) + joiner_sent) / 2
    assert np.abs(got - exact).max() <= 2.5 * max(np.abs(sent).max(), np.abs(joiner_sent).max())


class _Stuck:
    """qcoll.all_reduce_quantized as the worker sees it: the send residual is updated, a tensor
    marked -1 waits on the wire until ``gate`` opens, then the own residual (as the real one, in
    place) and the tensor are written, or ``fail`` is raised."""

    def __init__(self):
        self.gate, self.started, self.ended = threading.Event(), threading.Event(), threading.Semaphore(0)
        self.fail = None

    def __call__(self, t, bits, block_size, group, op, error_feedback):
        error_feedback.bind(t.numel(), 2, t.device)
        error_feedback.calls += 1
        error_feedback.send.add_(1.0)
        self.started.set()
        try:
            if t[0] == -1:
                assert self.gate.wait(30)
            if self.fail is not None:
                raise self.fail
            error_feedback.own.add_(1.0)
            t.fill_(1.0)
        finally:
            self.ended.release()


def _quorum(monkeypatch, timeout_s=5):
    """A QuantizedProcessGroup configured alone, keyed as two replicas would be, over a _Stuck all-reduce."""
    import torch.distributed as dist
    import qcoll.integrations.torchft as qtf
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = qtf.QuantizedProcessGroup(bits=2, timeout=timedelta(seconds=timeout_s))
    pg.configure(f"localhost:{store.port}/q1", "r0", 0, 1)
    steps = _Steps()
    pg.attach(steps, fragments=2)
    pg.size = lambda: 2
    stuck = _Stuck()
    monkeypatch.setattr(qtf, "all_reduce_quantized", stuck)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return pg, steps, stuck, opts, store


def test_a_stuck_outer_all_reduce_times_out_by_name_and_its_late_writes_miss_the_next_quorum(monkeypatch):
    pg, steps, stuck, opts, store = _quorum(monkeypatch, timeout_s=5)
    steps.step = 5
    work = pg.allreduce([torch.full((100,), -1.0)], opts)   # fragment 1, on the wire, never answered
    assert stuck.started.wait(10)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the outer all-reduce 0 of fragment 1, step 5 failed: it did not "
                                           r"finish within 0:00:00.300000"):
        work.wait(timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 3
    assert "fragment 1, step 5" in str(pg.errored()) and pg.residual_bytes == 0
    with pytest.raises(RuntimeError, match=r"allreduce was not run: this quorum already failed \(the outer "
                                           r"all-reduce 0 of fragment 1, step 5 failed"):
        pg.allreduce([torch.zeros(100)], opts)
    with pytest.raises(RuntimeError, match="barrier was not run: this quorum already failed"):
        pg.barrier(None)
    t0 = time.monotonic()
    pg.configure(f"localhost:{store.port}/q2", "r0", 0, 1)   # not held up by the job still on the wire
    assert time.monotonic() - t0 < 3 and pg.errored() is None and pg.resets == 2
    steps.step = 7                                           # fragment 1 again, in the new quorum:
    assert pg.allreduce([torch.zeros(100)], opts).wait()     # not queued behind the stale job
    stuck.gate.set()                                         # which ends now, writing its residuals
    assert stuck.ended.acquire(timeout=10) and stuck.ended.acquire(timeout=10)
    slot = pg._slots[(1, 0)]
    assert list(pg._slots) == [(1, 0)] and slot.calls == 1
    assert torch.equal(slot.send, torch.ones(100)) and torch.equal(slot.own, torch.ones(50))   # none of the stale job's
    pg.shutdown()


def test_a_failed_outer_all_reduce_fails_those_queued_behind_it_and_abort_reaches_the_one_in_flight(monkeypatch):
    pg, steps, stuck, opts, store = _quorum(monkeypatch)
    steps.step = 3
    first = pg.allreduce([torch.full((10,), -1.0)], opts)
    second = pg.allreduce([torch.zeros(10)], opts)             # queued behind the first
    stuck.fail = RuntimeError("Connection closed by peer")
    stuck.gate.set()
    with pytest.raises(RuntimeError, match=r"the outer all-reduce 0 of fragment 1, step 3 failed: RuntimeError: "
                                           r"Connection closed by peer") as failed:
        first.wait()
    assert isinstance(failed.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match=r"the outer all-reduce 1 of fragment 1, step 3 failed: it was queued or "
                                           r"in flight when this quorum failed \(the outer all-reduce 0 of"):
        second.wait()
    assert pg.errored() is failed.value and pg.residual_bytes == 0
    # abort: the in-flight one fails at once, and configure rebuilds the group
    pg.configure(f"localhost:{store.port}/q2", "r0", 0, 1)
    stuck.gate.clear()
    stuck.started.clear()
    stuck.fail = None
    work = pg.allreduce([torch.full((10,), -1.0)], opts)
    assert stuck.started.wait(10)
    pg.abort()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the outer all-reduce 0 of fragment 1, step 3 failed: it was queued or "
                                           r"in flight when this quorum failed \(the process group was aborted"):
        work.wait()
    assert time.monotonic() - t0 < 1 and "aborted" in str(pg.errored())
    stuck.gate.set()
    pg.configure(f"localhost:{store.port}/q3", "r0", 0, 1)
    assert pg.errored() is None and pg.parent.size() == 1
    pg.shutdown()
