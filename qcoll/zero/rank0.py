"""Run a step on rank 0 only (file system work) and give every rank its result or its error."""
from __future__ import annotations

import pickle

import torch.distributed as dist


def on_rank0(fn, *args):
    """``fn(*args)`` on rank 0, its result (or its exception) broadcast: every rank returns it or raises."""
    box = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn(*args))
        except Exception as e:
            error = e
            try:
                pickle.loads(pickle.dumps(e))
                box[0] = (False, e)
            except Exception:
                box[0] = (False, RuntimeError(f"{type(e).__name__}: {e}"))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    ok, value = box[0]
    if not ok:
        if hasattr(value, "add_note"):
            value.add_note("(raised on rank 0, which does the file system work)")
        raise value
    return value
