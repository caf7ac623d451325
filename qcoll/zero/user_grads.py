"""What torch code outside qcoll sees of a group's gradients and shards, between steps.

After a synchronised backward each trainable parameter's ``.grad`` is a
:class:`~qcoll.zero.grad_proxy.ShardedGrad` standing for its slice of the group's reduced
``master.grad`` (:func:`install`). The user's ``zero_grad`` (``p.grad = None``) clears that
slice (:func:`sync`, run at the group's next use of its gradients). Before autograd accumulates
into the parameters again the stand-ins are taken off (:func:`release`; the values stay in
``master.grad``, to which the next reduction adds, as DDP accumulates into ``.grad``).

A torch optimizer built on ``model.parameters()`` steps the shards: during its ``step`` each
managed parameter is a 1-D view of this rank's elements of the fp32 master and its ``.grad``
the matching view of ``master.grad`` (:func:`expose`), and afterwards empty again with its
stand-in back (:func:`conceal`). An elementwise update rule (SGD, Adam, AdamW...) then makes
exactly the update it makes on the whole tensor. :mod:`qcoll.zero.torch_optim` calls these from
torch's global optimizer-step hooks.
"""
from __future__ import annotations

import torch

from .grad_proxy import ShardedGrad

#: The attribute of a managed parameter that says where it lives: ``(group, index)``.
SLOT_ATTR = "_qcoll_zero_slot"


def install(g) -> None:
    """After the backward's reductions reached ``g.master.grad``: every trainable parameter
    without a ``.grad`` gets its stand-in."""
    if g.master.grad is None:
        return
    for i, p in enumerate(g.params):
        if p.requires_grad and p.grad is None:
            g.proxies[i] = ShardedGrad.make(g, i, p)
            p.grad = g.proxies[i]


def sync(g) -> None:
    """Take the user's changes to ``.grad`` since :func:`install`: a parameter whose ``.grad`` was
    set to None has its slice of ``master.grad`` zeroed (all of them: ``master.grad = None``)."""
    cleared = [i for i, proxy in g.proxies.items() if i not in g.exposed and g.params[i].grad is not proxy]
    for i in cleared:
        grad = g.params[i].grad
        if grad is not None:
            raise ValueError(f"qcoll.zero: the .grad of parameter {g.names[i]!r} was replaced by a "
                             f"{type(grad).__name__} of shape {tuple(grad.shape)}; the gradient of a sharded "
                             "parameter lives in fp32 shards: scale it in place (mul_, clip_grad_norm_) or set it "
                             "to None")
        del g.proxies[i]
        if g.master.grad is not None:
            g.grad_slice(i).zero_()
    if cleared and not g.proxies:
        g.master.grad = None


def release(g) -> None:
    """Before autograd accumulates into ``g``'s parameters (or their gradients are taken):
    :func:`sync`, then take the stand-ins off."""
    conceal(g)
    sync(g)
    for i, proxy in g.proxies.items():
        if g.params[i].grad is proxy:
            g.params[i].grad = None
    g.proxies.clear()


def expose(g, i: int) -> None:
    """Parameter ``i`` becomes a 1-D view of this rank's elements of the fp32 master, its
    ``.grad`` the matching view of ``master.grad`` (None when it had no stand-in)."""
    if i in g.exposed:
        return
    sync(g)
    p = g.params[i]
    had_grad = i in g.proxies
    if p.grad is not None and not had_grad:
        raise RuntimeError(f"qcoll.zero: parameter {g.names[i]!r} holds a gradient that was never reduced (a "
                           "backward inside model.no_sync()); run the last micro-batch's backward outside no_sync() "
                           "before the optimizer steps")
    p.grad = None
    p.data = g.master_slice(i)
    if had_grad:
        p.grad = g.grad_slice(i)
    g.exposed[i] = had_grad


def conceal(g) -> None:
    """Undo :func:`expose` for every exposed parameter of ``g``: the parameters as the group's
    state has them (empty when released), the stand-ins back; the master counts as changed (a
    kept hpZ secondary or a replicated copy made from it is stale)."""
    if not g.exposed:
        return
    exposed, g.exposed = g.exposed, {}
    for i, had_grad in exposed.items():
        p = g.params[i]
        p.grad = None
        p.data = g.current_data(i)
        if had_grad and i in g.proxies:
            p.grad = g.proxies[i]
    torch.autograd.graph.increment_version(g.master)
    g.master_changed()
