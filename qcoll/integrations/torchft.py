"""qcoll as the outer all-reduce of torchft's fault-tolerant and low-communication training.

:class:`QuantizedProcessGroup` is a process group for ``torchft.Manager(pg=...)``. Its float
all-reduce (what ``Manager.allreduce`` issues: DiLoCo's and Streaming DiLoCo's pseudo-gradients,
LocalSGD's parameters, torchft DDP's gradients) runs :func:`qcoll.all_reduce_quantized` at 8, 4
or 2 bits across the replica groups, with error feedback; every other call passes through to the
wrapped torchft group unchanged, and is counted in ``passed``::

    from qcoll.integrations.torchft import QuantizedProcessGroup
    pg = QuantizedProcessGroup(bits=2)                     # error feedback on (the default)
    manager = Manager(pg=pg, use_async_quorum=False, ...)  # as for any torchft process group
    pg.attach(manager, fragments=len(model_fragments))     # which residual belongs to which tensor
    with DiLoCo(manager, model_fragments, inner_opt, outer_opt, sync_every=H,
                fragment_sync_delay=1):                    # Streaming DiLoCo: the sync overlaps compute
        ...

What it does with torchft's events:

- **Quorum changes.** ``configure`` (torchft calls it with every new quorum) forgets every
  residual: each slice of the reduce-scatter has a new owner, a replica that joins starts with
  none, and the residuals of one that left go with it. A sync whose quorum changed in the
  middle fails in torchft (its ``should_commit`` is False and the fragment is retried).
- **Failures.** An outer all-reduce that fails (a replica died or left mid-sync), outlasts the
  group's ``timeout`` in ``Work.wait``, or is cut short by ``abort()`` or a new quorum fails its
  Work with an error naming it ("the outer all-reduce 0 of fragment 1, step 4 failed: <cause>"),
  as do those queued behind it. The quorum stays failed until the next ``configure`` (torchft
  reconfigures after a step that did not commit): ``errored()`` returns the failure, so
  ``should_commit`` is False, and later calls are refused. Every residual is forgotten at once: a
  job still on the wire (gloo cannot interrupt it; it ends at gloo's timeout or when its peer is
  gone) writes only into residuals no one holds. A failed all-reduce's tensor is undefined.
- **Which residual is whose.** Residuals are keyed by (fragment, position of the call within the
  sync): the fragment is the manager's step modulo ``fragments`` (torchft's DiLoCo syncs fragment
  ``step % len(model_fragments)``), the position counts the calls since the step changed. A call
  whose tensor has another size than its slot held is a ValueError that names both (a wrong
  ``fragments``), not a silent mix of residuals.
- **Overlap.** The quantized all-reduces run in call order on a worker thread (one per quorum),
  so ``allreduce`` returns at once (the outer sync overlaps the inner steps, as gloo's own
  all-reduce does); a pass-through call first waits for the queued ones (up to the timeout), so
  every replica issues the same sequence.
- **torchft's own quantization** (``should_quantize=True``: FP8 through triton, GPU only) would
  quantize what qcoll quantizes again: the all-to-all it issues through this group is refused
  with a ValueError naming it. Without triton torchft ignores the flag and qcoll's ``bits`` rule.

Needs the ``torchft`` extra: ``pip install 'qcoll[torchft]'``.
"""
from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

try:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper
except ImportError as e:   # pragma: no cover - the extra's absence is tested in a base venv
    raise ImportError("qcoll.integrations.torchft needs torchft: pip install 'qcoll[torchft]'") from e

from ..checks import check_int
from ..comm import ErrorFeedback, all_reduce_quantized
from ..comm.c10d import accept_bare
from ..quant import format as fmt

def _op_name(opts) -> str | None:
    """"sum" / "avg" for an all-reduce's options (or bare ReduceOp) that qcoll quantizes, else None."""
    op = opts if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) else getattr(opts, "reduceOp", None)
    if op is None:
        return None
    if op == dist.ReduceOp.SUM:   # (ReduceOp compares equal to its RedOpType but hashes apart)
        return "sum"
    return "avg" if op == dist.ReduceOp.AVG else None


def _refusal(name: str, failure: BaseException) -> RuntimeError:
    return RuntimeError(f"{name} was not run: this quorum already failed ({failure}); the next quorum "
                        f"(configure) clears the failure")


