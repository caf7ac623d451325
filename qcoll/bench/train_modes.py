"""The modes ``qcoll-bench train`` runs: qcoll's ZeRO-3 / ZeRO++ configurations (:data:`MODES`), FSDP2's
peers (:data:`PEERS`), and which of them count as the peers ZeRO++ is measured against."""
from __future__ import annotations

import torch

from . import fsdp_runs

MODES = {
    "zero3": dict(weight_bits=None, hpz=False, grad_bits=None),
    "zeropp": dict(weight_bits=8, hpz=True, grad_bits=4),
    "zeropp-w4": dict(weight_bits=4, hpz=True, grad_bits=4),
    "qwz": dict(weight_bits=8, hpz=False, grad_bits=None),
    "qgz": dict(weight_bits=None, hpz=False, grad_bits=4),
    # beyond ZeRO++'s quantizer (issue 19): per-hop gradient bits, Hadamard rotation, outlier reserve
    "zeropp-g84": dict(weight_bits=8, hpz=True, grad_bits=(8, 4)),
    "zeropp-had": dict(weight_bits=8, hpz=True, grad_bits=4, grad_hadamard=True),
    "zeropp-out1": dict(weight_bits=8, hpz=True, grad_bits=4, grad_outliers=1),
    "zeropp-w4-had": dict(weight_bits=4, hpz=True, grad_bits=4, grad_hadamard=True),
    "zeropp-w4-g84had": dict(weight_bits=4, hpz=True, grad_bits=(8, 4), grad_hadamard=True),
    "zeropp-w2": dict(weight_bits=2, hpz=True, grad_bits=4),
    "zeropp-w2-out2": dict(weight_bits=2, hpz=True, grad_bits=4, weight_outliers=2),
    # bf16 compute (issue 20): the gathered parameters, forward and backward in bf16 (master weights and AdamW
    # fp32); ZeRO-3's unquantized gathers then move 2-byte elements, qwZ/hpZ quantize and gather bf16
    "zero3-bf16": dict(weight_bits=None, hpz=False, grad_bits=None, compute_dtype=torch.bfloat16),
    "zeropp-bf16": dict(weight_bits=8, hpz=True, grad_bits=4, compute_dtype=torch.bfloat16),
    # small parameters replicated (issue 20). DeepSpeed's default threshold, 1e5 elements, replicates
    # every matrix of the 0.8M-parameter char transformer (a DDP-like all-reduce); 1e4 keeps the
    # LayerNorms, biases and the position table whole and shards the matrices
    "zero3-persist": dict(weight_bits=None, hpz=False, grad_bits=None, persist_threshold=100_000),
    "zero3-p10k": dict(weight_bits=None, hpz=False, grad_bits=None, persist_threshold=10_000),
    "zeropp-p10k": dict(weight_bits=8, hpz=True, grad_bits=4, persist_threshold=10_000),
    # coalesced gradient reductions (issue 20): groups reduced together until 1e5 gradient elements wait (the
    # final norm with the last block, the embedding with the position table: 5 reductions instead of 7)
    "zero3-b100k": dict(weight_bits=None, hpz=False, grad_bits=None, reduce_bucket_numel=100_000),
    "zeropp-b100k": dict(weight_bits=8, hpz=True, grad_bits=4, reduce_bucket_numel=100_000),
    "zeropp-w4-b100k": dict(weight_bits=4, hpz=True, grad_bits=4, reduce_bucket_numel=100_000),
    # two units gathered ahead instead of one: on a slow link the next gather is already queued when one ends
    "zeropp-pf2": dict(weight_bits=8, hpz=True, grad_bits=4, prefetch=2),
    "zeropp-w4-pf2": dict(weight_bits=4, hpz=True, grad_bits=4, prefetch=2),
    # the gathers as one all-gather over the world (gloo's ring), as before issue 20
    "zero3-ring": dict(weight_bits=None, hpz=False, grad_bits=None, hierarchical_gather=False),
    "zeropp-ring": dict(weight_bits=8, hpz=True, grad_bits=4, hierarchical_gather=False),
}

# FSDP2 (fully_shard) as users run it, 1-D and HSDP, fp32 and bf16 (fsdp_runs.py)
PEERS = fsdp_runs.PEERS


def mode_config(args, mode: str) -> dict:
    """The :class:`~qcoll.zero.ZeroConfig` fields of qcoll mode ``mode`` with the command's overrides."""
    fields = dict(MODES[mode])
    if args.prefetch is not None:
        fields["prefetch"] = args.prefetch
    return fields


def is_peer(mode: str) -> bool:
    """The configurations ZeRO++ is measured against: FSDP2 (:data:`PEERS`) and qcoll's unquantized ZeRO-3."""
    return mode in PEERS or mode in ("zero3", "zero3-bf16")


def best_peer(runs: list[dict]) -> dict | None:
    """The fastest (smallest ``step_time_s``) of the runs of :func:`is_peer` modes, or None."""
    peers = [r for r in runs if is_peer(r["mode"]) and r.get("step_time_s")]
    return min(peers, key=lambda r: r["step_time_s"]) if peers else None


