"""What a load checks before it changes anything, and the ranks' agreement on the answer.

* :func:`agreed` runs a local check on every rank and makes its outcome collective: the result
  where every rank's check passed, else the same ``ValueError`` on every rank (the message of
  the lowest rank that failed, sent as UTF-8 bytes; nothing is unpickled). Every rank reads the
  same files, so the checks agree anyway; this makes a split (one rank going on, reconfiguring
  or waiting in the next collective, while another raised) impossible.
* :func:`check_param_groups`: the optimizer hyper-parameters of a checkpoint (decoded by
  :func:`~qcoll.zero.checkpoint_safety.decode_param_groups`) against the live optimizer, before
  any of them (or any tensor) is loaded. Per group and key:

  - a key the live group does not have is refused, naming it, except those torch's LR
    schedulers add to param groups (:data:`SCHEDULER_KEYS`: a finite number or floating tensor);
    a key the checkpoint lacks keeps the optimizer's current value (what torch does for a key an
    optimizer gained in a later release);
  - the value's type must be one the optimizer class's ``__init__`` annotates for that argument
    (``float | Tensor`` for ``lr``, ``bool | None`` for ``foreach``, a 2-tuple for ``betas``, ...)
    or the live value's type (an int where a float is expected is a float); tuples have the
    annotated (else the live) length, element by element; a live tensor keeps its shape;
  - numbers and floating tensors must be finite, unless equal to the live value (an optimizer
    built with ``inf`` keeps it);
  - a throwaway instance of the optimizer class is built with the group's resulting
    hyper-parameters on a one-element tensor like the masters (torch's optimizers refuse a
    negative ``lr``, ``betas`` out of range, ``fused`` with ``differentiable``, ... in
    ``__init__``); what the class refuses is a ``ValueError`` naming the key (the first whose
    value alone it refuses). A class that cannot be built from its param groups alone (an
    ``__init__`` with other required arguments) skips this step.
"""
from __future__ import annotations

import inspect
import math
import sys
import types
import typing
import warnings

import torch
import torch.distributed as dist

#: keys torch's LR schedulers add to an optimizer's param groups (LRScheduler, OneCycleLR, CyclicLR, SWALR)
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})
_MESSAGE_LIMIT = 1 << 16  # bytes of an error message sent to the other ranks


def agreed(fn, *args):
    """``fn(*args)`` on every rank (a local check: no collectives inside); its result when it
    returned on every rank, else a ``ValueError`` on every rank with the message of the lowest
    rank whose ``fn`` raised (chained to this rank's own exception, if any). Collective."""
    result = error = None
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever a check raises, the other ranks must hear of it
        error = e
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())
    if first == world:
        return result
    text = b""
    if rank == first:
        text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        text = text.encode("utf-8", "replace")[:_MESSAGE_LIMIT]
    size = torch.tensor([len(text)], dtype=torch.int64)
    dist.broadcast(size, src=first)
    buf = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.zeros(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(buf, src=first)
    raise ValueError(bytes(buf.tolist()).decode("utf-8", "replace")) from error


# --- optimizer hyper-parameters ---------------------------------------------------------------

_FAMILIES = {type(None): "None", bool: "bool", int: "int", float: "float", str: "str", torch.Tensor: "tensor",
             tuple: "tuple", list: "list", dict: "dict"}
_ABSENT = object()


def _family(value) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    return next((f for t, f in _FAMILIES.items() if type(value) is t), type(value).__name__)


def _spec(annotation):
    """``(families, element annotations of a fixed-length tuple or None)`` that ``annotation``
    allows; None when it says nothing this understands (then the live value's type decides)."""
    if annotation is None or annotation in _FAMILIES:
        return {_FAMILIES[type(None) if annotation is None else annotation]}, None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        families, elements = set(), None
        for arg in typing.get_args(annotation):
            spec = _spec(arg)
            if spec is None:
                return None
            families |= spec[0]
            elements = elements or spec[1]
        return families, elements
    if origin is tuple:
        args = typing.get_args(annotation)
        return {"tuple"}, (list(args) if args and args[-1] is not Ellipsis else None)
    if origin in (list, dict):
        return {origin.__name__}, None
    return None


def _check_value(value, live, annotation, name: str) -> None:
    spec = _spec(annotation) if annotation is not inspect.Parameter.empty else None
    families, elements = spec if spec is not None else (set(), None)
    if live is not _ABSENT:
        families = families | {_family(live)}
        if spec is None and _family(live) == "int":
            families.add("float")  # no annotation: a number's type is the live value's, int or float
    family = _family(value)
    if family not in families and not (family == "int" and "float" in families):
        raise ValueError(f"{name} must be {' or '.join(sorted(families))}, got {family} {value!r:.80}")
    if family in ("int", "float") and not _finite(value) and not _same(value, live):
        raise ValueError(f"{name} must be finite, got {value!r:.80}")
    if family == "tensor":
        if not value.is_floating_point() and not (isinstance(live, torch.Tensor) and live.dtype == value.dtype):
            raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
        if isinstance(live, torch.Tensor) and value.shape != live.shape:
            raise ValueError(f"{name} must keep the optimizer's shape {list(live.shape)}, got {list(value.shape)}")
        if not bool(torch.isfinite(value).all()) and not _same(value, live):
            raise ValueError(f"{name} must be finite, got {value.tolist()!r:.80}")
    if family == "tuple":
        if elements is None:
            elements = [inspect.Parameter.empty] * len(live) if isinstance(live, tuple) else None
        if elements is not None and len(value) != len(elements):
            raise ValueError(f"{name} must have {len(elements)} elements, got {len(value)}: {value!r:.80}")
        lives = list(live) if isinstance(live, tuple) and len(live) == len(value) else [_ABSENT] * len(value)
        for j, (v, lv) in enumerate(zip(value, lives)):
            _check_value(v, lv, elements[j] if elements is not None else inspect.Parameter.empty, f"{name}[{j}]")


def _finite(number) -> bool:
    return abs(number) <= sys.float_info.max if isinstance(number, int) else math.isfinite(number)


def _same(value, live) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(live, torch.Tensor):
        return (isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor) and value.shape == live.shape
                and bool(torch.equal(value.cpu(), live.detach().cpu())))
    try:
        return live is not _ABSENT and type(value) is type(live) and bool(value == live)
    except (RuntimeError, TypeError, ValueError):  # (tuples of tensors)
        return False


