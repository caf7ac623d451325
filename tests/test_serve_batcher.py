"""Batcher: batches cut by max_batch_size and the wait timeout, workers running batches at once,
knobs changed at run time, a bounded queue, and every request answered at shutdown."""
import asyncio
import threading
import time

import pytest

from qcoll.serve import Batcher, BatchConfig, Overloaded


class Recorder:
    """run_batch that records each batch and how many ran at once."""

    def __init__(self, seconds=0.0):
        self.seconds, self.batches, self.running, self.most = seconds, [], 0, 0
        self.lock = threading.Lock()

    def __call__(self, payloads):
        with self.lock:
            self.batches.append(list(payloads))
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return [p * 10 for p in payloads]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_batches_are_cut_at_max_batch_size_in_arrival_order():
    rec = Recorder(0.05)

    async def main():
        b = Batcher(rec, BatchConfig(max_batch_size=2, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1))
        await b.start()
        blocker = b.submit(0)                      # the worker takes it alone; the rest queue meanwhile
        await asyncio.sleep(0.01)
        results = await asyncio.gather(blocker, *[b.submit(i) for i in range(1, 6)])
        await b.stop()
        return results
    assert run(main()) == [0, 10, 20, 30, 40, 50]
    assert rec.batches == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.parametrize("timeout", [0.0, 0.15])
def test_a_lone_request_waits_for_the_timeout_at_most(timeout):
    rec = Recorder()

    async def main():
        b = Batcher(rec, BatchConfig(max_batch_size=8, batch_wait_timeout_s=timeout, workers=1, intra_op_threads=1))
        await b.start()
        t0 = time.monotonic()
        await b.submit(1)
        took = time.monotonic() - t0
        await b.stop()
        return took
    took = run(main())
    assert timeout - 0.01 <= took < timeout + 0.1, took


def test_a_full_batch_does_not_wait_for_the_timeout():
    rec = Recorder()

    async def main():
        b = Batcher(rec, BatchConfig(max_batch_size=3, batch_wait_timeout_s=5.0, workers=1, intra_op_threads=1))
        await b.start()
        t0 = time.monotonic()
        await asyncio.gather(*[b.submit(i) for i in range(3)])
        took = time.monotonic() - t0
        await b.stop()
        return took
    assert run(main()) < 1.0 and rec.batches == [[0, 1, 2]]


def test_workers_and_threads_change_at_run_time():
    rec = Recorder(0.1)
    threads = []

    async def main():
        b = Batcher(rec, BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1),
                    set_threads=threads.append)
        await b.start()
        await asyncio.gather(*[b.submit(i) for i in range(4)])
        one = rec.most
        b.reconfigure(BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=2, intra_op_threads=2))
        assert b.epoch == 1
        rec.most = 0
        await asyncio.gather(*[b.submit(i) for i in range(6)])
        await b.stop()
        return one
    assert run(main()) == 1 and rec.most == 2
    assert threads[0] == 1 and threads[-1] == 2


def test_a_full_queue_refuses_at_once_and_stop_answers_everything_left():
    rec = Recorder(0.2)

    async def main():
        b = Batcher(rec, BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1),
                    max_queue=2)
        await b.start()
        running = b.submit(0)
        await asyncio.sleep(0.05)                  # taken by the worker: the queue is empty again
        queued = [b.submit(1), b.submit(2)]
        with pytest.raises(Overloaded, match="max_queue=2"):
            b.submit(3)
        assert b.rejected == 1
        await b.stop()                             # the running batch finishes; the queued are refused
        outcome = [running.result() if not running.exception() else running.exception()]
        for f in queued:
            assert isinstance(f.exception(), Overloaded)
        return outcome
    out = run(main())
    assert out == [0] or isinstance(out[0], Overloaded)


def test_a_failing_batch_fails_its_requests_and_the_next_batch_runs():
    calls = []

    def flaky(payloads):
        calls.append(payloads)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return payloads

    async def main():
        b = Batcher(flaky, BatchConfig(max_batch_size=4, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1))
        await b.start()
        first = b.submit(1)
        with pytest.raises(RuntimeError, match="boom"):
            await first
        got = await b.submit(2)
        await b.stop()
        return got
    assert run(main()) == 2


def test_idle_workers_beyond_a_lowered_count_retire_at_once():
    """workers 8 -> 1 with nothing queued: the 7 idle workers end now, not after a batch each
    (waiting, every one of them woke at each arrival)."""
    async def main():
        b = Batcher(Recorder(), BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=8, intra_op_threads=1))
        await b.start()
        await asyncio.sleep(0.05)
        before = sum(not t.done() for t in b._tasks)
        b.reconfigure(BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1))
        await asyncio.sleep(0.05)
        after = sum(not t.done() for t in b._tasks)
        result = await b.submit(3)
        await b.stop()
        return before, after, result
    assert run(main()) == (8, 1, 30)
