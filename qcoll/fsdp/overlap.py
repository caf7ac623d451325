"""qgZ reductions left in flight across FSDP2's backward (``quantize_comm(overlap_comm=True)``).

FSDP2 calls a custom ``ReduceScatter`` synchronously in a module's post-backward hook and, on a
device without streams (CPU), reads the output when the call returns: both qgZ hops would block
the backward. Yet in the common case FSDP2 does nothing with the output but make each parameter's
``.grad`` a view of it (``foreach_reduce``): then the output only has to be filled before anything
reads the gradients, which is after the backward. So, as ``qcoll.zero`` does, the reduce-scatter
launches hop 1 and returns; the next quantized collective of the backward (a reduce-scatter or an
all-gather of another module) advances it (waits for hop 1's data and launches hop 2); and a
callback queued on the backward's graph task waits for all of them when the backward ends, before
``backward()`` returns. The results are the synchronous ones bit for bit (the same operations, in
the same order on every rank).

A reduction is deferred only where FSDP2 provably leaves the output alone (:func:`why_not_defer`);
otherwise it completes before the call returns, as before.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable


def why_not_defer(param_group, output: torch.Tensor, op_name: str) -> str | None:
    """None when FSDP2 only views ``output`` after the reduce-scatter of ``param_group`` (a
    ``FSDPParamGroup``), else why it reads or changes it at once (then the call must complete)."""
    if torch._C._current_graph_task_id() == -1:
        return "not called inside a backward"
    if op_name != "avg":
        return f"op {op_name} (FSDP2 may divide the output after a SUM)"
    params = param_group.fsdp_params
    if output.dtype != params[0].orig_dtype:
        return f"reduce dtype {output.dtype} (FSDP2 casts the output to {params[0].orig_dtype})"
    if getattr(param_group, "_all_reduce_hook", None) is not None:
        return "an all-reduce hook runs on the output"
    for p in params:
        if p.sharded_param.grad is not None:
            return "a gradient is accumulated into (FSDP2 adds the output to .grad)"
        if getattr(p.sharded_param, "_post_accumulate_grad_hooks", None):
            return "a post-accumulate-grad hook reads .grad"
        if getattr(p, "offload_to_cpu", False):
            return "CPU offload copies the output"
    return None


class DeferredReductions:
    """The reductions in flight of one ``quantize_comm``'s modules (qcoll's ``Handle`` objects).

    ``add`` keeps a launched reduction and, once per backward (graph task), queues
    :meth:`wait_all` to run when the backward ends; ``advance`` launches the next stage of each;
    ``deferred`` counts the reductions ever deferred (tests and benchmarks read it)."""

    def __init__(self):
        self._pending: list = []
        self._task: int | None = None
        self.deferred = 0

    def advance(self) -> None:
        """Launch the stages due of every reduction in flight, in launch order (every rank calls
        this at the same point of its sequence of collectives)."""
        for handle in self._pending:
            handle.advance()

    def add(self, handle) -> None:
        """Keep ``handle`` until the end of the current backward."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            Variable._execution_engine.queue_callback(self.wait_all)
        self._pending.append(handle)
        self.deferred += 1

    def wait_all(self) -> None:
        """Complete every reduction in flight, in launch order (their outputs are then filled)."""
        pending, self._pending, self._task = self._pending, [], None
        for handle in pending:
            handle.wait()

    def __len__(self) -> int:
        return len(self._pending)
