"""``ShardedGrad``: what ``p.grad`` of a sharded parameter holds after a backward.

A parameter managed by :func:`qcoll.zero.shard` is empty outside its unit's forward and
backward (numel 0, as DeepSpeed ZeRO-3's), and its reduced gradient lives as this rank's
fp32 slice of the group's ``master.grad``. After each synchronised backward every trainable
parameter's ``.grad`` is a :class:`ShardedGrad`: an empty tensor (the parameter's shape and
dtype, as ``.grad`` must be) that stands for that slice, so that what FSDP/DDP users do with
``.grad`` does the same thing here:

- **norms** (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``, ``torch.linalg.vector_norm``,
  ``Tensor.norm``, ``torch._foreach_norm``): the norm of the parameter's *whole* gradient, over
  every rank (one all-reduce per call; a whole list in one, as DTensor's). Collective: every rank
  makes the same calls. A replicated group's gradient (whole on every rank) is counted once.
- **in-place elementwise updates** with scalars (``mul_``, ``div_``, ``zero_``, ``clamp_``,
  ``nan_to_num_`` and their ``_foreach_`` forms: ``clip_grad_norm_``'s scaling,
  ``clip_grad_value_``, ``zero_grad(set_to_none=False)``): applied to the slice.
- **metadata** (``shape``, ``dtype``, ``device``, ``is_sparse``...) answers for the empty tensor.
- **anything else** (reading values, arithmetic that makes a new tensor, AMP's unscale) raises a
  ``TypeError`` that says so: never a silent answer computed from an empty tensor or from this
  rank's slice alone.

``p.grad = None`` (``model.zero_grad()``, a torch optimizer's ``zero_grad()``) clears that
parameter's slice of ``master.grad``; the group notices at its next use
(:meth:`qcoll.zero.flat.FlatGroup.sync_user_grads`).

The class is added to ``torch.utils._foreach_utils._foreach_supported_types`` (as DTensor adds
itself), so ``clip_grad_norm_`` hands it whole lists: one all-reduce per call, not one per
parameter.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils import _foreach_utils

from ..comm.stats import stats

_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm}
_INPLACE = {torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.zero_, torch.Tensor.clamp_, torch.Tensor.clamp_min_,
            torch.Tensor.clamp_max_, torch.Tensor.nan_to_num_, torch.clamp_, torch.clamp_min_, torch.clamp_max_,
            torch.nan_to_num_, torch.zero_}
_FOREACH_INPLACE = {torch._foreach_mul_, torch._foreach_div_, torch._foreach_zero_, torch._foreach_clamp_min_,
                    torch._foreach_clamp_max_}
_METADATA = {"size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point", "is_complex",
             "get_device", "requires_grad_", "detach_", "is_contiguous", "__get__", "__set__"}


#: Properties that would give values of the gradient (refused; ``.data`` gives the stand-in itself).
_VALUE_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}


def _name(func) -> str:
    return getattr(func, "__name__", repr(func))


class ShardedGrad(torch.Tensor):
    """``p.grad`` of a parameter sharded by qcoll.zero: stands for this rank's slice of its
    reduced fp32 gradient (see the module docstring for what it supports)."""

    _qcoll_group = None
    _qcoll_index = -1

    @staticmethod
    def make(group, index: int, like: torch.Tensor) -> "ShardedGrad":
        """The stand-in for parameter ``index`` of ``group``: ``like``'s shape (empty when released;
        a replicated group's parameters are whole), dtype and device, one element of storage."""
        base = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        proxy = torch.Tensor._make_subclass(ShardedGrad, base)
        proxy._qcoll_group, proxy._qcoll_index = group, index
        return proxy

    def values(self) -> torch.Tensor:
        """This rank's slice of the parameter's gradient (a fp32 view of ``master.grad``)."""
        return self._qcoll_group.grad_slice(self._qcoll_index)

    def param_shape(self) -> torch.Size:
        """The shape of the parameter (and of its whole gradient)."""
        return self._qcoll_group.shapes[self._qcoll_index]

    def __repr__(self, *, tensor_contents=None):
        g = self._qcoll_group
        return (f"ShardedGrad(parameter={g.names[self._qcoll_index]!r}, group={g.name!r}, "
                f"local_numel={self.values().numel()})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__get__":  # a property: .data stands for the same slice; values (.T, .real) do not exist
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "data":
                return args[0]
            if prop in _VALUE_PROPERTIES:
                name = prop
        if name in _METADATA or name == "__repr__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch._foreach_norm:
            return _norms(list(args[0]), *args[1:], **kwargs)
        if func is torch.linalg.norm:
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord")
            if ord_ is not None and len(args[0].param_shape()) > 1:
                raise TypeError(f"qcoll.zero: torch.linalg.norm(ord={ord_!r}) of a matrix parameter's sharded .grad "
                                "(a matrix norm) is not supported; use torch.linalg.vector_norm")
        if func in _NORMS:
            return _norms([args[0]], *args[1:], **kwargs)[0]
        if func in _INPLACE and isinstance(args[0], ShardedGrad):
            rest = [a.values() if isinstance(a, ShardedGrad) else a for a in args[1:]]
            func(args[0].values(), *rest, **kwargs)
            return args[0]
        if func in _FOREACH_INPLACE:
            func([t.values() if isinstance(t, ShardedGrad) else t for t in args[0]], *args[1:], **kwargs)
            return None
        raise TypeError(
            f"qcoll.zero: {name}() on the .grad of a sharded parameter: after a backward, .grad of a parameter "
            "sharded by qcoll.zero.shard stands for this rank's slice of its gradient, which lives in fp32 shards "
            "across ranks. It supports the norms (torch.nn.utils.clip_grad_norm_, torch.linalg.vector_norm), "
            "in-place scaling (mul_, div_, zero_, clamp_: clip_grad_value_, zero_grad) and metadata, and steps "
            "with any elementwise torch optimizer or qcoll.zero.Optimizer; other uses of its values are not "
            "supported")


if ShardedGrad not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.append(ShardedGrad)


def _norm_order(ord_, kwargs) -> float:
    if kwargs.get("dim") is not None:
        raise TypeError("qcoll.zero: a norm of a sharded parameter's .grad over dim= is not supported (only the "
                        "norm of the whole gradient)")
    if ord_ in (None, "fro"):
        return 2.0
    if isinstance(ord_, str) or isinstance(ord_, bool) or not isinstance(ord_, (int, float)):
        raise TypeError(f"qcoll.zero: norm order {ord_!r} of a sharded parameter's .grad is not supported "
                        "(a number, inf or -inf)")
    return float(ord_)


def _norms(tensors: list, ord_=2.0, *args, **kwargs) -> list[torch.Tensor]:
    """The norms of the whole gradients that ``tensors`` (ShardedGrads) stand for: one
    all-reduce of their local contributions (SUM, or MAX/MIN for +-inf) over the world."""
    for key in ("p", "ord"):
        if key in kwargs:
            ord_ = kwargs.pop(key)
    if args and args[0] is not None:
        raise TypeError("qcoll.zero: a norm of a sharded parameter's .grad over dim= is not supported (only the "
                        "norm of the whole gradient)")
    p = _norm_order(ord_, kwargs)
    out_dtype = kwargs.get("dtype") or torch.float32
    for t in tensors:
        if not isinstance(t, ShardedGrad):
            raise TypeError("qcoll.zero: a norm over a list mixing sharded parameters' .grad with other tensors; "
                            "compute them apart")
    if not tensors:
        return []
    local = torch.zeros(len(tensors), dtype=torch.float64)
    for k, t in enumerate(tensors):
        x = t.values().detach().double().abs()
        if p == math.inf:
            local[k] = x.max() if x.numel() else 0.0
        elif p == -math.inf:
            local[k] = x.min() if x.numel() else math.inf
        elif p == 0:
            local[k] = (x != 0).sum()
        else:
            local[k] = x.pow(p).sum()
    sharded = torch.tensor([not t._qcoll_group.replicated for t in tensors])
    if bool(sharded.any()) and dist.is_initialized() and dist.get_world_size() > 1:
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.MIN if p == -math.inf else dist.ReduceOp.SUM
        part = local[sharded].contiguous()
        stats.add("grad_norm_all_reduce", None, part.numel() * part.element_size())
        dist.all_reduce(part, op=op)
        local[sharded] = part
    if p not in (0.0, math.inf, -math.inf):
        local = local.pow(1.0 / p)
    device = tensors[0].device
    return [local[k].to(dtype=out_dtype, device=device) for k in range(len(tensors))]
