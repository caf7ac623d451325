"""``Batcher``: requests queued, cut into batches, run on worker threads; its knobs change at run time.

The four knobs (:class:`BatchConfig`) are RRL's on CPU (Qin et al., SC'19): request-level
parallelism (``max_batch_size``, ``batch_wait_timeout_s``), inter-op parallelism (``workers``:
batches that run at once, each on a thread of its own) and intra-op parallelism
(``intra_op_threads``). The defaults are Ray Serve's ``@serve.batch`` defaults
(``max_batch_size=10``, ``batch_wait_timeout_s=0.01``, ``max_concurrent_batches=1``) and torch's
thread count: what a user of an engine gets without tuning.

A worker takes the oldest request, waits until ``max_batch_size`` requests are queued or
``batch_wait_timeout_s`` has passed since that request arrived, whichever is first, and runs
them as one batch. The queue is bounded (``max_queue``): a request that finds it full raises
:class:`Overloaded` at once (the server answers 503) instead of waiting without bound.
"""
from __future__ import annotations

import asyncio
import collections
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..checks import check_int, check_number

#: the most batches that run at once (the worker thread pool's size)
MAX_WORKERS = 64


@dataclass(frozen=True)
class BatchConfig:
    """The batching knobs (see the module docstring)."""

    max_batch_size: int = 10
    batch_wait_timeout_s: float = 0.01
    workers: int = 1
    intra_op_threads: int = field(default_factory=lambda: os.cpu_count() or 1)

    def __post_init__(self):
        check_int(self.max_batch_size, "max_batch_size", minimum=1)
        check_int(self.workers, "workers", minimum=1)
        check_int(self.intra_op_threads, "intra_op_threads", minimum=1)
        check_number(self.batch_wait_timeout_s, "batch_wait_timeout_s (seconds)", minimum=0, maximum=60)

    def label(self) -> str:
        return (f"b{self.max_batch_size} t{self.batch_wait_timeout_s * 1e3:g}ms w{self.workers} "
                f"i{self.intra_op_threads}")


class Overloaded(RuntimeError):
    """The queue is full: the request was not accepted (HTTP 503)."""


@dataclass
class Job:
    """One request in the queue: what to run, when it arrived."""

    payload: Any
    arrival: float
    future: asyncio.Future


class Batcher:
    """``run_batch(payloads) -> results`` (blocking, called on a worker thread) behind a queue.

    ``set_threads(n)`` is called on the worker thread before a batch when ``intra_op_threads``
    changed. Use inside a running event loop: :meth:`start`, :meth:`submit`, :meth:`stop`.
    """

    def __init__(self, run_batch: Callable[[list], list], config: BatchConfig | None = None,
                 max_queue: int = 256, set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.run_batch, self.set_threads, self.clock = run_batch, set_threads, clock
        self.config = config or BatchConfig()
        self.max_queue = check_int(max_queue, "max_queue", minimum=1)
        self.epoch = 0                          # +1 at every configuration change
        self.queue: collections.deque[Job] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._pool: ThreadPoolExecutor | None = None
        self._threads_set = None
        self._in_flight: dict[int, Job] = {}       # the jobs whose batch runs now, by id
        self.batches = 0
        self.rejected = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._arrived = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="qcoll-serve")
        self._resize()

    async def stop(self) -> None:
        in_flight = list(self._in_flight.values())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        left = list(self.queue) + in_flight
        self.queue.clear()
        for job in left:    # queued, or in a batch whose worker was cancelled: answered, never left hanging
            if not job.future.done():
                job.future.set_exception(Overloaded("the server is shutting down"))
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def reconfigure(self, config: BatchConfig) -> None:
        """Use ``config`` from the next batch on (a batch running now finishes as it was cut)."""
        if not isinstance(config, BatchConfig):
            raise TypeError(f"config must be a BatchConfig, got {type(config).__name__}")
        if config != self.config:
            self.config = config
            self.epoch += 1
            if self._arrived is not None:
                self._resize()
                self._arrived.set()   # waiting workers re-read max_batch_size / timeout

    def _resize(self) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        while len(self._tasks) < self.config.workers:
            self._tasks.append(asyncio.get_running_loop().create_task(self._worker(len(self._tasks))))
        # extra workers retire themselves: at once when idle, else after their batch (see _worker)

    # ------------------------------------------------------------------ requests
    def submit(self, payload) -> asyncio.Future:
        """Queue ``payload``; the future resolves to its result (or raises what the batch raised).
        Raises :class:`Overloaded` at once when ``max_queue`` requests are waiting."""
        if self._arrived is None:
            raise RuntimeError("Batcher.submit before start()")
        if len(self.queue) >= self.max_queue:
            self.rejected += 1
            raise Overloaded(f"{len(self.queue)} requests are queued (max_queue={self.max_queue})")
        job = Job(payload, self.clock(), asyncio.get_running_loop().create_future())
        self.queue.append(job)
        self._arrived.set()
        return job.future

    async def _next_batch(self, index: int) -> list[Job] | None:
        """The next batch, or None when worker ``index`` is beyond ``workers`` (it retires)."""
        while not self.queue:
            if index >= self.config.workers:
                return None
            self._arrived.clear()
            await self._arrived.wait()
        while True:
            cfg = self.config
            wait = self.queue[0].arrival + cfg.batch_wait_timeout_s - self.clock()
            if len(self.queue) >= cfg.max_batch_size or wait <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except asyncio.TimeoutError:
                pass
            if not self.queue:     # another worker took them
                return []
        n = min(len(self.queue), self.config.max_batch_size)
        return [self.queue.popleft() for _ in range(n)]

    async def _worker(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        while index < self.config.workers:
            batch = await self._next_batch(index)
            if batch is None:
                break
            jobs = [j for j in batch if not j.future.done()]   # done: the client left
            if not jobs:
                continue
            threads = self.config.intra_op_threads
            self._in_flight.update((id(j), j) for j in jobs)
            try:
                results = await loop.run_in_executor(self._pool, self._run, threads, [j.payload for j in jobs])
            except Exception as e:   # the batch failed: every request in it gets the error
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            finally:
                for j in jobs:
                    self._in_flight.pop(id(j), None)
            self.batches += 1
            for j, r in zip(jobs, results):
                if not j.future.done():
                    j.future.set_result(r)
        if self.queue:
            self._arrived.set()    # a retiring worker hands the wake-up on

    def _run(self, threads: int, payloads: list) -> list:
        if self.set_threads is not None and threads != self._threads_set:
            self.set_threads(threads)
            self._threads_set = threads
        results = self.run_batch(payloads)
        if len(results) != len(payloads):
            raise RuntimeError(f"run_batch returned {len(results)} results for {len(payloads)} requests")
        return results
