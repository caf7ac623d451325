"""The bf16-outer DiLoCo peer of ``qcoll-bench diloco``: torchft's gloo process group whose
all-reduce moves a bf16 copy of each tensor (the pseudo-gradients), summed in bf16, and writes
the result back into the fp32 tensor when it completes."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo


class _CastBack(dist._Work):
    """Done when the bf16 all-reduce is, with its result copied into the caller's tensors."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor], low: list[torch.Tensor]):
        super().__init__()
        self._work, self._tensors, self._low = work, tensors, low
        self._future = work.get_future().then(lambda _: self._copy_back())

    def _copy_back(self) -> list[torch.Tensor]:
        for t, lo in zip(self._tensors, self._low):
            t.copy_(lo)
        return self._tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class Bf16OuterGroup(ProcessGroupGloo):
    """``ProcessGroupGloo`` whose float32 all-reduce runs on bf16 copies (2 bytes per element)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        if not all(t.dtype == torch.float32 for t in tensors):
            return super().allreduce(tensors, opts)
        low = [t.to(torch.bfloat16) for t in tensors]
        return _CastBack(super().allreduce(low, opts), tensors, low)
