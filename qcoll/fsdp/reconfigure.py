"""``reconfigure_comm``: switch what ``quantize_comm`` installed between training steps.

FSDP2 reads a parameter group's all-gather and reduce-scatter objects (and HSDP's all-reduce
hook) at each collective, so replacing them between steps changes the wire format of the next
step and nothing else: the shards, the optimizer state and FSDP2's own schedule stay as they
are. hpZ (``hpz``) is FSDP2's ``reshard_after_forward``, fixed when the modules were sharded.
"""
from __future__ import annotations

import datetime

import torch.nn as nn

from .install import SETTINGS, STATE_ATTR, check_settings, check_timeout, fsdp_groups, install


def comm_settings(module: nn.Module) -> dict:
    """The settings ``quantize_comm`` (or the last ``reconfigure_comm``) installed on ``module``:
    ``weight_bits``, ``grad_bits``, ``weight_block``, ``grad_block``, ``hpz``, ``hadamard``,
    ``error_feedback``, ``feedback_beta``; a TypeError when there are none."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise TypeError(f"{type(module).__name__} has no qcoll communication: call qcoll.fsdp.quantize_comm(model, "
                        f"topology, ...) on it first (the module you pass here)")
    return dict(state[1])


def reconfigure_comm(module: nn.Module, *, timeout: datetime.timedelta | None = None, **changes) -> dict:
    """Switch ``module``'s quantized communication (set up by :func:`qcoll.fsdp.quantize_comm` on this
    same module) to ``changes`` between training steps: after ``optimizer.step()``, before the next
    forward, on every rank with the same changes (checked through the store, as ``quantize_comm``
    does). Any of ``quantize_comm``'s settings but ``hpz`` (FSDP2's ``reshard_after_forward``,
    fixed at ``fully_shard``); None switches a collective back to FSDP2's own. Error-feedback
    residuals carry over while error feedback stays on and ``hadamard`` does not change. Returns
    the settings it replaced."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    old = comm_settings(module)
    unknown = sorted(set(changes) - set(SETTINGS))
    if unknown:
        raise TypeError(f"reconfigure_comm: unknown setting(s) {unknown}; the settings are {list(SETTINGS)}")
    if "hpz" in changes and changes["hpz"] != old["hpz"]:
        raise ValueError(f"reconfigure_comm: hpz={changes['hpz']} but the modules were sharded with hpz={old['hpz']} "
                         f"(FSDP2's reshard_after_forward, fixed at fully_shard)")
    new = {**old, **changes}
    if not new["error_feedback"]:
        new["feedback_beta"] = 0.0 if "feedback_beta" not in changes else new["feedback_beta"]
    settings = check_settings(**new)
    check_timeout(timeout)
    targets, groups = fsdp_groups(module, "reconfigure_comm")
    topology = getattr(module, STATE_ATTR)[0]
    install(module, targets, groups, topology, settings, timeout)
    return old
