"""``quantize_comm``: ZeRO++'s quantized communication on a model sharded with FSDP2."""
from __future__ import annotations

import datetime
import os
import warnings

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, FSDPMeshInfo

from ..checks import check_bool
from ..comm import Topology, validate
from ..comm.error_feedback import check_beta
from ..quant import format as fmt
from . import handshake, hybrid
from .comms import QuantizedAllGather, QuantizedReduceScatter, group_ranks, is_world
from .overlap import DeferredReductions


def quantize_comm(module: nn.Module, topology: Topology | None = None, *, weight_bits: int | None = 8,
                  grad_bits: int | tuple[int, int] | None = 4, weight_block: int = fmt.DEFAULT_WEIGHT_BLOCK,
                  grad_block: int = fmt.DEFAULT_GRAD_BLOCK, hpz: bool = True, hadamard: bool = False,
                  error_feedback: bool = False, feedback_beta: float = 0.0, overlap_comm: bool = True,
                  timeout: datetime.timedelta | None = None) -> list[FSDPModule]:
    """Put qcoll's quantized collectives into every FSDP2 module under ``module``.

    Call it on every rank after ``fully_shard`` and before the first forward (a
    ``RuntimeError`` after it: FSDP2 has set up its groups' communication by then); it
    returns the FSDP modules it configured. A second call replaces the first. With every
    rank on one node nothing crosses nodes, so nothing is quantized (FSDP2's own collectives
    run; a warning says so, once per process). The ranks check
    through the store that all of them called it with the same arguments and model: a
    ``ValueError`` names ranks that differ, a ``RuntimeError`` (after the store's timeout)
    names ranks that did not call it within ``timeout`` (default: the store's, which is
    ``init_process_group``'s timeout).

    ``topology``: the nodes (``qcoll.Topology(ranks_per_node=...)``). None: from the mesh
    on HSDP (its shard dimension is the node), else ``LOCAL_WORLD_SIZE`` (torchrun).

    On a 1-D mesh over the world (``fully_shard(model)``):

    - ``weight_bits`` (8, 6, 4, 2): the parameter all-gather across nodes is qwZ, node by
      node, each parameter on blocks of its own (:class:`QuantizedAllGather`);
    - ``grad_bits`` (an int, or ``(intra-node, inter-node)``): the gradient reduce-scatter
      is qgZ's 2-hop all-to-all (:class:`QuantizedReduceScatter`);
    - ``hpz=True``: the backward all-gather stays inside the node. This is FSDP2's
      ``fully_shard(..., reshard_after_forward=<ranks per node>)``, which must be set on
      every module but the root (a ``ValueError`` says so when it is not). ``hpz=False``
      wants ``reshard_after_forward=True`` (or False): the backward gathers across nodes
      again, quantized.

    On an HSDP mesh (``fully_shard(model, mesh=<2-D mesh (replicate, shard)>)``) weights
    never cross nodes: ``grad_bits`` quantizes the gradient all-reduce across nodes
    (:func:`qcoll.all_reduce_quantized` among the ranks of equal local index); the
    all-gather and reduce-scatter inside the node stay FSDP2's own.

    ``weight_bits=None`` / ``grad_bits=None`` leaves that collective as FSDP2's own (a
    previous call's is removed). ``weight_block`` / ``grad_block``: elements per fp32
    scale. ``hadamard``: rotate the gradient blocks before quantizing (qgZ).
    ``error_feedback``: the quantized gradient reduction (qgZ, or HSDP's all-reduce) adds back
    what it failed to send at the last step (:class:`qcoll.ErrorFeedback`, one per module, held
    by its reduce-scatter / all-reduce hook), so 2-bit gradients do not drift; fp32 residuals of
    each module's whole gradient on a 1-D mesh, of its shard on HSDP. Needs ``grad_bits``.
    ``feedback_beta`` (0 to <1): the residual is a moving average of the losses (LoCo; for Adam at
    2 bits, see :class:`qcoll.ErrorFeedback`); needs ``error_feedback``.
    ``overlap_comm`` (1-D mesh, DeepSpeed's name): a module's quantized gradient reduce-scatter
    returns after its first hop and completes later in the backward, overlapping the backward of
    the modules before it; every reduction is complete when ``backward()`` returns, with the
    same values (where FSDP2 would read the output at once, e.g. when gradients accumulate into
    ``.grad``, that reduction completes at once: :mod:`qcoll.fsdp.overlap`).
    ``qcoll.comm.stats`` counts what each group sends.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    settings = check_settings(weight_bits=weight_bits, grad_bits=grad_bits, weight_block=weight_block,
                              grad_block=grad_block, hpz=hpz, hadamard=hadamard, error_feedback=error_feedback,
                              feedback_beta=feedback_beta, overlap_comm=overlap_comm)
    check_timeout(timeout)
    targets, groups = fsdp_groups(module, "quantize_comm")
    started = [type(m).__name__ for m in targets if m._get_fsdp_state()._is_root is not None]
    if started:
        raise RuntimeError(f"quantize_comm: {started[0]} has run a forward already (FSDP2 initialized its "
                           f"communication then); call quantize_comm after fully_shard and before the first forward "
                           f"(between steps, qcoll.fsdp.reconfigure_comm switches the settings)")
    install(module, targets, groups, _topology(topology, groups[0][1].mesh_info), settings, timeout)
    return targets


#: the settings ``quantize_comm`` installs and ``reconfigure_comm`` switches
SETTINGS = ("weight_bits", "grad_bits", "weight_block", "grad_block", "hpz", "hadamard", "error_feedback",
            "feedback_beta", "overlap_comm")
#: where ``install`` keeps a module's topology and settings (``reconfigure_comm`` reads them)
STATE_ATTR = "_qcoll_quantize_comm"


def check_settings(*, weight_bits, grad_bits, weight_block, grad_block, hpz, hadamard, error_feedback,
                   feedback_beta, overlap_comm) -> dict:
    """``quantize_comm``'s settings checked (a TypeError / ValueError naming the bad one), as a dict."""
    validate.check_quant_args(weight_bits, weight_block)
    validate.check_hop_bits(grad_bits, grad_block)
    check_bool(hpz, "hpz")
    check_bool(hadamard, "hadamard")
    check_bool(error_feedback, "error_feedback")
    check_bool(overlap_comm, "overlap_comm")
    if error_feedback and grad_bits is None:
        raise ValueError("error_feedback=True needs quantized gradients (grad_bits is None)")
    try:
        feedback_beta = check_beta(feedback_beta)
    except (TypeError, ValueError) as e:
        raise type(e)(f"feedback_{e}") from None
    if feedback_beta and not error_feedback:
        raise ValueError(f"feedback_beta={feedback_beta} needs error_feedback=True")
    if hadamard and grad_bits is None:
        raise ValueError("hadamard=True needs quantized gradients (grad_bits is None)")
    return dict(weight_bits=weight_bits, grad_bits=grad_bits, weight_block=weight_block, grad_block=grad_block,
                hpz=hpz, hadamard=hadamard, error_feedback=error_feedback, feedback_beta=feedback_beta,
                overlap_comm=overlap_comm)


