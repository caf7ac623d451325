"""Faults in the newer parts, on 4 gloo ranks as 2 nodes x 2: a rank SIGKILLed, or one rank passing
other arguments, in the FSDP2 path with qcoll's comms (1-D mesh over the world, HSDP's 2-D mesh and
its quantized all-reduce across nodes), AutoTune's decision broadcast and ``qcoll.zero.reconfigure``.

What must hold: every rank left after a SIGKILL ends with an exception (not a hang, not a result)
within the group's timeout, and the killed run leaves no process behind; ranks that disagree on an
argument raise, naming it or the ranks, and none returns a result the others did not compute.
AutoTune and ``reconfigure`` compare their arguments through the store: every rank raises a
ValueError naming them.
Each rank catches its own exception and returns ``(outcome, seconds, type, message, frames)``
(:func:`_outcome`), so a rank that returned is told from one that raised. A SIGKILL breaks the
process group, so each of those runs gets 4 fresh ranks (:func:`run_in_fresh_pools`, all at once,
so that the survivors' waits overlap). The pools' group timeout is short (:data:`GROUP_TIMEOUT_S`).
"""
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import qcoll
from distributed import RankFailure, RankPool
from qcoll import zero
from qcoll.comm import reduce_scatter
from qcoll.fsdp import quantize_comm
from qcoll.fsdp.hybrid import QuantizedAllReduceHook
from qcoll.testing import Batches, corpus, tiny_model
from qcoll.testing.fsdp2 import mesh_for, shard_fsdp2
from qcoll.testing.models import TINY, char_transformer
from qcoll.tune import AutoTune, Knob, Space
from qcoll.zero.reconfigure import with_knobs

GROUP_TIMEOUT_S = 20     # the pools' group timeout: a survivor waiting for a rank that is gone gives up after it
LIMIT_S = 60             # a survivor's error comes within this
TRANSPORT = ("RuntimeError", "DistBackendError", "DistNetworkError")   # gloo's errors (a peer gone, a timeout)
SPACE = Space([Knob("weight_bits", (8, 4)), Knob("grad_bits", (4, 8))])
# the fresh pools' workers are forked from a server that imported these once (seconds of CPU each otherwise)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "qcoll", "qcoll.fsdp", "qcoll.tune", "qcoll.zero",
           "qcoll.testing", "qcoll.testing.fsdp2", "distributed", __name__)


# ---------------------------------------------------------------- helpers (run on the ranks)
def _outcome(call):
    """``("raised", seconds, type, message and notes, function names of the traceback)`` or
    ``("returned", seconds, None, value, [])``."""
    t0 = time.monotonic()
    try:
        value = call()
    except Exception as e:
        notes = "".join("\n" + n for n in getattr(e, "__notes__", []))
        frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
        return ("raised", time.monotonic() - t0, type(e).__name__, f"{e}{notes}", frames)
    return ("returned", time.monotonic() - t0, None, value, [])


def _die():
    """SIGKILL this rank: nothing runs after it (no exception, no exit handler, no goodbye on the sockets)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)   # (not reached)


def _pid(rank, world):
    return os.getpid()


def _param_groups(model):
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]


def _fsdp2_model(hsdp: bool, layers: int = TINY.n_layers):
    """The char transformer under FSDP2 as :mod:`qcoll.testing.fsdp2` shards it (hpZ's
    ``reshard_after_forward=2`` on the 1-D mesh), its mesh's groups on the pool's group timeout:
    torch makes a DeviceMesh's groups with its own default (30 minutes for gloo), whatever
    ``init_process_group`` was given, and FSDP2's own collectives (HSDP's inside the node) run
    there: without this a survivor waits for a dead rank's node-mate for 30 minutes."""
    model = char_transformer(dataclasses.replace(TINY, n_layers=layers), 0)
    mesh = mesh_for(hsdp, 2)     # (its groups on the default group's timeout: mesh_for sees to it)
    return shard_fsdp2(model, model.blocks, mesh, reshard_after_forward=None if hsdp else 2)


