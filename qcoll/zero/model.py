"""``shard(model)``: the ZeRO++ sharded model (ZeRO-3 with qwZ, hpZ and qgZ)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from ..comm import Topology
from ..comm.topology import current_topology
from .config import ZeroConfig
from .engine import Engine
from .flat import FlatGroup
from .units import build_units


class ShardedModel(nn.Module):
    """A model whose parameters live as flat fp32 shards across the world.

    Made by :func:`shard`; call it like the original model. Each unit's full
    parameters exist only during its forward and backward. ``state_dict()`` returns
    the full, unsharded state dict of the original model (a collective: call it on
    every rank) and ``load_state_dict`` takes one; sharded checkpoints go through
    :func:`qcoll.zero.save` / :func:`qcoll.zero.load`.
    """

    def __init__(self, module: nn.Module, topology: Topology, config: ZeroConfig, units, sync_module_states: bool):
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = config
        unit_list = build_units(module, units)
        groups, group_of = [], {}
        for u in unit_list:
            trainable = [(n, p) for n, p in u.owned if p.requires_grad]
            frozen = [(n, p) for n, p in u.owned if not p.requires_grad]
            for params, suffix in ((trainable, ""), (frozen, ".frozen")):
                if params:
                    g = FlatGroup(u.label + suffix, len(groups), params, topology, config, sync_module_states)
                    groups.append(g)
                    for _, p in params:
                        group_of[id(p)] = g
        for u in unit_list:
            seen = []
            for p in u.used:
                g = group_of[id(p)]
                if g not in seen:
                    seen.append(g)
            u.groups = seen
        self.units = unit_list
        self.groups = groups
        self.engine = Engine(unit_list, groups, config)

    def forward(self, *args, **kwargs):
        dtype = self.config.compute_dtype
        if dtype is not None:
            cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map_only(torch.Tensor, cast, (args, kwargs))
        self.engine.begin_forward()
        failed = True
        try:
            out = self.module(*args, **kwargs)
            failed = False
        finally:
            self.engine.end_forward(failed)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: inside, backward keeps the
        full gradients on the parameters; the first backward outside reduces them
        together with its own (as DDP's ``no_sync``; costs a full gradient's memory)."""
        previous = self.engine.sync_grads
        self.engine.sync_grads = False
        try:
            yield
        finally:
            self.engine.sync_grads = previous

    def trainable_masters(self) -> list[nn.Parameter]:
        return [g.master for g in self.groups if g.trainable]

    # ------------------------------------------------------------------ full state dict
    def _managed(self) -> dict[int, tuple[FlatGroup, int]]:
        return {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}

    def state_dict(self, *args, **kwargs):
        """The full (unsharded) state dict of the original model, fp32 parameters in
        their original dtype, on every rank (a collective over the world)."""
        managed = self._managed()
        fulls = {g.index: g.gather_full_fp32() for g in self.groups}
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in managed:
                g, i = managed[id(value)]
                flat = fulls[g.index][g.offsets[i]: g.offsets[i] + g.numels[i]]
                out[key] = flat.view(g.shapes[i]).to(g.orig_dtypes[i]).clone()
            else:
                out[key] = value.detach().clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (as :meth:`state_dict` returns, or the plain model's).

        A collective: call it on every rank with the same keys. With ``strict=False`` the
        parameters that ``state_dict`` leaves out keep their values."""
        if assign:
            raise ValueError("assign=True is not supported by a ShardedModel")
        managed = self._managed()
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
        fulls = {}
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if id(target) in managed:  # a released parameter is empty: its shape is the group's record
                g, i = managed[id(target)]
                shape = g.shapes[i]
            else:
                shape = target.shape
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict[{key!r}] must be a tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(shape)}")
            if id(target) in managed:
                g, i = managed[id(target)]
                if g.index not in fulls:  # start from the current values: keys not given keep theirs
                    fulls[g.index] = g.gather_full_fp32().clone()
                fulls[g.index][g.offsets[i]: g.offsets[i] + g.numels[i]].copy_(value.reshape(-1))
            else:
                with torch.no_grad():
                    target.copy_(value)
        for g in self.groups:
            if g.index in fulls:
                g.load_full_fp32(fulls[g.index])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def shard(model: nn.Module, topology: Topology | None = None, config: ZeroConfig | None = None, units=None,
          sync_module_states: bool = True) -> ShardedModel:
    """Shard ``model``'s parameters over the world, ZeRO-3 style, with ZeRO++'s qwZ/hpZ/qgZ.

    ``topology``: a :class:`qcoll.Topology` (default: the last one constructed, else a
    new one from ``LOCAL_WORLD_SIZE``). ``config``: a :class:`ZeroConfig` (default:
    8-bit weights, hpZ, 4-bit gradients). ``units``: the submodules gathered as one
    (default: each direct child with parameters; or a list of submodules, or of
    module classes); parameters outside every unit form a root unit. With
    ``sync_module_states`` rank 0's initial values are broadcast.

    The model's parameters are taken over in place: outside their unit's forward and
    backward they are empty tensors (numel 0; read values with ``state_dict()``); use
    the returned :class:`ShardedModel` and :class:`qcoll.zero.Optimizer`.
    Call on every rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModel):
        raise ValueError("model is already sharded")
    if config is None:
        config = ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a qcoll.zero.ZeroConfig, got {type(config).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("qcoll.zero.shard needs torch.distributed to be initialized first")
    if topology is None:
        topology = current_topology() or Topology()
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a qcoll Topology, got {type(topology).__name__}")
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters to shard")
    return ShardedModel(model, topology, config, units, sync_module_states)