class _QueuedWork(dist._Work):
    """The Work ``allreduce`` returns: done when the worker thread has run the all-reduce; failed,
    with an error naming it, when the all-reduce failed, did not finish within the timeout, or
    the group was aborted or reconfigured first."""

    def __init__(self, tensors: list[torch.Tensor], what: str, timeout: timedelta, on_timeout):
        super().__init__()
        self.future = torch.futures.Future()
        self.tensors = tensors
        self.what = what                 # "all-reduce 0 of fragment 1, step 4"
        self._timeout = timeout
        self._on_timeout = on_timeout    # (work, error): the group fails the quorum
        self._lock = threading.Lock()
        self._claimed = False
        self._settled = threading.Event()

    def _settle(self, error: BaseException | None = None) -> bool:
        """Complete (or fail with ``error``) once; False if it was already settled."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
        if error is None:
            self.future.set_result(self.tensors)
        else:
            self.future.set_exception(error)
        self._settled.set()
        return True

    def _done(self) -> bool:
        return self._claimed

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the all-reduce is done, at most ``timeout`` (default: the group's); a
        failure or the timeout raises, naming the all-reduce (and fails the group's quorum)."""
        limit = timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout
        if not self._settled.wait(limit.total_seconds()):
            error = TimeoutError(f"the outer {self.what} failed: it did not finish within {limit} (a replica of "
                                 f"the quorum died, shut down or left mid-sync, or the link is slower than that)")
            self._on_timeout(self, error)
            self._settle(error)
        self.future.wait()               # raises the failure
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