def _fsdp_step(model, opt, batches, rank, world):
    x, y = batches.next(rank, world)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def _zero_model():
    model = tiny_model(0)
    return zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(), units=model.units())


def _zero_step(m, opt, batches, rank, world, auto=None):
    x, y = batches.next(rank, world)
    m(x, y).backward()
    opt.step()
    if auto is not None:
        auto.update()
    opt.zero_grad()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not been reaped (a zombie counts: it was not waited for)."""
    return os.path.exists(f"/proc/{pid}")


class Run:
    """One case on fresh ranks: ``outcomes`` by rank (:func:`_outcome`'s), ``dead`` (exit codes of the
    ranks whose process died), ``errors`` (tracebacks that escaped the case), ``finished`` (False: the
    pool's timeout stopped it, a hang), the workers' ``pids``, the case's ``seconds``."""

    def __init__(self, outcomes, dead, errors, finished, pids, seconds):
        self.outcomes, self.dead, self.errors, self.finished = outcomes, dead, errors, finished
        self.pids, self.seconds = pids, seconds

    def __repr__(self):
        brief = {r: o[:3] + (str(o[3])[:300],) for r, o in self.outcomes.items()}
        return (f"Run(finished={self.finished}, dead={self.dead}, {self.seconds:.1f} s, errors={self.errors}, "
                f"outcomes={brief})")


def run_in_fresh_pools(jobs: dict, timeout: float = 150.0) -> dict:
    """``{name: (fn, *args)}``: each on 4 new ranks with the short group timeout, all at the same time;
    returns ``{name: Run}`` (or the exception that stopped that run). Every pool is closed, its
    workers killed and reaped, before this returns."""
    results = {}

    def one(name, fn, *args):
        pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": str(GROUP_TIMEOUT_S)}, preload=PRELOAD)
        try:
            pids = pool.run(_pid, timeout=300)        # started: the start is not part of the case
            t0 = time.monotonic()
            try:
                outcomes = dict(enumerate(pool.run(fn, *args, timeout=timeout)))
                results[name] = Run(outcomes, {}, {}, True, pids, time.monotonic() - t0)
            except RankFailure as f:
                results[name] = Run(f.results, f.dead, f.errors, f.finished, pids, time.monotonic() - t0)
        except BaseException as e:  # reported by the test of that case
            results[name] = e
        finally:
            pool.close(graceful=False)

    threads = [threading.Thread(target=one, args=(name, *job), daemon=True) for name, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _get(runs, case) -> Run:
    run = runs[case]
    if isinstance(run, BaseException):
        raise run
    return run


# ---------------------------------------------------------------- a rank SIGKILLed
def _killed(rank, world, case, victim):
    """A whole step on every rank, then ``victim`` dies at the case's point and the others go on."""
    topo = qcoll.Topology(2)
    batches = Batches(corpus(), 8, 32)
    if case in ("fsdp", "fsdp between qgZ hops", "hsdp"):
        model = _fsdp2_model(hsdp=case == "hsdp", layers=4 if case == "fsdp between qgZ hops" else TINY.n_layers)
        # between the hops: each reduction complete before the next module's backward (overlapped, the
        # failure surfaces at the end of the backward instead, as in case "fsdp")
        quantize_comm(model, topo, overlap_comm=case != "fsdp between qgZ hops")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _fsdp_step(model, opt, batches, rank, world)
        x, y = batches.next(rank, world)
        if case == "fsdp":
            loss = model(x, y)
            if rank == victim:
                _die()    # after the forward: the others go on into backward's hpZ gather and qgZ reduce-scatter
            return _outcome(lambda: (loss.backward(), opt.step()))
        if case == "fsdp between qgZ hops" and rank == victim:
            # in backward, after the node's hop of the last block's qgZ, before the hop across nodes: its
            # partner across nodes fails; that rank's node-mate goes on into the next hpZ gather with it
            plain = reduce_scatter.all_to_all_frames
            reduce_scatter.all_to_all_frames = lambda frames, group, peers: (
                _die() if group is topo.inter_group else plain(frames, group, peers))
        if case == "hsdp" and rank == victim:   # in backward, before its first quantized all-reduce across nodes
            for g in _param_groups(model):
                assert isinstance(g._all_reduce_hook, QuantizedAllReduceHook)
                g._all_reduce_hook = lambda output: _die()
        return _outcome(lambda: (model(x, y).backward(), opt.step()))
    m = _zero_model()
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
    if case == "autotune":
        auto = AutoTune(m, space=SPACE, window=1, explore=4, abort=100.0, weight_error=10.0, grad_error=10.0)
        if rank == victim:
            auto._send = lambda *a: _die()   # rank 0, as it broadcasts its first decision (the others wait for it)
        return _outcome(lambda: [_zero_step(m, opt, batches, rank, world, auto) for _ in range(3)])
    assert case == "reconfigure"
    _zero_step(m, opt, batches, rank, world)
    zero.reconfigure(m, zero.ZeroConfig(weight_bits=4, grad_bits=8))
    if rank == victim:
        _die()       # between steps, after switching: the others' next step runs the new wire format
    return _outcome(lambda: _zero_step(m, opt, batches, rank, world))


KILL_CASES = {   # case: (victim, a function every survivor's traceback passes through)
    "fsdp": (3, "backward"),
    "fsdp between qgZ hops": (3, "backward"),
    "hsdp": (2, "backward"),
    "autotune": (0, "_send"),                 # rank 0 is the one that decides (and hosts the store)
    "reconfigure": (1, "_zero_step"),
}


@pytest.fixture(scope="module")
def fresh_runs():
    """Every case that needs ranks of its own (a SIGKILL, or a mismatch that breaks the group), at once."""
    jobs = {("killed", case): (_killed, case, victim) for case, (victim, _) in KILL_CASES.items()}
    jobs.update({("other", case): (fn, odd, changed) for case, (fn, odd, changed, _) in OTHER_ARGUMENTS.items()})
    yield run_in_fresh_pools(jobs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILL_CASES))
def test_a_sigkilled_rank_ends_every_survivor_in_an_error(fresh_runs, case):
    """Every survivor raises (gloo's error: the peer gone, or the group's timeout) within LIMIT_S; none
    hangs, none returns; the victim alone died; no process of the run is left."""
    run = _get(fresh_runs, ("killed", case))
    victim, through = KILL_CASES[case]
    assert run.finished, f"survivors hung: {run}"
    assert run.dead == {victim: -signal.SIGKILL}, run
    assert not run.errors, run                      # each survivor's exception was the case's own
    assert sorted(run.outcomes) == sorted({0, 1, 2, 3} - {victim}), run
    for rank, (kind, seconds, name, message, frames) in run.outcomes.items():
        assert kind == "raised", f"rank {rank} returned after rank {victim} was killed: {run}"
        assert name in TRANSPORT, (rank, name, message)
        assert seconds < LIMIT_S, (rank, seconds, message)
        assert through in frames, (rank, frames)
    if case == "hsdp":   # the dead rank's replica was in the quantized all-reduce with it
        assert "all_reduce_quantized" in run.outcomes[0][4], run.outcomes[0]
    if case == "fsdp between qgZ hops":   # rank 0 waited in hpZ's gather inside the node for rank 1, which had failed
        assert "all_gather_quantized" in run.outcomes[0][4], run.outcomes[0]
    assert not [pid for pid in run.pids if _running(pid)], run.pids


# ---------------------------------------------------------------- one rank with other arguments
def _quantize_comm_other(rank, world, hsdp, name, odd):
    model = _fsdp2_model(hsdp)
    topo = qcoll.Topology(2)
    value = {"weight_bits": (8, 4), "grad_bits": (4, 8)}[name][rank == odd]
    return _outcome(lambda: quantize_comm(model, topo, **{name: value}))


@pytest.fixture(scope="module")
def pool4():
    """Four ranks with the short group timeout, for the cases that do not break their group (and
    the last one, which does)."""
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": str(GROUP_TIMEOUT_S)}, preload=PRELOAD)
    yield pool
    pool.close(graceful=False)


@pytest.mark.parametrize("hsdp,name,odd", [(False, "weight_bits", 3), (True, "grad_bits", 1)])
def test_quantize_comm_with_other_bits_on_one_rank_raises_on_every_rank(pool4, hsdp, name, odd):
    """Before any collective: a ValueError on every rank naming the odd rank and both values."""
    outcomes = pool4.run(_quantize_comm_other, hsdp, name, odd, timeout=120)
    values = {"weight_bits": (8, 4), "grad_bits": (4, 8)}[name]
    for rank, (kind, seconds, error, message, _) in enumerate(outcomes):
        assert (kind, error) == ("raised", "ValueError"), (rank, outcomes[rank])
        assert f"[{odd}]" in message or f"rank {odd}" in message, message
        assert f"{name}={values[0]}" in message and f"{name}={values[1]}" in message, message
        assert seconds < LIMIT_S


def _all_reduce_other(rank, world, equal_frames):
    """HSDP's all-reduce across nodes (replicas: ranks 0-2 and 1-3); rank 3 at 8 bits, the others at 4.
    ``equal_frames``: rank 3's tensor and block are halved, so that its frames are as long as rank 1's
    and only their headers tell them apart."""
    topo = qcoll.Topology(2)
    n, bits, block = (2048, 4, 128) if rank != 3 else ((1024, 8, 64) if equal_frames else (2048, 8, 128))
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    return x.clone(), _outcome(lambda: qcoll.all_reduce_quantized(x, bits, block, group=topo.inter_group, op="avg")
                               or x)


def _check_agreeing_pair(results):
    """Ranks 0 and 2 passed the same arguments: both end with the same values, their mean within
    the 4-bit codec's error."""
    (x0, (k0, _, _, y0, _)), (x2, (k2, _, _, y2, _)) = results[0], results[2]
    assert k0 == k2 == "returned", (results[0][1], results[2][1])
    assert torch.equal(y0, y2)
    mean = (x0 + x2) / 2
    assert 0 < (y0 - mean).norm() < 0.2 * mean.norm()


def test_all_reduce_with_other_bits_on_one_replica_is_a_mismatch_on_both(pool4):
    """Frames of equal length: the headers differ, so both ranks of the pair raise RankMismatchError
    naming the other rank and its bits; nothing is decoded. The other pair is unaffected."""
    results = pool4.run(_all_reduce_other, True, timeout=120)
    _check_agreeing_pair(results)
    for rank, other in ((1, 3), (3, 1)):
        kind, seconds, error, message, _ = results[rank][1]
        assert (kind, error) == ("raised", "RankMismatchError"), (rank, results[rank][1])
        assert f"from rank {other}" in message and "bits=8" in message and "bits=4" in message, message
        assert seconds < LIMIT_S


def test_all_reduce_with_other_bits_and_frame_lengths_never_returns_garbage(pool4):
    """Frames of other lengths: gloo aborts the rank that receives more bytes than it posted; the other
    rank of the pair raises (the header's mismatch, or the transport's error). Neither returns.
    (Last in this file's pool: it may lose a rank.)"""
    try:
        results, dead = pool4.run(_all_reduce_other, False, timeout=120), {}
    except RankFailure as failure:
        assert failure.finished and not failure.errors, failure
        results, dead = failure.results, failure.dead
    _check_agreeing_pair(results)
    assert len(dead) < 2 and set(dead) <= {1, 3} and all(code == -signal.SIGABRT for code in dead.values()), dead
    for rank in {1, 3} - set(dead):
        kind, seconds, error, message, _ = results[rank][1]
        assert kind == "raised" and error in ("RankMismatchError", *TRANSPORT), (rank, results[rank][1])
        assert seconds < LIMIT_S


# ---------------------------------------------------------------- AutoTune and reconfigure, other arguments
def _autotune_other(rank, world, odd, settings):
    """AutoTune over SPACE on every rank, with ``settings`` changed on ``odd``; 6 steps. Returns the
    (weight_bits, grad_bits) each step ran."""
    m = _zero_model()
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
    kwargs = dict(space=SPACE, window=1, explore=4, abort=100.0, weight_error=10.0, grad_error=10.0)
    if rank == odd:
        kwargs.update(settings)
    batches, ran = Batches(corpus(), 8, 32), []

    def run():
        auto = AutoTune(m, **kwargs)
        for _ in range(6):
            ran.append((auto.config.weight_bits, auto.config.grad_bits))
            _zero_step(m, opt, batches, rank, world, auto)
        return ran
    return _outcome(run)


def _reconfigure_other(rank, world, odd, knobs):
    """A step, then every rank reconfigures, ``odd`` with ``knobs`` changed; 2 more steps."""
    m = _zero_model()
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
    batches = Batches(corpus(), 8, 32)
    _zero_step(m, opt, batches, rank, world)
    config = zero.state_of(m).config
    config = with_knobs(config, **knobs) if rank == odd else config

    def run():
        zero.reconfigure(m, config)
        for _ in range(2):
            _zero_step(m, opt, batches, rank, world)
        return sorted(knobs)
    return _outcome(run)


OTHER_ARGUMENTS = {   # case: (function, odd rank, what differs on it, the argument an error should name)
    "autotune space": (_autotune_other, 2,
                       {"space": Space([Knob("weight_bits", (8, 4)), Knob("grad_bits", (4, None))])}, "space"),
    "autotune tuner": (_autotune_other, 1, {"tuner": "random"}, "tuner"),
    "autotune window": (_autotune_other, 3, {"window": 2}, "window"),
    "reconfigure grad_bits": (_reconfigure_other, 3, {"grad_bits": 8}, "grad_bits"),
    "reconfigure hpz": (_reconfigure_other, 3, {"hpz": False}, "hpz"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OTHER_ARGUMENTS))
def test_autotune_and_reconfigure_with_other_arguments_never_hang_or_diverge_silently(fresh_runs, case):
    """Today's floor: every rank raises or is aborted by gloo, within LIMIT_S, or else every rank
    ran the same configurations (rank 0's decisions); no rank returns alone."""
    run = _get(fresh_runs, ("other", case))
    assert run.finished, f"ranks hung: {run}"
    assert not run.errors, run
    assert all(code == -signal.SIGABRT for code in run.dead.values()) and len(run.dead) < 4, run
    kinds = {o[0] for o in run.outcomes.values()}
    if kinds == {"returned"} and not run.dead and case.startswith("autotune"):   # all 6 steps, the same configurations
        ran = [o[3] for o in run.outcomes.values()]
        assert all(isinstance(r, list) and len(r) == 6 for r in ran) and all(r == ran[0] for r in ran), run
        return
    assert kinds == {"raised"}, f"some ranks returned while others failed: {run}"
    assert all(o[1] < LIMIT_S for o in run.outcomes.values()), run


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OTHER_ARGUMENTS))
def test_autotune_and_reconfigure_with_other_arguments_name_them_on_every_rank(fresh_runs, case):
    """What quantize_comm does: a ValueError on every rank naming the argument (or the odd rank)."""
    run = _get(fresh_runs, ("other", case))
    _, odd, _, argument = OTHER_ARGUMENTS[case]
    assert run.finished and not run.dead and not run.errors, run
    for rank, (kind, _, error, message, _) in run.outcomes.items():
        assert (kind, error) == ("raised", "ValueError"), (rank, run)
        assert argument in message or f"rank {odd}" in message, message