def check_timeout(timeout) -> None:
    """``timeout``: a positive ``datetime.timedelta`` or None (a TypeError naming it otherwise)."""
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise TypeError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")


def fsdp_groups(module: nn.Module, caller: str) -> tuple[list, list]:
    """``(FSDP modules under module, [(module, param group)])``; a ValueError when there are none."""
    targets = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not targets:
        raise ValueError(f"{caller}: no FSDP2 module under {type(module).__name__}: call "
                         f"torch.distributed.fsdp.fully_shard on it (and on its blocks) first")
    groups = [(m, g) for m in targets for g in m._get_fsdp_state()._fsdp_param_groups]
    if not groups:
        raise ValueError(f"{caller}: the FSDP2 modules under {type(module).__name__} manage no parameters")
    return targets, groups


def install(module: nn.Module, targets: list, groups: list, topology: Topology, settings: dict,
            timeout: datetime.timedelta | None) -> None:
    """Agree with every rank, check every group, then put the collectives of ``settings`` in place (a
    module's error-feedback residuals carry over while error feedback stays on and the rotation does
    not change); ``module`` keeps the topology and settings for ``reconfigure_comm``."""
    st = settings
    handshake.agree(dict(**st, ranks_per_node=topology.ranks_per_node, groups=len(groups),
                         parameters=sum(p._orig_size.numel() for _, g in groups for p in g.fsdp_params)), timeout)
    for m, group in groups:          # every check before any change: an error leaves the model as it was
        info = group.mesh_info
        if isinstance(info, HSDPMeshInfo):
            _check_hsdp(info, topology)
            if st["grad_bits"] is not None:
                hybrid.check_installable(group)
        elif isinstance(info, FSDPMeshInfo):
            _check_flat(info, topology)
            _check_hpz(m, group, topology, st["hpz"], st["weight_bits"], root=m is targets[0])
        else:
            raise ValueError(f"quantize_comm: {type(m).__name__} is replicated without sharding ({type(info).__name__}); "
                             f"qcoll quantizes FSDP2's sharded (1-D) and HSDP (2-D) meshes")
    old = getattr(module, STATE_ATTR, None)
    same_basis = old is not None and old[1]["hadamard"] == st["hadamard"]
    deferred = DeferredReductions() if st["overlap_comm"] else None
    for m, group in groups:
        if isinstance(group.mesh_info, HSDPMeshInfo):
            kept = getattr(group._all_reduce_hook, "feedback", None)
            if st["grad_bits"] is None:
                hybrid.uninstall(group)
            else:
                hybrid.install(group, topology, _inter_bits(st["grad_bits"]), st["grad_block"], st["error_feedback"],
                               st["feedback_beta"])
                _carry(group._all_reduce_hook, kept, st, same_basis)
            continue
        kept = getattr(group._reduce_scatter_comm, "feedback", None)
        m.set_custom_all_gather(DefaultAllGather() if st["weight_bits"] is None else QuantizedAllGather(
            topology, st["weight_bits"], st["weight_block"], [p._orig_size for p in group.fsdp_params],
            deferred=deferred))
        m.set_custom_reduce_scatter(DefaultReduceScatter() if st["grad_bits"] is None else QuantizedReduceScatter(
            topology, st["grad_bits"], st["grad_block"], st["hadamard"], error_feedback=st["error_feedback"],
            feedback_beta=st["feedback_beta"], deferred=deferred, param_group=None if deferred is None else group))
        _carry(group._reduce_scatter_comm, kept, st, same_basis)
    setattr(module, STATE_ATTR, (topology, dict(st)))
    if topology.num_nodes == 1 and (st["weight_bits"] is not None or st["grad_bits"] is not None):
        _warn_one_node(topology)


