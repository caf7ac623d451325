"""``shard(model)``: ZeRO++ sharding of a module in place (ZeRO-3 with qwZ, hpZ and qgZ).

As FSDP2's ``fully_shard``, :func:`shard` changes the module in place: its class
becomes a subclass of both :class:`ZeroModule` and its own class (``isinstance``,
its methods and attributes keep working: ``generate``, ``config``...), its parameters
keep their identity and live as flat fp32 shards across the world, and hooks gather
each unit's parameters around its forward and backward.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_int
from ..comm import Topology
from ..comm.topology import current_topology
from . import late_params
from .buffers import broadcast_from_rank0
from .config import ZeroConfig
from .engine import Engine
from .flat import FlatGroup
from .replicated import ReplicatedGroup
from .state import MANAGED_ATTR, STATE_ATTR, ZeroState, state_of
from .torch_optim import install_hooks
from .units import build_units


class ZeroModule(nn.Module):
    """The methods :func:`shard` adds to the sharded module's class (a mixin, as FSDP2's
    ``FSDPModule``; never constructed directly).

    Each unit's full parameters exist only during its forward and backward; outside
    them the parameters are empty tensors. ``state_dict()`` returns the full, unsharded
    state dict of the original model (a collective: call it on every rank) and
    ``load_state_dict`` takes one; sharded checkpoints go through
    :func:`qcoll.zero.save` / :func:`qcoll.zero.load`.
    """

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """``DistributedDataParallel`` reads this attribute first when it wraps a module (as the
        Hugging Face Trainer and Accelerate do for a model they were not told is sharded): a
        sharded model refuses the wrap there, at once, instead of failing in autograd later (its
        parameters are empty between units' forwards, and qcoll reduces the gradients itself)."""
        raise TypeError(
            f"{type(self).__name__} is sharded by qcoll.zero.shard and cannot be wrapped in DistributedDataParallel: "
            f"qcoll gathers its parameters and reduces its gradients itself. Train it in a loop of your own "
            f"(loss.backward(); optimizer.step()); with the Hugging Face Trainer, shard with FSDP2 instead (Transformers' "
            f"DistributedConfig, or Accelerate's FSDP2 plugin) and pass callbacks=[qcoll.integrations.hf."
            f"QuantizeCommCallback()] (qcoll.integrations.hf has both recipes)")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: inside, backward keeps the
        full gradients on the parameters; the first backward outside reduces them
        together with its own (as DDP's ``no_sync``; costs a full gradient's memory)."""
        engine = state_of(self).engine
        previous = engine.sync_grads
        engine.sync_grads = False
        try:
            yield
        finally:
            engine.sync_grads = previous

    @contextlib.contextmanager
    def generation_mode(self, max_cached_bytes: int | None = 0):
        """Inference without backward (e.g. ``model.generate``) that keeps the gathered weights
        (within ``max_cached_bytes``) or the hpZ secondary shards.

        Usage (every rank, same prompt)::

            with model.generation_mode(max_cached_bytes=2**30) as gen:
                tokens = model.generate(prompt, max_new_tokens=64, do_sample=False)
            print(gen.forwards, gen.inter_node_bytes_per_forward)

        Outside the mode a forward without gradients gathers every unit's weights over the
        world each time (with qwZ quantized), so each generated token moves the whole model
        across nodes. Inside it, each group's first gather is the usual qwZ all-gather and
        keeps this rank's hpZ secondary shard (the packed bytes it receives anyway, frozen
        groups too); every later forward gathers from the kept shards inside the node
        (``replica_gather``), so after the first forward no weight bytes cross nodes. The
        weights are the same quantized bytes in every forward, so the tokens are the ones the
        model gives without the mode. The secondary shards are released on exit, also when
        the block raises; memory while inside: ``params / ranks_per_node x weight_bits / 8``
        bytes per rank (``qcoll.zero.memory_report(model)["secondary"]``).

        ``max_cached_bytes`` (per rank; default 0, None: no limit): the groups (in the model's
        order) whose full weights fit in it are instead kept *gathered* from their first forward
        to the end of the block, as DeepSpeed's hybrid engine keeps the gathered weights for
        generation: the forwards after the first then gather and dequantize nothing, and run at
        the unsharded model's speed when the whole model fits (``params x`` the compute dtype's
        bytes, e.g. 4 per parameter in fp32). Same weights, same tokens. ``gen.cached_bytes``
        says what the cache held, ``gen.cached_groups`` of ``gen.groups`` groups.

        Without hpZ (``ZeroConfig(hpz=False)``, e.g. ``ZeroConfig.zero3()``) there is nothing
        to keep: the mode is valid and gathers as usual, over the world, and still counts.

        The block runs under ``torch.no_grad()`` (Hugging Face ``generate`` adds its own).
        Returns (``as``) a :class:`qcoll.zero.GenerationStats`: per forward the bytes this rank
        handed to inter-node and intra-node groups and the seconds, ``forwards``, totals and
        ``summary()`` (first forward and mean after it: bytes per token).

        Rules: the mode does not nest, and it cannot be entered inside a forward or backward of
        the model (``RuntimeError``). A backward inside the block raises ``RuntimeError`` (autograd
        may have freed part of that graph: run its forward again after the block). A forward with gradients whose backward is still pending may
        precede the block: its secondary shards are set aside, put back on exit, and its
        backward runs after the block as it would have without it. An optimizer step (or
        ``load_state_dict``) inside the block is allowed: the kept shards of the changed
        groups are stale, so the next forward drops them and gathers those groups across nodes
        again (counted in ``refreshed``). A collective: every rank enters and leaves the
        block together and runs the same forwards in it.
        """
        if max_cached_bytes is not None:
            check_int(max_cached_bytes, "max_cached_bytes", minimum=0)
        engine = state_of(self).engine
        stats = engine.begin_generation(max_cached_bytes)
        try:
            with torch.no_grad(), torch.autograd.profiler.record_function("qcoll.zero::generation_mode"):
                yield stats
        finally:
            engine.end_generation()

    def __deepcopy__(self, memo):
        raise TypeError(f"a {type(self).__name__} sharded by qcoll.zero.shard cannot be deep-copied (its "
                        "parameters live as shards across ranks); copy the plain model before sharding, or "
                        "load model.state_dict() into a new one")

    def _apply(self, fn, recurse: bool = True):
        """Conversions that would change a parameter's or buffer's dtype or device (``.to(dtype)``,
        ``.half()``, ``.bfloat16()``, ``.double()``, ``.to(device)``) are refused with a TypeError:
        the parameters live as fp32 master shards, and the forward's dtype is
        ``ZeroConfig(compute_dtype=...)``. Conversions that change nothing (``.float()`` of an fp32
        model, ``.to`` its own device) are allowed and do nothing."""
        changes = []
        tensors = [(name, dtype, g.master.device) for g in state_of(self).groups
                   for name, dtype in zip(g.names, g.orig_dtypes)]
        tensors += [(name, b.dtype, b.device) for name, b in self.named_buffers()]
        for name, dtype, device in tensors:
            out = fn(torch.empty(0, dtype=dtype, device=device))
            if out.dtype != dtype or out.device != device:
                changes.append(f"{name!r} from {dtype}/{device} to {out.dtype}/{out.device}")
        if changes:
            raise TypeError(f"qcoll.zero: this conversion would change {changes[0]}"
                            f"{f' (and {len(changes) - 1} more)' if len(changes) > 1 else ''} after sharding; a "
                            "sharded model keeps fp32 master shards and computes in the dtype of "
                            "ZeroConfig(compute_dtype=...): pass ZeroConfig(compute_dtype=torch.bfloat16) (or float16) "
                            "to qcoll.zero.shard, and convert or move the model before sharding it")
        return self

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of parameters, each sharded parameter counted whole (as Hugging Face's
        ``PreTrainedModel.num_parameters``, which this replaces on a sharded model)."""
        skip = set()
        if exclude_embeddings:
            skip = {f"{name}.weight" for name, m in self.named_modules() if isinstance(m, nn.Embedding)}
        return sum(getattr(p, "ds_numel", p.numel()) for name, p in self.named_parameters()
                   if name not in skip and (p.requires_grad or not only_trainable))

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__name__} sharded by qcoll.zero.shard cannot be pickled; save "
                        "model.state_dict() or use qcoll.zero.save")

    def _plain_state_dict(self) -> dict:
        """The state dict of the module's own class, with the (released) parameters as they are."""
        return super(ZeroModule, self).state_dict(keep_vars=True)

    # ------------------------------------------------------------------ full state dict
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full (unsharded) state dict of the original model, parameters in their
        original dtype, on every rank (a collective over the world). Tied parameters
        stay one tensor under each of their keys. Buffers are rank 0's on every rank (copies;
        with ``keep_vars=True`` each rank's own)."""
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args):])
        state = state_of(self)
        values = {}
        for g in state.groups:  # one group's gather at a time
            full = g.gather_full_fp32()
            for p, off, n, shape, dtype in zip(g.params, g.offsets, g.numels, g.shapes, g.orig_dtypes):
                values[id(p)] = full[off:off + n].view(shape).to(dtype, copy=True)
            del full
        out = {} if destination is None else destination
        copies = []
        for key, value in self._plain_state_dict().items():
            if id(value) not in values:
                values[id(value)] = value if keep_vars else value.detach().clone()
                if not keep_vars:
                    copies.append(values[id(value)])
            out[prefix + key] = values[id(value)]
        broadcast_from_rank0(copies)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (as :meth:`state_dict` returns, or the plain model's).

        A collective: call it on every rank with the same keys. With ``strict=False`` the
        parameters that ``state_dict`` leaves out keep their values."""
        if assign:
            raise ValueError("assign=True is not supported by a module sharded by qcoll.zero.shard")
        state = state_of(self)
        managed = state.managed()
        own = self._plain_state_dict()
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
                    fulls[g.index] = g.gather_full_fp32()
                fulls[g.index][g.offsets[i]: g.offsets[i] + g.numels[i]].copy_(value.reshape(-1))
            else:
                with torch.no_grad():
                    target.copy_(value)
        for g in state.groups:
            if g.index in fulls:
                g.load_full_fp32(fulls[g.index])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


#: The name of :class:`ZeroModule` in earlier releases (a wrapper then; the module itself now).
ShardedModel = ZeroModule

_classes: dict[type, type] = {}


def _zero_class(cls: type) -> type:
    """A subclass of :class:`ZeroModule` and ``cls`` (one per class), under ``cls``'s own name:
    what records the class by name (Hugging Face's ``config.architectures``) records the user's."""
    if cls not in _classes:
        _classes[cls] = type(cls.__name__, (ZeroModule, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _classes[cls]


def _check_not_sharded(model: nn.Module) -> None:
    if isinstance(model, ZeroModule):
        raise ValueError(f"model is already sharded by qcoll.zero.shard (its class is {type(model).__name__}); "
                         "shard a module once")
    for name, p in model.named_parameters():
        if getattr(p, MANAGED_ATTR, False):
            raise ValueError(f"parameter {name!r} is already managed by qcoll.zero.shard (a submodule or a parent "
                             "of this model was sharded); shard one module, once, and name its parts with units=")


def _build_state(model: nn.Module, topology: Topology, config: ZeroConfig, units, sync_module_states: bool):
    unit_list = build_units(model, units)
    groups, group_of = [], {}

    def add(cls, name, params):
        g = cls(name, len(groups), params, topology, config, sync_module_states)
        groups.append(g)
        for _, p in params:
            group_of[id(p)] = g
            setattr(p, MANAGED_ATTR, True)

    # decided before any group is built (a built group's parameters are released: numel 0)
    persistent = {id(p) for u in unit_list for _, p in u.owned if p.numel() < config.persist_threshold}
    small = lambda p: id(p) in persistent  # noqa: E731
    for u in unit_list:
        trainable = [(n, p) for n, p in u.owned if p.requires_grad and not small(p)]
        frozen = [(n, p) for n, p in u.owned if not p.requires_grad and not small(p)]
        for params, suffix in ((trainable, ""), (frozen, ".frozen")):
            if params:
                add(FlatGroup, u.label + suffix, params)
    owned = [(n, p) for u in unit_list for n, p in u.owned if small(p)]
    for params, name in (([(n, p) for n, p in owned if p.requires_grad], "<persistent>"),
                         ([(n, p) for n, p in owned if not p.requires_grad], "<persistent>.frozen")):
        if params:
            add(ReplicatedGroup, name, params)
    for u in unit_list:
        u.groups = list(dict.fromkeys(group_of[id(p)] for p in u.used))
    state = ZeroState(topology, config, unit_list, groups, Engine(model, unit_list, groups, config))
    state.engine.adopt_new_parameters = functools.partial(late_params.adopt, model, state)
    return state


def shard(model: nn.Module, topology: Topology | None = None, config: ZeroConfig | None = None, units=None,
          sync_module_states: bool = True) -> nn.Module:
    """Shard ``model``'s parameters over the world, ZeRO-3 style, with ZeRO++'s qwZ/hpZ/qgZ.

    ``topology``: a :class:`qcoll.Topology` (default: the last one constructed, else a
    new one from ``LOCAL_WORLD_SIZE``). ``config``: a :class:`ZeroConfig` (default:
    8-bit weights, hpZ, 4-bit gradients). ``units``: the submodules gathered as one
    (default: the repeated blocks: the classes in ``model._no_split_modules`` where
    the model names them, as Hugging Face models do, else the entries of every
    ``ModuleList``/``ModuleDict``, else each direct child with parameters; or a list
    of submodules, or of module classes); parameters outside every unit form the
    root unit, gathered for the whole forward. With ``sync_module_states`` rank 0's
    initial values are broadcast.

    Returns ``model`` itself, changed in place as FSDP2's ``fully_shard`` does: its
    class becomes ``Zero<its class>``, a subclass of :class:`ZeroModule` and of its
    own class. Its parameters keep their identity; outside their unit's forward and
    backward they are empty tensors (numel 0; read values with ``state_dict()``).
    Step it with :class:`qcoll.zero.Optimizer`. ``torch.compile(model)`` and
    compiling blocks before sharding both work (the gathers run between graphs).
    Call on every rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_not_sharded(model)
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
    config.check_topology(topology)
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters to shard")
    install_hooks()
    state = _build_state(model, topology, config, units, sync_module_states)
    model.__class__ = _zero_class(type(model))
    model.__dict__[STATE_ATTR] = state
    return model
