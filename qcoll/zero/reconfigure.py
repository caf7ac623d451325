"""``reconfigure(model, config)``: change a sharded model's communication between steps.

Only the wire format changes: the flat layout, the fp32 master shards, their gradients and the
optimizer state are the same objects before and after, so a run that switches configuration
computes exactly what a run using each configuration for the same steps computes.

What may change: the quantization of the weight gathers (``weight_bits``, ``weight_outliers``) and
of the gradient reduce-scatter (``grad_bits``, ``grad_block``, ``grad_hadamard``, ``grad_outliers``,
``stochastic_grad_rounding``, ``grad_error_feedback``: residuals kept across changes of width, made or
dropped as it turns on or off, forgotten when the rotation changes), ``hpz``, ``prefetch``, ``hierarchical_gather``,
``reduce_bucket_numel``, ``hpz_partition_size``, ``broadcast_buffers`` and
``reshard_after_backward``. What may not, because the layout or the groups were built from it:
``compute_dtype`` (the gathered buffers' dtype), ``persist_threshold`` (which parameters are
replicated) and ``weight_block`` (where each parameter starts in the flat buffer); and quantized
weights need a layout built for them (the model sharded with quantized weights, see
:func:`layout_allows`).
"""
from __future__ import annotations

import dataclasses

from ..comm.agreement import Agreement, wait_timeout
from .config import ZeroConfig
from .grad_feedback import follow_config
from .state import state_of

#: fields fixed at :func:`qcoll.zero.shard` (the layout and the groups depend on them)
FIXED_FIELDS = ("compute_dtype", "persist_threshold", "weight_block")


def layout_allows(model, config: ZeroConfig) -> bool:
    """Whether every sharded group's layout suits ``config``'s weight gathers: unquantized gathers
    suit any layout, quantized ones need each parameter to start at a multiple of the weight block
    (the layout of a model sharded with quantized weights of that block)."""
    if config.weight_bits is None:
        return True
    return all(g.replicated or g.align % config.weight_block == 0 for g in state_of(model).groups)


def check_between_steps(model, what: str) -> None:
    """RuntimeError unless the model is between steps: no forward or backward running, no backward
    pending (a forward with gradients not yet backpropagated), no reduction in flight, not inside
    generation mode, no group pinned (accumulation with ``reshard_after_backward=False``)."""
    state = state_of(model)
    engine = state.engine
    busy = None
    if engine.in_forward or engine.in_backward:
        busy = "a forward or backward of the model is running"
    elif engine.generation is not None:
        busy = "generation_mode() is active"
    elif engine.reduces or engine.bucket:
        busy = "gradient reductions are in flight"
    elif any(g.pinned for g in state.groups):
        busy = "weights are kept gathered across micro-batches (reshard_after_backward=False inside no_sync())"
    elif any(getattr(g, "secondary", None) is not None for g in state.groups):
        busy = "a forward's backward is pending (its hpZ secondary shards are held)"
    if busy:
        raise RuntimeError(f"qcoll.zero: {what} runs between steps (after the optimizer step, before the next "
                           f"forward), but {busy}")


def reconfigure(model, config: ZeroConfig) -> ZeroConfig:
    """Make ``config`` the communication configuration of ``model`` (sharded by
    :func:`qcoll.zero.shard`) from its next forward on; returns the previous one.

    Call it on every rank with the same ``config``, between steps (after the optimizer step,
    before the next forward; else ``RuntimeError``). The ranks compare their configs through
    the store first: one that differs is a ``ValueError`` on every rank naming the fields and
    the ranks (a ``RuntimeError`` names ranks that do not call it within 60 s, or the group's
    timeout when shorter). ``TypeError`` if ``config`` is not a
    :class:`ZeroConfig`; ``ValueError`` naming the field when it changes one of
    :data:`FIXED_FIELDS` or asks for quantized weights the layout was not built for. The master
    weights, gradients and optimizer state are untouched.
    """
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a qcoll.zero.ZeroConfig, got {type(config).__name__}")
    _agree(config)
    state = state_of(model)
    old = state.config
    for name in FIXED_FIELDS:
        if getattr(config, name) != getattr(old, name):
            raise ValueError(f"reconfigure: {name} is fixed when the model is sharded ({getattr(old, name)!r}); "
                             f"config has {name}={getattr(config, name)!r}")
    if not layout_allows(model, config):
        raise ValueError(f"reconfigure: weight_bits={config.weight_bits} needs a layout aligned to weight_block="
                         f"{config.weight_block}, and the model was sharded with weight_bits=None (each parameter "
                         f"starts anywhere); shard it with quantized weights (any weight_bits) to switch between "
                         f"quantized and unquantized gathers")
    config.check_topology(state.topology)
    check_between_steps(model, "reconfigure")
    state.config = state.engine.config = config
    for g in state.groups:
        g.config = config
        follow_config(g, old, config)
    return old


_AGREEMENT = Agreement("reconfigure")


def _agree(config: ZeroConfig) -> None:
    """Every rank passes an equal ``config``, or every rank raises a ValueError naming the fields that
    differ from rank 0's and the ranks."""
    _AGREEMENT.same_fields({f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)},
                           wait_timeout(), "Every rank must call reconfigure, with the same config.")


def with_knobs(config: ZeroConfig, **knobs) -> ZeroConfig:
    """``config`` with the given fields replaced; knobs that contradict the rest are resolved toward
    the knobs (hpZ off drops ``hpz_partition_size``, unquantized gradients drop the rotation and the
    outlier reserve, unquantized weights drop theirs)."""
    fields = {**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, **knobs}
    if not fields["hpz"]:
        fields["hpz_partition_size"] = None
    if fields["grad_bits"] is None:
        fields["grad_hadamard"], fields["grad_outliers"], fields["grad_error_feedback"] = False, 0, False
    if fields["grad_outliers"]:
        fields["grad_error_feedback"] = False
    if not fields["grad_error_feedback"]:
        fields["grad_feedback_beta"] = 0.0
    if fields["weight_bits"] is None:
        fields["weight_outliers"] = 0
    return ZeroConfig(**fields)
