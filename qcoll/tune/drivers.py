"""What :class:`qcoll.tune.AutoTune` drives: a model sharded by ``qcoll.zero.shard`` or an FSDP2 model
with ``qcoll.fsdp.quantize_comm``. Each driver reads the configuration the model runs, says which
configurations it can run, switches to one between steps, and measures the codec's error on the
model's live tensors; AutoTune's policy, budgets and decisions are the same for both.

Configurations are :class:`~qcoll.zero.ZeroConfig` values for both engines: on FSDP2 the fields
``quantize_comm`` has (``weight_bits``, ``grad_bits``, ``weight_block``, ``grad_block``, ``hpz``,
``grad_hadamard``, ``grad_error_feedback``, ``grad_feedback_beta``; :data:`qcoll.tune.emit.QUANTIZE_COMM_ARGS`).
"""
from __future__ import annotations

import torch.nn as nn

from ..zero.config import ZeroConfig
from ..zero.reconfigure import FIXED_FIELDS, layout_allows, reconfigure
from ..zero.state import state_of
from .emit import QUANTIZE_COMM_ARGS
from .live_error import relative_errors, shard_errors
from .space import Knob, Space, online_space


class ZeroDriver:
    """``qcoll.zero``: :func:`qcoll.zero.reconfigure` switches, :mod:`qcoll.tune.live_error` measures."""

    engine = "qcoll.zero"
    #: the ZeroConfig fields a space may switch on this engine
    knob_fields = frozenset(ZeroConfig.__dataclass_fields__)

    def __init__(self, model):
        self.model = model
        self.state = state_of(model)   # a TypeError unless qcoll.zero.shard sharded it

    @property
    def config(self) -> ZeroConfig:
        return self.state.config

    def default_space(self) -> Space:
        return online_space(feedback=bool(self.config.grad_error_feedback))

    def allows(self, config: ZeroConfig) -> bool:
        return layout_allows(self.model, config)

    def apply(self, config: ZeroConfig) -> None:
        reconfigure(self.model, config)

    def errors(self, config: ZeroConfig) -> tuple[float, float]:
        return relative_errors(self.model, config.weight_bits, config.grad_bits, config.weight_block, config.grad_block)

    def check(self, config: ZeroConfig, where: str) -> None:
        config.check_topology(self.state.topology)
        for name in FIXED_FIELDS:   # (what reconfigure refuses; a space with such a knob)
            if getattr(config, name) != getattr(self.config, name):
                raise ValueError(f"{where} changes {name}, fixed at shard()")

    def owner(self):
        return getattr(self.state, "autotune", None)

    def claim(self, autotune) -> None:
        self.state.autotune = autotune


#: AutoTune's default space on FSDP2 (``quantize_comm``'s wire format: weight and gradient widths; blocks
#: and hpZ stay as installed). 12 configurations, 15 with error feedback (2-bit gradients).
FSDP_KNOBS = [Knob("weight_bits", (4, 8, None)), Knob("grad_bits", (4, (8, 4), 8, None))]


class FsdpDriver:
    """FSDP2 with ``qcoll.fsdp.quantize_comm``: :func:`qcoll.fsdp.reconfigure_comm` switches; the errors
    are measured on each rank's local shards (``DTensor.to_local``) of the parameters and of their
    gradients, as ``qcoll.zero``'s on its master shards."""

    engine = "FSDP2"
    _OWNER = "_qcoll_autotune"
    #: the ZeroConfig fields a space may switch on this engine: quantize_comm's, but hpz (reshard_after_forward)
    knob_fields = frozenset(QUANTIZE_COMM_ARGS) - {"hpz"}

    def __init__(self, model: nn.Module):
        from ..fsdp import comm_settings
        self.model = model
        self._settings = comm_settings   # a TypeError when quantize_comm did not run on this module
        comm_settings(model)

    @property
    def config(self) -> ZeroConfig:
        s = self._settings(self.model)
        return ZeroConfig(**{field: s[arg] for field, arg in QUANTIZE_COMM_ARGS.items()})

    def default_space(self) -> Space:
        """``FSDP_KNOBS`` (2-bit gradients too with error feedback); on HSDP the gradient widths alone
        (its weights never cross nodes: quantize_comm leaves their gathers as FSDP2's own)."""
        knobs = FSDP_KNOBS
        if self.config.grad_error_feedback:
            knobs = [knobs[0], Knob("grad_bits", (2, *knobs[1].values))]
        if self._hsdp():
            knobs = knobs[1:]
        return Space(list(knobs))

    def _hsdp(self) -> bool:
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
        from ..fsdp.install import fsdp_groups
        return any(isinstance(g.mesh_info, HSDPMeshInfo) for _, g in fsdp_groups(self.model, "AutoTune")[1])

    def allows(self, config: ZeroConfig) -> bool:
        return True   # quantize_comm's all-gather aligns each parameter's shard to blocks itself

    def apply(self, config: ZeroConfig) -> None:
        from ..fsdp import reconfigure_comm
        current = self._settings(self.model)
        changes = {arg: getattr(config, field) for field, arg in QUANTIZE_COMM_ARGS.items()
                   if getattr(config, field) != current[arg]}
        if changes:
            reconfigure_comm(self.model, **changes)

    def errors(self, config: ZeroConfig) -> tuple[float, float]:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t
        shards = ((local(p).detach(), None if p.grad is None else local(p.grad).detach()) for p in self.model.parameters())
        return shard_errors(shards, config.weight_bits, config.grad_bits, config.weight_block, config.grad_block)

    def check(self, config: ZeroConfig, where: str) -> None:
        fixed = self.config
        if config.hpz != fixed.hpz:
            raise ValueError(f"{where} changes hpz, fixed by FSDP2's reshard_after_forward")
        unknown = [f for f in ZeroConfig.__dataclass_fields__ if f not in QUANTIZE_COMM_ARGS
                   and getattr(config, f) != getattr(ZeroConfig(), f)]
        if unknown:
            raise ValueError(f"{where} sets {unknown}, which quantize_comm has no setting for")

    def owner(self):
        return getattr(self.model, self._OWNER, None)

    def claim(self, autotune) -> None:
        setattr(self.model, self._OWNER, autotune)


def driver_for(model):
    """The driver of ``model``: :class:`ZeroDriver` for a ``qcoll.zero`` model, :class:`FsdpDriver` for an FSDP2
    model after ``quantize_comm``; a TypeError for anything else."""
    try:
        return ZeroDriver(model)
    except TypeError:
        pass
    try:
        return FsdpDriver(model)
    except (TypeError, ImportError) as e:
        raise TypeError(f"AutoTune drives a model sharded by qcoll.zero.shard, or an FSDP2 model after "
                        f"qcoll.fsdp.quantize_comm(model, ...) (pass that same module); got {type(model).__name__}: "
                        f"{e}") from None
