"""The char transformer sharded with FSDP2 as its users shard it: each block, then the root.

Shared by the tests of ``qcoll.fsdp`` and by ``qcoll-bench train``'s FSDP2 / HSDP modes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..comm.agreement import group_timeout
from .models import TINY, TransformerConfig, char_transformer


def mesh_for(hsdp: bool, ranks_per_node: int, device: str = "cpu"):
    """A 1-D mesh over the world, or HSDP's 2-D ``(replicate, shard)`` mesh of nodes, its groups on the
    default group's timeout (torch makes a mesh's groups with its own default, 30 minutes for gloo,
    whatever ``init_process_group`` was given: a rank whose peer died would wait that long in FSDP2's
    own collectives)."""
    world = dist.get_world_size()
    if not hsdp:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device, (world // ranks_per_node, ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
    timeout = group_timeout()
    for dim in range(mesh.ndim):
        _set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


def shard_fsdp2(model: torch.nn.Module, blocks, mesh, *, bf16: bool = False,
                reshard_after_forward: bool | int | None = None) -> torch.nn.Module:
    """``fully_shard`` each of ``blocks``, then ``model`` (the root keeps the tied embedding),
    with bf16 parameters and gradient reduction when ``bf16``; returns ``model``."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    kwargs = {} if mp is None else {"mp_policy": mp}
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def fsdp2_transformer(cfg: TransformerConfig = TINY, seed: int = 0, *, hsdp: bool = False, ranks_per_node: int = 2,
                      bf16: bool = False, reshard_after_forward: bool | int | None = None):
    """A :func:`~qcoll.testing.models.char_transformer` sharded by :func:`shard_fsdp2` over
    :func:`mesh_for`'s mesh; the blocks reshard to ``reshard_after_forward`` after forward."""
    model = char_transformer(cfg, seed)
    mesh = mesh_for(hsdp, ranks_per_node)
    return shard_fsdp2(model, model.blocks, mesh, bf16=bf16, reshard_after_forward=reshard_after_forward)
