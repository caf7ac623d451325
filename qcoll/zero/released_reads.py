"""Reads of released parameters inside a forward: gathered on the spot while probing, named
precisely when they make the forward fail.

A forward that reads a parameter of a unit other than the ones running (a parent computing
``h @ self.emb.weight.T``) finds it released (empty). During the model's first forward the
:class:`ReleasedParameterProbe` (a ``TorchFunctionMode``) sees every op's arguments and has the
engine gather such a parameter's group on the spot. A read that only a later forward makes
fails with a shape error; :func:`note_released_reads` then names the released parameters that the
failing op held (the innermost frame's parameter locals), and adds nothing when it finds none: an
operand read inline (``x @ self.emb.weight``) has no frame to show it, and a transport error from
a dead peer, or an error of the engine's own collectives, is never explained as a released read.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

#: Tensor attributes a released parameter answers correctly (dtype, device...): reading them
#: needs no gather (HF's ``model.dtype`` reads the first parameter's).
_METADATA = {"dtype", "device", "requires_grad", "layout", "is_cuda", "is_meta", "is_sparse", "is_leaf",
             "is_floating_point", "is_complex", "get_device"}
#: Set on an exception that left the engine's own hooks (its collectives, its checks).
ENGINE_ERROR_ATTR = "_qcoll_engine_error"


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name not in _METADATA


class ReleasedParameterProbe(TorchFunctionMode):
    """Sees every torch op of a forward and gathers the released parameters it reads."""

    _dynamo_kept_out = False

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        cls = type(self)
        # dynamo compiling __torch_function__ garbled its arguments (a cold HF Llama compile): keep it out
        # (here, not as a decorator: `import qcoll` then does not import dynamo, seconds of start-up)
        if not cls._dynamo_kept_out:
            cls.__torch_function__ = torch.compiler.disable(cls.__torch_function__)
            cls._dynamo_kept_out = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.engine.busy and _reads_values(func):  # the engine's own ops are not the model's
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, nn.Parameter) and t.numel() == 0:
                    self.engine.use_released(t)
        return func(*args, **kwargs)


def _released_in_frames(tb, names: dict) -> list[str]:
    """The names of the released managed parameters that the innermost frames of the traceback
    hold as local variables (an op's operands, as ``F.embedding``'s ``weight``), or as the direct
    parameters of the ``self`` of the frame that raised: the innermost frame with any. A released
    parameter that a frame merely could reach is not named."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for depth, frame in enumerate(reversed(frames)):
        candidates = [v for v in frame.f_locals.values() if isinstance(v, nn.Parameter)]
        owner = frame.f_locals.get("self")
        if depth == 0 and isinstance(owner, nn.Module):
            candidates += [p for p in owner._parameters.values() if p is not None]
        found = [names[id(p)] for p in candidates if id(p) in names and p.numel() == 0]
        if found:
            return list(dict.fromkeys(found))
    return []


def note_released_reads(error, names: dict) -> None:
    """Add a note to ``error`` naming the released parameters the failing frames read
    (``names``: ``id(parameter) -> qualified name``); nothing when none did."""
    if not isinstance(error, Exception) or not hasattr(error, "add_note") or getattr(error, ENGINE_ERROR_ATTR, False):
        return
    if isinstance(error, torch.distributed.DistError):
        return
    found = _released_in_frames(error.__traceback__, names)
    if found:
        listed = ", ".join(repr(n) for n in found[:5]) + (" ..." if len(found) > 5 else "")
        error.add_note(f"qcoll.zero: the forward read parameter(s) {listed} while released (empty: their unit was "
                       "not running). qcoll gathers such reads that the model's first complete forward makes; a "
                       "read that only a later forward makes needs units= naming the module that reads it, or its "
                       "parameter's module as part of it.")