class QuantizedProcessGroup(ProcessGroupWrapper):
    """A torchft process group whose float sum/average all-reduce is qcoll's quantized one.

    Args:
        pg: the torchft process group to wrap (default: ``ProcessGroupGloo(timeout)``); its
            transport carries qcoll's frames, and every other collective passes through to it.
        bits: 8, 4 or 2 (codes on the wire), or None to pass every all-reduce through.
        block_size: elements per fp32 scale.
        error_feedback: keep each tensor's residual and add it back at the next sync
            (:class:`qcoll.ErrorFeedback`, fp32: about (1 + 1/replicas) x the reduced bytes per
            rank). Needs :meth:`attach`.
        timeout: the wrapped group's timeout, and the longest ``Work.wait()`` (without its own) or a
            pass-through call waits for the quantized all-reduces.
    """

    def __init__(self, pg: ProcessGroupWrapper | None = None, bits: int | None = 4,
                 block_size: int = fmt.DEFAULT_GRAD_BLOCK, error_feedback: bool = True,
                 timeout: timedelta = timedelta(seconds=60)):
        if bits is not None:
            fmt.check_bits(bits)
            if bits not in (8, 4, 2):
                raise ValueError(f"bits must be 8, 4, 2 or None, got {bits}")
        fmt.check_block_size(block_size)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        if pg is not None and not isinstance(pg, ProcessGroupWrapper):
            raise TypeError(f"pg must be a torchft ProcessGroupWrapper over a c10d group (ProcessGroupGloo() or "
                            f"ProcessGroupNCCL()), got {type(pg).__name__}")
        super().__init__(timeout=timeout, pg=pg if pg is not None else ProcessGroupGloo(timeout=timeout))
        self.bits, self.block_size = bits, block_size
        self.error_feedback = error_feedback and bits is not None
        self.passed: collections.Counter = collections.Counter()   # pass-through calls by name
        self.quantized_calls = 0
        self.resets = 0
        self._manager = None
        self._fragments = 1
        self._slots: dict[tuple[int, int], ErrorFeedback] = {}
        self._step: int | None = None
        self._position = 0
        # One quorum's state, replaced as a whole by configure (under _lock: the worker fails it)
        self._lock = threading.Lock()
        self._quorum = 0                                # counts configure calls: the quorum a job is for
        self._failure: BaseException | None = None     # this quorum's first failure (errored())
        self._pending: list[_QueuedWork] = []          # this quorum's Works not yet settled
        self._lane: queue.Queue | None = None          # this quorum's jobs, run by its own worker thread

    # ---------------------------------------------------------------- torchft's side

    def attach(self, manager, fragments: int = 1) -> "QuantizedProcessGroup":
        """Key the residuals by ``manager``'s step: ``fragments`` is the number of DiLoCo model
        fragments (1 for DiLoCo, LocalSGD and DDP). Returns self."""
        if not callable(getattr(manager, "current_step", None)):
            raise TypeError(f"manager must be a torchft Manager, got {type(manager).__name__}")
        self._manager = manager
        self._fragments = check_int(fragments, "fragments", minimum=1)
        return self

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args, **kwargs) -> None:
        """A new quorum: fail the old quorum's queued and in-flight all-reduces (none of them runs on
        the new group or writes into its residuals), forget every residual and the old quorum's
        failure, rebuild the group."""
        with self._lock:
            self._quorum += 1
            pending, self._pending = self._pending, []
            self._slots, self._step, self._failure = {}, None, None
            self._stop_lane()
            self.resets += 1
        for work in pending:
            work._settle(RuntimeError(f"the outer {work.what} failed: the quorum changed (a new one was configured, "
                                      f"this replica rank {rank} of {world_size}) while it was queued or in flight"))
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    def errored(self) -> BaseException | None:
        """This quorum's first failure (an outer all-reduce that failed or timed out, an abort, a
        shutdown), else the wrapped group's; None while healthy. torchft's ``should_commit`` asks:
        a failed quorum commits nothing. The next ``configure`` clears it."""
        with self._lock:
            failure = self._failure
        return failure if failure is not None else self._pg.errored() if self._pg is not None else None

    def abort(self, errored: bool = True) -> None:
        """Fail every queued and in-flight outer all-reduce now (the one on the wire ends at gloo's
        timeout or when its peer is gone; what it writes is dropped), fail the quorum, and abort
        the wrapped group, which ``configure`` rebuilds."""
        self._fail(None, RuntimeError("the process group was aborted (QuantizedProcessGroup.abort)"))
        if self._pg is not None:
            self._pg.abort(errored=errored)   # (ProcessGroupWrapper.abort would drop the wrapped group for good)

    def getBackendName(self) -> str:
        return "qcoll-" + super().getBackendName()

    def shutdown(self) -> None:
        """Wait (up to the timeout) for the queued all-reduces, fail what is left, stop the worker,
        shut the wrapped group down."""
        self._drain("shutdown", refuse=False)
        self._fail(None, RuntimeError("the process group was shut down (QuantizedProcessGroup.shutdown)"))
        with self._lock:
            self._stop_lane()
        super().shutdown()

    # ---------------------------------------------------------------- the all-reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        """Quantized where it can be (float tensors, sum or average, 2+ replicas, bits set);
        else passed through in order. Refused (RuntimeError) once this quorum has failed."""
        self._refuse_if_failed("allreduce")
        op = _op_name(opts)
        if (self.bits is None or op is None or self.size() < 2
                or not all(t.is_floating_point() and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                           for t in tensors)):
            return self._passed("allreduce", super().allreduce, tensors, opts)
        group = self._pg.parent   # the c10d group torchft built for this quorum: the job runs on it, or not at all
        accept_bare(group)
        with self._lock:
            if self._failure is not None:   # (failed since the check above)
                raise _refusal("allreduce", self._failure)
            keys = [self._key() for _ in tensors]
            slots = [self._slot(t, key) for t, key in zip(tensors, keys)]
            work = _QueuedWork(tensors, self._describe(keys), self._timeout,
                               lambda w, e, quorum=self._quorum: self._fail(quorum, e, w))
            self._pending = [w for w in self._pending if not w._done()] + [work]
            if self._lane is None:
                self._lane = queue.Queue()
                threading.Thread(target=self._run, args=(self._lane,), name="qcoll-torchft-allreduce",
                                 daemon=True).start()
            self._lane.put((self._quorum, tensors, op, slots, group, work))
            self.quantized_calls += 1
        return work

    def _key(self) -> tuple[int, int, int] | None:
        """(fragment, position within the sync, manager step) of the next all-reduce; None unattached."""
        if self._manager is None:
            return None
        step = self._manager.current_step()
        if step != self._step:
            self._step, self._position = step, 0
        key = (step % self._fragments, self._position, step)
        self._position += 1
        return key

    def _describe(self, keys) -> str:
        if keys[0] is None:
            return f"all-reduce {self.quantized_calls} (no manager attached)"
        positions = ", ".join(str(k[1]) for k in keys)
        return f"all-reduce{'s' if len(keys) > 1 else ''} {positions} of fragment {keys[0][0]}, step {keys[0][2]}"

    def _slot(self, t: torch.Tensor, key: tuple[int, int, int] | None = None) -> ErrorFeedback | None:
        if not self.error_feedback:
            return None
        if self._manager is None:
            raise ValueError("QuantizedProcessGroup(error_feedback=True) needs pg.attach(manager, fragments=...) "
                             "after the torchft Manager is built, so that each tensor finds its own residual")
        fragment, position, _ = key if key is not None else self._key()
        slot = self._slots.setdefault((fragment, position), ErrorFeedback(device=t.device))
        if slot.numel is not None and (slot.numel != t.numel() or slot.group_size != self.size()):
            raise ValueError(f"all-reduce {position} of fragment {fragment} reduces {t.numel()} elements over "
                             f"{self.size()} replicas, but its residual was kept for {slot.numel} over "
                             f"{slot.group_size}: pass attach(manager, fragments=) the number of DiLoCo "
                             f"model_fragments (got fragments={self._fragments})")
        return slot

    def _stop_lane(self) -> None:
        """(under _lock) Let this quorum's worker end after the job it is on; a new quorum starts its own."""
        if self._lane is not None:
            self._lane.put(None)
            self._lane = None

    def _run(self, lane: queue.Queue) -> None:
        while (job := lane.get()) is not None:
            quorum, tensors, op, slots, group, work = job
            try:
                for t, slot in zip(tensors, slots):
                    if work._done():   # failed meanwhile (timed out, aborted, a new quorum): not run further
                        break
                    all_reduce_quantized(t, bits=self.bits, block_size=self.block_size, group=group, op=op,
                                         error_feedback=slot)
            except BaseException as e:   # the Work reports it; torchft's manager skips the step
                error = RuntimeError(f"the outer {work.what} failed: {type(e).__name__}: {e}")
                error.__cause__ = e
                self._fail(quorum, error, work)
            else:
                work._settle()

    def _fail(self, quorum: int | None, error: BaseException, work: _QueuedWork | None = None) -> None:
        """Quorum ``quorum`` (None: the current one) failed with ``error`` (``work``'s own, if any):
        keep the first failure for errored(), forget every residual (the failed sync's updates with
        them: a job still running writes only into these dropped ones), and fail every Work of the
        quorum still pending. A past quorum's failure changes nothing (configure dropped its state)."""
        with self._lock:
            if quorum is not None and quorum != self._quorum:
                pending = []
            else:
                if self._failure is None:
                    self._failure = error
                self._slots, self._step = {}, None
                pending, self._pending = self._pending, []
        if work is not None:
            work._settle(error)
        for other in pending:
            if other is not work:
                other._settle(RuntimeError(f"the outer {other.what} failed: it was queued or in flight when "
                                           f"this quorum failed ({error})"))

    def _refuse_if_failed(self, name: str) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise _refusal(name, failure)

    def _drain(self, name: str, refuse: bool = True) -> None:
        """Wait (up to the timeout in all) for this quorum's queued all-reduces, so that every replica
        issues the same sequence; one that does not finish fails the quorum. A failed quorum
        refuses ``name`` (with ``refuse``)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._lock:
            pending = list(self._pending)
        for work in pending:
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except Exception:   # recorded as this quorum's failure: refused below
                pass
        if refuse:
            self._refuse_if_failed(name)

    # ---------------------------------------------------------------- everything else

    def alltoall_base(self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("torchft.collectives"):
            raise ValueError("torchft's should_quantize=True quantizes the all-reduce itself (FP8), on top of "
                             "QuantizedProcessGroup's own quantization: pass should_quantize=False (the default) "
                             "and choose the width with QuantizedProcessGroup(bits=)")
        return self._passed("alltoall_base", super().alltoall_base, output_buffer, input_buffer,
                            output_split_sizes, input_split_sizes, opts)

    def _passed(self, name: str, call, *args):
        self._drain(name)
        self.passed[name] += 1
        return call(*args)

    def allgather(self, *args):
        return self._passed("allgather", super().allgather, *args)

    def allgather_into_tensor_coalesced(self, *args):
        return self._passed("allgather_into_tensor_coalesced", super().allgather_into_tensor_coalesced, *args)

    def allreduce_coalesced(self, *args):
        return self._passed("allreduce_coalesced", super().allreduce_coalesced, *args)

    def barrier(self, *args):
        return self._passed("barrier", super().barrier, *args)

    def broadcast(self, *args):
        return self._passed("broadcast", super().broadcast, *args)

    def recv(self, *args):
        return self._passed("recv", super().recv, *args)

    def reduce_scatter(self, *args):
        return self._passed("reduce_scatter", super().reduce_scatter, *args)

    def reduce_scatter_tensor_coalesced(self, *args):
        return self._passed("reduce_scatter_tensor_coalesced", super().reduce_scatter_tensor_coalesced, *args)

    def send(self, *args):
        return self._passed("send", super().send, *args)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residuals kept on this rank."""
        return sum(s.nbytes for s in self._slots.values())

    def __repr__(self) -> str:
        return f"QuantizedProcessGroup(bits={self.bits}, error_feedback={self.error_feedback}, pg={self._pg!r})"
