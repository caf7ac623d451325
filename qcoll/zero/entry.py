"""Forwards that start below the root: a submodule, or a method, called outside the model's forward.

Hugging Face's encoder-decoder ``generate`` calls ``model.get_encoder()(...)``: the encoder's
forward runs without the root's, so the root unit (the shared embedding, the final norms) would
stay released. As FSDP2's ``register_fsdp_forward_method``, such a call runs as a forward of its
own: the engine begins a forward, gathers the root unit, lets the units inside gather themselves,
and ends it (resharding everything) when the call returns.

:func:`register_entries` hooks, besides the root, every module whose forward can usefully be called
alone: the units, the modules above them (``model.encoder``, ``model.model.decoder``) and the
modules that hold root-unit parameters (``lm_head``, ``shared``); inside the model's forward the
hooks return at once (an attribute read, which ``torch.compile`` guards on instead of breaking the
graph). :func:`register_forward_method` does the same for any other method (FSDP2's spelling).
"""
from __future__ import annotations

import functools

from torch import nn

from .units import is_container
from .user_grads import SLOT_ATTR


def entry_modules(root: nn.Module, units) -> list[nn.Module]:
    """The modules below ``root`` that :func:`register_entries` hooks (each once, in tree order)."""
    paths = {p for u in units if u.path for p in _prefixes(u.path)}
    root_owned = {id(p) for p in units[0].used}
    chosen = []
    for name, m in root.named_modules():
        if not name or is_container(m):
            continue
        owns_root_param = any(id(p) in root_owned for p in m.parameters(recurse=False))
        if name in paths or owns_root_param:
            chosen.append(m)
    return chosen


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def register_entries(engine, root: nn.Module, units) -> list:
    """Hook the entry modules of ``root`` (see the module docstring); returns the hook handles."""
    handles = []
    for m in entry_modules(root, units):
        handles.append(m.register_forward_pre_hook(functools.partial(_pre, engine), prepend=True, with_kwargs=True))
        handles.append(m.register_forward_hook(functools.partial(_post, engine), always_call=True))
    return handles


def _pre(engine, module, args, kwargs):
    if engine.in_forward or engine.in_backward:  # inside the model's forward, or a checkpoint's recompute
        return None
    return engine.begin_entry(module, args, kwargs)


def _post(engine, module, args, output):
    if engine.entry is module:
        engine.end_entry(module, args, output)
    return None


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` called outside the model's forward run as a forward of
    the sharded model that ``module`` belongs to (gathers what it reads, reshards afterwards), as
    FSDP2's ``register_fsdp_forward_method``. ``module`` is the sharded model or a submodule of it."""
    slots = [getattr(p, SLOT_ATTR, None) for p in module.parameters()] if isinstance(module, nn.Module) else []
    engines = [slot[0].engine for slot in slots if slot is not None and slot[0].engine is not None]
    if not engines:
        raise TypeError(f"module must be a model sharded by qcoll.zero.shard or a submodule of one (with parameters), "
                        f"got {type(module).__name__}")
    engine = engines[0]
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"method_name: {type(module).__name__} has no method {method_name!r}")

    @functools.wraps(method)
    def run(*args, **kwargs):
        if engine.in_forward or engine.in_backward:
            return method(*args, **kwargs)
        cast = engine.begin_entry(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        try:
            output = method(*args, **kwargs)
        except BaseException:
            engine.end_entry(module, args, None, failed=True)
            raise
        engine.end_entry(module, args, output, failed=False)
        return output

    setattr(module, method_name, run)
