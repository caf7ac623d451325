"""Per-rank memory of the ZeRO++ state, measured from the live tensors."""
from __future__ import annotations

import torch

from .state import state_of


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def memory_report(model, optimizer=None) -> dict:
    """Bytes this rank holds now: fp32 master shards (``padding``: the bytes of them that the
    block-aligned layout adds, included in ``master``), their gradients, the inner
    optimizer's state, hpZ secondary shards, qgZ's error-feedback residuals (``grad_feedback``), gathered full parameters (now, and the
    most held at once since sharding: ``gathered_peak``), and what
    ZeRO-3's rule predicts (``16 x params / world`` for fp32 Adam, plus
    ``params / L x bits / 8`` for the hpZ secondary while it is held)."""
    state = state_of(model)
    groups = state.groups
    params = sum(g.total for g in groups)
    world = state.topology.world_size
    L = state.topology.ranks_per_node
    report = {
        "params": params,
        "master": _nbytes(g.master for g in groups),
        "padding": sum(g.shard_numel - g.local_param_numel() for g in groups) * 4,
        "grad": _nbytes(g.master.grad for g in groups),
        "optimizer_state": 0,
        "secondary": _nbytes(g.secondary.rows for g in groups if g.secondary is not None),
        "grad_feedback": sum(g.grad_feedback.nbytes for g in groups if getattr(g, "grad_feedback", None) is not None),
        "gathered": sum(g.gathered_nbytes() for g in groups),
        "gathered_peak": state.engine.peak_gathered_bytes,
    }
    if optimizer is not None:
        report["optimizer_state"] = _nbytes(v for s in optimizer.optimizer.state.values() for v in s.values())
    bits = state.config.weight_bits
    secondary_bytes_per_param = (bits / 8 if bits else state.config.dtype.itemsize) if state.config.hpz else 0
    report["zero3_rule"] = 16 * params / world
    report["hpz_rule"] = params / L * secondary_bytes_per_param
    return report
