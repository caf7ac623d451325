"""The tensors of a unit's forward output, wherever the output keeps them.

The engine hooks the output tensors that require grad so that backward gathers the unit's
groups again before their gradients flow. Outputs are looked through as pytrees (tuples,
lists, dicts, dataclasses Hugging Face registers, ``ModelOutput``) and, for other objects,
through their attributes (a plain class with a ``.loss``, a ``SimpleNamespace``), a few levels
deep. An output whose tensors cannot be found is refused at the forward by the engine, naming its
type, instead of failing in backward with a storage error.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

_MAX_DEPTH = 4
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def output_tensors(output) -> tuple[list[torch.Tensor], list[type]]:
    """``(tensors, opaque)``: the tensors found in ``output`` and the types of the objects in it
    that hold no reachable tensors and are neither scalars nor containers."""
    tensors, opaque, seen = [], [], set()

    def visit(value, depth):
        leaves, _ = tree_flatten(value)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
            elif isinstance(leaf, _SCALARS) or id(leaf) in seen:
                continue
            elif depth < _MAX_DEPTH and hasattr(leaf, "__dict__") and not isinstance(leaf, type):
                seen.add(id(leaf))
                before = len(tensors)
                visit(list(vars(leaf).values()), depth + 1)
                if len(tensors) == before:
                    opaque.append(type(leaf))
            else:
                opaque.append(type(leaf))

    visit(output, 0)
    return tensors, opaque
