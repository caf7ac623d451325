"""``qcoll-bench train``'s FSDP2 runs: the peers as users run them, and FSDP2 with qcoll's comms.

Peers: ``fsdp2`` (``fully_shard`` on each block and the root over the world, fp32),
``fsdp2-bf16`` (with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``),
``hsdp`` / ``hsdp-bf16`` (the same on FSDP2's 2-D mesh: replicate across nodes, shard
inside). qcoll inside FSDP2 (:func:`qcoll.fsdp.quantize_comm` at its defaults: 8-bit
weights, 4-bit gradients, hpZ): ``fsdp2-qcoll`` (fp32; the blocks reshard to the node
after forward), ``fsdp2-qcoll-bf16`` (the bf16 policy), ``hsdp-qcoll`` (the bf16 HSDP
peer with its cross-node gradient all-reduce at 4 bits).

Memory per rank (``memory`` in the JSON, bytes of live tensors): ``state`` = this rank's
parameter shards, their gradients and AdamW's state after a step; ``peak`` = ``state``
plus the most unsharded parameters (and post-forward shards kept for the backward)
held at once, sampled at every FSDP module's forward and at the end of the forward.
"""
from __future__ import annotations

import torch

#: mode -> (mesh, bf16 policy, quantize_comm)
RUNS = {
    "fsdp2": ("1d", False, False),
    "fsdp2-bf16": ("1d", True, False),
    "hsdp": ("hsdp", False, False),
    "hsdp-bf16": ("hsdp", True, False),
    "fsdp2-qcoll": ("1d", False, True),
    "fsdp2-qcoll-bf16": ("1d", True, True),
    "hsdp-qcoll": ("hsdp", True, True),
}
PEERS = tuple(m for m, (_, _, q) in RUNS.items() if not q)
QCOLL_MODES = tuple(m for m, (_, _, q) in RUNS.items() if q)


def _local_nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def state_nbytes(model, optimizer) -> int:
    """This rank's parameter shards, their gradients and the optimizer's state, in bytes."""
    params = list(model.parameters())
    return (_local_nbytes(params) + _local_nbytes(p.grad for p in params)
            + _local_nbytes(v for s in optimizer.state.values() for v in s.values()))


def unsharded_nbytes(model) -> int:
    """Bytes of FSDP2's unsharded parameters and post-forward shards held now."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    total = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                itemsize = (p.param_dtype or p.orig_dtype).itemsize
                if p.sharded_state == ShardedState.UNSHARDED:
                    total += p._orig_size.numel() * itemsize
                elif p.sharded_state == ShardedState.SHARDED_POST_FORWARD:
                    total += p._sharded_post_forward_param_data.numel() * itemsize
    return total


def build(args, mode: str, topo, model):
    """``model`` sharded as ``mode`` says (in place); returns it."""
    from ..testing.fsdp2 import mesh_for, shard_fsdp2

    mesh, bf16, quantized = RUNS[mode]
    hsdp = mesh == "hsdp"
    hpz = quantized and not hsdp and topo.num_nodes > 1 and topo.ranks_per_node > 1
    shard_fsdp2(model, model.blocks, mesh_for(hsdp, topo.ranks_per_node), bf16=bf16,
                reshard_after_forward=topo.ranks_per_node if hpz else None)
    if quantized:
        from ..fsdp import quantize_comm

        quantize_comm(model, topo, hpz=hpz)
    return model


def run(args, mode: str, topo, build_model, steps, attach=None):
    """Train ``mode``; ``steps(args, model, opt, rank, world, loss_fn)`` is train.py's timed loop;
    ``attach(model, optimizer)`` (optional, as train's ``_run_qcoll`` takes it) may return a callable run
    before each forward. Returns train.py's run tuple."""
    from torch.distributed.fsdp import FSDPModule

    model = build(args, mode, topo, build_model(args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    held = [0]

    def sample(*_):
        held[0] = max(held[0], unsharded_nbytes(model))

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.register_forward_pre_hook(sample)

    memory = {}
    opt.register_step_post_hook(lambda *_: memory.update(state=state_nbytes(model, opt)))
    before_forward = attach(model, opt) if attach is not None else None

    def forward(m, x, y):
        if before_forward is not None:
            before_forward()
        loss = m(x, y)
        sample()
        return loss

    losses, seconds, (intra, inter), link, times, colls, profile = steps(args, model, opt, topo.rank,
                                                                         topo.world_size, forward)
    memory["peak"] = memory.get("state", 0) + held[0]
    mesh, _, quantized = RUNS[mode]
    if not quantized:      # FSDP2's own collectives: counted by DESIGN.md's rule (qcoll's counters see none)
        intra, inter = rule_bytes(args, mode, topo, build_model)
    elif mesh == "hsdp":   # FSDP2's own inside the node, qcoll's all-reduce across nodes (counted)
        intra = rule_bytes(args, mode, topo, build_model)[0]
    return losses, seconds, intra, inter, link, memory, times, colls, profile


def rule_bytes(args, mode: str, topo, build_model) -> tuple[int, int]:
    """(intra, inter) bytes per step a peer hands to other ranks, by DESIGN.md's rule.

    1-D mesh: per unit, two all-gathers (forward and backward) and a reduce-scatter over the
    world, ``(W-1)`` shards each (inter-node when there are nodes). HSDP: the same inside the
    node (``L-1`` shards of ``1/L``), plus the all-reduce of the node shard across the ``N``
    nodes, ``2 (N-1)/N`` of it (inter-node)."""
    mesh, bf16, _ = RUNS[mode]
    elem = 2 if bf16 else 4
    W, N, L = topo.world_size, topo.num_nodes, topo.ranks_per_node
    sizes = [p.numel() for p in build_model(args).parameters()]
    if mesh == "1d":
        total = 3 * (W - 1) * elem * sum(-(-n // W) for n in sizes)
        return (0, total) if N > 1 else (total, 0)
    shard = sum(-(-n // L) for n in sizes)
    return 3 * (L - 1) * elem * shard, 2 * (N - 1) * elem * shard // N