def _carry(comm, kept, settings: dict, same_basis: bool) -> None:
    """Give ``comm`` (a new reduce-scatter or all-reduce hook) the residuals ``kept`` from the one it
    replaces, when both keep residuals and the gradients stay in the same basis (a residual is what the
    values lost; a wider or narrower width is fine)."""
    if kept is not None and getattr(comm, "feedback", None) is not None and same_basis:
        kept.beta = settings["feedback_beta"]
        comm.feedback = kept


_warned_one_node = False


def _warn_one_node(topology: Topology) -> None:
    global _warned_one_node
    if not _warned_one_node:
        _warned_one_node = True
        warnings.warn(f"quantize_comm: every rank is on one node ({topology!r}), so no collective crosses nodes and "
                      f"nothing is quantized: FSDP2's own collectives run. Pass topology=qcoll.Topology("
                      f"ranks_per_node=...) with the ranks each node has (torchrun sets LOCAL_WORLD_SIZE)",
                      stacklevel=3)


def _inter_bits(grad_bits):
    return grad_bits[1] if isinstance(grad_bits, (tuple, list)) else grad_bits


def _topology(topology, info) -> Topology:
    if topology is not None:
        return validate.check_topology(topology)
    if isinstance(info, HSDPMeshInfo):
        return Topology(ranks_per_node=info.shard_mesh_size)
    if "LOCAL_WORLD_SIZE" in os.environ:
        return Topology.from_env()
    raise ValueError("quantize_comm: pass topology=qcoll.Topology(ranks_per_node=...): the mesh is 1-D and "
                     "LOCAL_WORLD_SIZE (set by torchrun) is not set, so the nodes are unknown")


