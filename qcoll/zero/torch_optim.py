"""A torch optimizer built on ``model.parameters()`` of a sharded model steps its shards.

FSDP/DDP users write ``torch.optim.AdamW(model.parameters())``. Here the parameters are empty
outside their unit's forward and backward; their values are this rank's slices of fp32 master
shards. Torch's global optimizer-step hooks (``register_optimizer_step_pre_hook`` /
``..._post_hook``, registered once by :func:`install_hooks`) make every managed parameter of
the stepping optimizer a 1-D view of its master slice, with ``.grad`` the matching slice of the
reduced gradient, for the duration of ``step()`` (:func:`qcoll.zero.user_grads.expose`), and
empty again afterwards. An elementwise update rule makes exactly the update it makes on the
whole tensor; optimizer state is created per shard (memory divided by the world, as ZeRO's).

Optimizers whose update of an element reads other elements of the parameter (a norm, a
row/column statistic, a line search) would silently compute on the shard: torch's own are
refused by name (:data:`NOT_ELEMENTWISE`), and a class that torch does not ship gets one
warning. Stepping while the model is inside a forward or backward is a ``RuntimeError``.
"""
from __future__ import annotations

import warnings

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import user_grads

#: torch.optim classes whose update of an element depends only on that element's own history.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD", "NAdam", "RAdam"}
#: torch.optim classes that need the whole tensor (or all parameters) at once.
NOT_ELEMENTWISE = {"LBFGS": "its line search takes dot products over all parameters",
                   "Adafactor": "it factors the second moment over each parameter's rows and columns",
                   "SparseAdam": "it needs sparse gradients",
                   "Muon": "it orthogonalises each 2-D parameter as a whole"}

_hooks = []
_warned: set = set()


def _managed(optimizer) -> list:
    slots = []
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            slot = getattr(p, user_grads.SLOT_ATTR, None)
            if slot is not None:
                slots.append(slot)
    return slots


def _check_class(optimizer) -> None:
    cls = type(optimizer)
    name = cls.__name__
    if cls.__module__.startswith("torch.optim"):
        if name in NOT_ELEMENTWISE:
            raise TypeError(f"torch.optim.{name} cannot step the parameters of a model sharded by qcoll.zero.shard: "
                            f"{NOT_ELEMENTWISE[name]}, and each rank holds a 1-D slice of each parameter. Use an "
                            f"elementwise optimizer ({', '.join(sorted(ELEMENTWISE))})")
        return
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(f"qcoll.zero: {cls.__module__}.{name} steps the parameters of a sharded model: each rank's "
                      "step sees 1-D slices of the parameters, which is exact for elementwise update rules (as "
                      "AdamW's) and wrong for rules that read a whole parameter (norms, row/column statistics)",
                      stacklevel=4)


def _pre_step(optimizer, args, kwargs):
    slots = _managed(optimizer)
    if not slots:
        return None
    _check_class(optimizer)
    engines = {id(g.engine): g.engine for g, _ in slots if g.engine is not None}
    for engine in engines.values():
        if engine.in_backward or engine.in_forward:
            raise RuntimeError(f"{type(optimizer).__name__}.step() inside a forward or backward of a model sharded "
                               "by qcoll.zero.shard; step after the backward")
        engine.wait_reduces()
    for g, i in slots:
        user_grads.expose(g, i)
    return None


def _post_step(optimizer, args, kwargs) -> None:
    groups = {id(g): g for g, _ in _managed(optimizer)}
    for g in groups.values():
        user_grads.conceal(g)


def install_hooks() -> None:
    """Register the global optimizer-step hooks (once per process)."""
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_pre_step))
        _hooks.append(register_optimizer_step_post_hook(_post_step))
