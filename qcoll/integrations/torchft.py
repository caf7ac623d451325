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
- **Which residual is whose.** Residuals are keyed by (fragment, position of the call within the
  sync): the fragment is the manager's step modulo ``fragments`` (torchft's DiLoCo syncs fragment
  ``step % len(model_fragments)``), the position counts the calls since the step changed. A call
  whose tensor has another size than its slot held is a ValueError that names both (a wrong
  ``fragments``), not a silent mix of residuals.
- **Overlap.** The quantized all-reduces run in call order on one worker thread, so ``allreduce``
  returns at once (the outer sync overlaps the inner steps, as gloo's own all-reduce does); a
  pass-through call first waits for the queued ones, so every replica issues the same sequence.
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


class _QueuedWork(dist._Work):
    """The Work ``allreduce`` returns: done when the worker thread has run the all-reduce."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.future = torch.futures.Future()
        self.tensors = tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.future.wait()
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
        timeout: the wrapped group's timeout.
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
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

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
        """A new quorum: wait for the queued all-reduces, forget every residual, rebuild the group."""
        self._drain()
        self._slots.clear()
        self._step = None
        self.resets += 1
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    def getBackendName(self) -> str:
        return "qcoll-" + super().getBackendName()

    def shutdown(self) -> None:
        self._drain(stop=True)
        super().shutdown()

    # ---------------------------------------------------------------- the all-reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        """Quantized where it can be (float tensors, sum or average, 2+ replicas, bits set);
        else passed through in order."""
        op = _op_name(opts)
        if (self.bits is None or op is None or self.size() < 2
                or not all(t.is_floating_point() and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                           for t in tensors)):
            self._drain()
            self.passed["allreduce"] += 1
            return super().allreduce(tensors, opts)
        slots = [self._slot(t) for t in tensors]
        work = _QueuedWork(tensors)
        self._start_worker()
        self._jobs.put((tensors, op, slots, work))
        self.quantized_calls += 1
        return work

    def _slot(self, t: torch.Tensor) -> ErrorFeedback | None:
        if not self.error_feedback:
            return None
        if self._manager is None:
            raise ValueError("QuantizedProcessGroup(error_feedback=True) needs pg.attach(manager, fragments=...) "
                             "after the torchft Manager is built, so that each tensor finds its own residual")
        step = self._manager.current_step()
        if step != self._step:
            self._step, self._position = step, 0
        key = (step % self._fragments, self._position)
        self._position += 1
        slot = self._slots.setdefault(key, ErrorFeedback(device=t.device))
        if slot.numel is not None and (slot.numel != t.numel() or slot.group_size != self.size()):
            raise ValueError(f"all-reduce {key[1]} of fragment {key[0]} reduces {t.numel()} elements over "
                             f"{self.size()} replicas, but its residual was kept for {slot.numel} over "
                             f"{slot.group_size}: pass attach(manager, fragments=) the number of DiLoCo "
                             f"model_fragments (got fragments={self._fragments})")
        return slot

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="qcoll-torchft-allreduce", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                tensors, op, slots, work = job
                try:
                    group = self._pg.parent   # the c10d group torchft built for this quorum
                    accept_bare(group)
                    for t, slot in zip(tensors, slots):
                        all_reduce_quantized(t, bits=self.bits, block_size=self.block_size, group=group, op=op,
                                             error_feedback=slot)
                    work.future.set_result(tensors)
                except BaseException as e:   # the Work reports it; torchft's manager skips the step
                    work.future.set_exception(e)
            finally:
                self._jobs.task_done()

    def _drain(self, stop: bool = False) -> None:
        if self._worker is not None and self._worker.is_alive():
            if stop:
                self._jobs.put(None)
            self._jobs.join()

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
        self._drain()
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
