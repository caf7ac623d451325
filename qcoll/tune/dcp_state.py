"""An AutoTune's state inside a ``torch.distributed.checkpoint`` (DCP) checkpoint, as tensors only.

FSDP2 users checkpoint with DCP (``dcp.save({"model": ..., "optim": ...}, checkpoint_id=...)``).
DCP stores a non-tensor value by pickling it and unpickles it on load without restricting the
classes, so qcoll puts nothing but tensors there: the AutoTune's JSON state (:meth:`AutoTune.state_dict`)
as UTF-8 bytes in a uint8 tensor of fixed ``capacity`` (DCP loads into tensors of the saved size),
beside its length. :class:`AutoTuneState` is a DCP ``Stateful``: DCP calls its ``state_dict`` when
saving and its ``load_state_dict`` after loading, so it goes into the same dict as the model::

    dcp.save({"model": model_sd, "optim": optim_sd, "autotune": AutoTuneState(auto)}, checkpoint_id=path)
    dcp.load({"model": model_sd, "optim": optim_sd, "autotune": AutoTuneState(auto)}, checkpoint_id=path)

Loading parses JSON (no code runs) and goes through :meth:`AutoTune.load_state_dict`, which checks
every field on every rank and has the ranks agree before anything changes.
"""
from __future__ import annotations

import json

import torch

#: bytes kept for the JSON state (a state of 300 steps of RRL is a few KiB)
DEFAULT_CAPACITY = 1 << 18


class AutoTuneState:
    """DCP ``Stateful`` wrapper of a :class:`qcoll.tune.AutoTune` (``capacity``: bytes reserved for
    its JSON state; save and load must use the same). ``state_dict`` and ``load_state_dict`` are
    collectives, as the AutoTune's own: every rank calls ``dcp.save`` / ``dcp.load``."""

    def __init__(self, autotune, capacity: int = DEFAULT_CAPACITY):
        if not callable(getattr(autotune, "state_dict", None)) or not callable(getattr(autotune, "load_state_dict", None)):
            raise TypeError(f"autotune must be a qcoll.tune.AutoTune, got {type(autotune).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 64:
            raise ValueError(f"capacity must be an int >= 64 (bytes), got {capacity!r}")
        self.autotune, self.capacity = autotune, capacity

    def state_dict(self) -> dict:
        """``{"json": uint8 [capacity], "length": int64 [1]}``; a ValueError when the state does not fit."""
        data = json.dumps(self.autotune.state_dict()).encode()
        if len(data) > self.capacity:
            raise ValueError(f"the AutoTune state is {len(data)} bytes, more than capacity={self.capacity}: "
                             f"pass AutoTuneState(auto, capacity=...) with at least that (the same when loading)")
        buf = torch.zeros(self.capacity, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return {"json": buf, "length": torch.tensor([len(data)], dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved; a ValueError naming what is wrong with a damaged one
        (nothing changes then, on any rank: :meth:`AutoTune.load_state_dict`)."""
        buf, length = state.get("json"), state.get("length")
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError("the checkpoint's autotune 'json' is not a uint8 vector")
        if not isinstance(length, torch.Tensor) or length.numel() != 1 or length.dtype != torch.int64:
            raise ValueError("the checkpoint's autotune 'length' is not one int64")
        n = int(length.item())
        if not 0 < n <= buf.numel():
            raise ValueError(f"the checkpoint's autotune 'length' is {n}, outside 1..{buf.numel()} (a damaged file?)")
        try:
            doc = json.loads(bytes(buf[:n].tolist()).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(f"the checkpoint's autotune state is not JSON ({type(e).__name__}: {e})"[:300]) from None
        self.autotune.load_state_dict(doc)