def _check_flat(info, topology: Topology) -> None:
    ranks = group_ranks(info.shard_process_group)
    if not is_world(info.shard_process_group, topology):
        raise ValueError(f"quantize_comm: the 1-D mesh shards over ranks {ranks}, but {topology!r} describes a "
                         f"world of {topology.world_size} ranks; shard over the whole world, or use an HSDP "
                         f"mesh (replicate across nodes, shard inside)")


def _check_hsdp(info, topology: Topology) -> None:
    shard = group_ranks(info.shard_process_group)
    replicate = group_ranks(getattr(info, hybrid.ORIGINAL_ATTR, info.replicate_process_group))
    L, t = topology.ranks_per_node, topology
    node = list(range(t.node * L, (t.node + 1) * L))
    peers = list(range(t.local_rank, t.world_size, L))
    if shard != node or replicate != peers:
        raise ValueError(f"quantize_comm: the HSDP mesh shards over ranks {shard} and replicates over {replicate}, "
                         f"but {topology!r} puts rank {t.rank} on a node of ranks {node}: build the mesh as "
                         f"init_device_mesh(device, ({t.num_nodes}, {L}), mesh_dim_names=('replicate', 'shard'))")


def _check_hpz(m, group, topology: Topology, hpz: bool, weight_bits, root: bool) -> None:
    """The backward all-gather's group (FSDP2's ``reshard_after_forward``) against ``hpz``."""
    L, N = topology.ranks_per_node, topology.num_nodes
    state = m._get_fsdp_state()
    post = group.post_forward_mesh_info
    if root and state._auto_reshard_after_forward:
        return              # (FSDP2 keeps the root unsharded after forward when it is left to choose)
    if post is not None and post is not group.mesh_info:   # reshard_after_forward=<int>: hpZ's group, always
        ranks, t = group_ranks(post.shard_process_group), topology
        node = list(range(t.node * L, (t.node + 1) * L))
        if ranks != node:
            raise ValueError(f"quantize_comm: {type(m).__name__}'s reshard_after_forward={post.shard_mesh_size} keeps "
                             f"its shard on ranks {ranks} after forward, but {topology!r} puts rank {t.rank} on a node "
                             f"of ranks {node}: hpZ's post-forward group is the node; call fully_shard(module, "
                             f"reshard_after_forward={L}), or pass the topology the job has "
                             f"(qcoll.Topology(ranks_per_node=...))")
    if N == 1 or L == 1 or weight_bits is None:
        return
    if state._auto_reshard_after_forward or post is None:
        if post is None and not state._auto_reshard_after_forward:
            return          # reshard_after_forward=False: no backward all-gather at all
        kept = "not set (FSDP2 then reshards non-root modules to the world)"
    else:
        kept = ("True (the world)" if post is group.mesh_info
                else f"{post.shard_mesh_size} (ranks {group_ranks(post.shard_process_group)})")
    inside = post is not None and post is not group.mesh_info and post.shard_mesh_size == L
    if hpz and not inside:
        raise ValueError(f"quantize_comm(hpz=True): hpZ keeps each shard inside the node after forward, so the "
                         f"backward all-gather stays there, but {type(m).__name__}'s reshard_after_forward is {kept}; "
                         f"call fully_shard(module, reshard_after_forward={L}) on every block ({L} ranks per node), "
                         f"or pass quantize_comm(hpz=False) to gather across nodes again in backward (quantized)")
    if not hpz and inside:
        raise ValueError(f"quantize_comm(hpz=False) but {type(m).__name__} has reshard_after_forward={L}, which is "
                         f"hpZ: pass hpz=True, or fully_shard(module, reshard_after_forward=True)")
