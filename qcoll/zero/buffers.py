"""Buffers (BatchNorm's running statistics) kept the same on every rank, as DDP's ``broadcast_buffers``.

Each rank's forward updates its buffers from its own micro-batch, so they drift apart. With
``ZeroConfig(broadcast_buffers=True)`` (the default, as DDP's) rank 0's persistent buffers are
broadcast at the start of the first forward after a forward that trained (the root module in
training mode, gradients enabled): every forward computes with rank 0's buffers, on every rank
(DDP broadcasts at the start of every training forward; the values are the same). The broadcast
must come before the forward, which saves the buffers for its backward, so it cannot follow the
training forward itself: a forward run after a training forward's backward (the next step, an
evaluation, generation) sees rank 0's values, and ``state_dict()`` returns rank 0's in any case.
One broadcast per dtype, nothing when the model has no persistent buffers (Hugging Face decoders'
rotary tables and masks are non-persistent). As with DDP, two training forwards before one
backward need ``broadcast_buffers=False`` (the second forward's broadcast would change buffers
that the first one's backward still reads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm.stats import stats


def persistent_buffers(root: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``root`` that its ``state_dict`` holds (each once)."""
    out, seen = [], set()
    for module in root.modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with rank 0's values (one broadcast per dtype; collective)."""
    if not tensors or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors([t.detach() for t in group])
        stats.add("buffer_broadcast", None, flat.numel() * flat.element_size() * (dist.get_rank() == 0))
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(value)