def _annotations(cls) -> dict:
    """The optimizer class's ``__init__`` arguments (but ``params``) and their annotations."""
    try:
        params = dict(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - annotations that do not resolve say nothing
        hints = {}
    return {k: hints.get(k, inspect.Parameter.empty) for k, p in params.items()
            if k not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _refusal(cls, like: torch.Tensor, values: dict, arguments: dict):
    """What ``cls`` raises when built with ``values`` (those that are ``__init__`` arguments) on a
    one-element tensor like ``like``; None when it builds."""
    kwargs = {k: v for k, v in values.items() if k in arguments}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls([torch.zeros(1, dtype=like.dtype, device=like.device, requires_grad=True)], **kwargs)
    except (ValueError, TypeError, RuntimeError, AssertionError) as e:
        return e
    return None


def check_param_groups(optimizer: torch.optim.Optimizer, saved: list, where: str) -> list:
    """``saved`` (a checkpoint's param groups' hyper-parameters, one dict per group) when it suits
    the live ``optimizer`` (a torch optimizer, or a :class:`qcoll.zero.Optimizer`: its inner one;
    module docstring); else a ``ValueError`` naming ``where``, the group and the key. Changes nothing."""
    inner = getattr(optimizer, "optimizer", optimizer)
    cls = type(inner)
    arguments = _annotations(cls)
    like = inner.param_groups[0]["params"][0]
    for i, (hp, group) in enumerate(zip(saved, inner.param_groups)):
        live = {k: v for k, v in group.items() if k != "params"}
        unknown = [k for k in hp if k not in live and k not in SCHEDULER_KEYS]
        if unknown:
            raise ValueError(f"{where}[{i}]: unknown hyper-parameter(s) {', '.join(map(repr, unknown))}: "
                             f"{cls.__name__}'s param groups have {', '.join(map(repr, live))}")
        for k, v in hp.items():
            if k in live:
                _check_value(v, live[k], arguments.get(k, inspect.Parameter.empty), f"{where}[{i}][{k!r}]")
            else:  # a scheduler's
                _check_value(v, _ABSENT, float | torch.Tensor, f"{where}[{i}][{k!r}]")
        if _refusal(cls, like, live, arguments) is not None:
            continue  # not buildable from its param groups alone: the class cannot be asked
        error = _refusal(cls, like, {**live, **hp}, arguments)
        if error is not None:
            alone = [k for k in hp if k in arguments and _refusal(cls, like, {**live, k: hp[k]}, arguments)]
            keys = alone[:1] or [k for k in hp if k in arguments and not _same(hp[k], live.get(k, _ABSENT))]
            what = ", ".join(f"[{k!r}] = {hp[k]!r:.40}" for k in keys)
            raise ValueError(f"{where}[{i}]{what}: {cls.__name__} refuses {'it' if len(keys) == 1 else 'them'}: "
                             f"{type(error).__name__}: {error}")
    return saved
