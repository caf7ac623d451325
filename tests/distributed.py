"""Run a function on several gloo ranks (local processes) from a test.

:class:`RankPool` keeps ``world`` worker processes with an initialized default
group alive across tests (starting torch in a process costs seconds), runs
picklable module-level functions ``fn(rank, world, *args)`` on all of them, and
returns the per-rank results. A rank's exception is re-raised in the test with
its traceback; a rank whose process dies (gloo aborts a process on some errors) is
reported once the others have finished; a run that exceeds its timeout kills the
pool (a fresh one starts on the next run), so nothing ever hangs. A closed pool's workers end
with ``os._exit(0)`` once their results are sent.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

GROUP_TIMEOUT_S = float(os.environ.get("QCOLL_TEST_GROUP_TIMEOUT", "30"))
#: what the fork server of a pool started with ``preload=PRELOAD`` imports once (one fork server serves the
#: whole test session: the first pool to start it decides what it imported). For tests that start fresh
#: pools (a rank killed, or gloo aborting one): each spawned worker would import torch and qcoll again,
#: about 5 s of CPU per process on a small host.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "qcoll", "qcoll.fsdp", "qcoll.tune", "qcoll.zero",
           "qcoll.testing", "qcoll.testing.fsdp2", "distributed")


#: a worker with more threads than this is replaced before the next task (see RankPool._crowded)
MAX_THREADS = 160


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, env, tasks, results):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(env.get("QCOLL_TEST_GROUP_TIMEOUT", GROUP_TIMEOUT_S))))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        except BaseException:
            results.put((rank, "err", traceback.format_exc()))
    # a clean finish ends here, without the teardown: gloo's threads (subgroups held by Python objects,
    # qcoll.Topology's, outlive destroy_process_group) against the interpreter's and C++'s teardown can
    # end a finished worker in std::terminate (qcoll/bench/ranks.py's docstring). Results first.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailure(AssertionError):
    """A run in which some rank raised, died or did not finish; ``results``/``errors`` by
    rank, ``dead``: exit codes of the ranks whose process died."""

    def __init__(self, message, results=None, errors=None, finished=True, dead=None):
        super().__init__(message)
        self.results = results or {}
        self.errors = errors or {}
        self.finished = finished
        self.dead = dead or {}


class RankPool:
    """``world`` ranks; ``env``: their environment's additions (``QCOLL_TEST_GROUP_TIMEOUT``: the
    group's timeout). ``preload``: modules imported once, by a fork server the workers are forked
    from, instead of by each worker (importing torch and qcoll costs seconds of CPU per process;
    for tests that start many pools). Otherwise each worker is a fresh interpreter (spawn)."""

    def __init__(self, world: int, env: dict | None = None, preload: tuple[str, ...] = ()):
        self.world = world
        self.env = dict(env or {})
        self.preload = tuple(preload)
        self._procs = []

    def _start(self):
        if self.preload:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(self.preload))   # (read when the fork server starts)
        else:
            ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.env, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world)]
        for p in self._procs:
            p.start()

    def _crowded(self) -> bool:
        """Whether a worker holds more than ``MAX_THREADS`` threads: the process groups the tasks made
        (meshes, FSDP2's post-forward groups, Topologies) stay alive in the workers, three gloo
        threads each whose timers wake, and a session's worth of them took a quarter of a core per
        idle rank (slowing every later test 2-3x). Destroying them after each task is not safe
        (DeviceMesh and DTensor resolve groups by name later), so the pool starts afresh instead."""
        try:
            return len(os.listdir(f"/proc/{self._procs[0].pid}/task")) > MAX_THREADS
        except OSError:
            return False

    def run(self, fn, *args, timeout: float = 90.0):
        """Run ``fn(rank, world, *args)`` on every rank; returns the results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs) or self._crowded():
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        got, errors, dead = {}, {}, {}
        deadline = time.monotonic() + timeout
        while len(got) + len(errors) + len(dead) < self.world:
            try:
                rank, status, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.close()
                    missing = sorted(set(range(self.world)) - set(got) - set(errors) - set(dead))
                    raise RankFailure(f"ranks {missing} did not finish {fn.__name__} within {timeout}s; errors so "
                                      f"far: {errors}; dead: {dead}", got, errors, False, dead) from None
                dead.update({r: p.exitcode for r, p in enumerate(self._procs)
                             if r not in got and r not in errors and not p.is_alive()})
                continue
            (got if status == "ok" else errors)[rank] = value
        if dead:
            self.close(graceful=False)  # the survivors' process group lost a member: start afresh next time
            raise RankFailure(f"ranks {sorted(dead)} died during {fn.__name__} (exit codes {dead}); errors: "
                              f"{errors}", got, errors, True, dead)
        if errors:
            first = min(errors)
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}",
                              got, errors)
        return [got[r] for r in range(self.world)]

    def close(self, graceful: bool = True):
        """Stop the workers; ``graceful=False`` kills them at once (their group is broken anyway)."""
        for q in getattr(self, "_tasks", []) if graceful else []:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)   # reaped: no process of the pool is left, not even a zombie
        self._procs = []
