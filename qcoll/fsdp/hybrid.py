"""HSDP's gradient all-reduce across nodes, quantized.

FSDP2 on a 2-D mesh (replicate across nodes, shard inside) reduce-scatters each gradient
inside the node, then all-reduces the shard across the replicas with ``dist.all_reduce``
on the mesh's replicate group, in its all-reduce stream. That call cannot be replaced
through FSDP2's public API, but the all-reduce hook (``set_all_reduce_hook``) runs right
after it, on its output, in the same stream. So :func:`install` points the parameter
group's replicate process group at a group of this rank alone (FSDP2's all-reduce then
moves nothing and its divide factor counts the shard group only) and installs a hook
that runs :func:`qcoll.all_reduce_quantized` among the ranks of equal local index.
:func:`uninstall` puts the replicate group back. The weights never cross nodes on HSDP,
so the all-gather and the reduce-scatter inside the node stay FSDP2's own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import ErrorFeedback, Topology, all_reduce_quantized
from ..quant import format as fmt

#: where the replicate group FSDP2 built is kept while the singleton one stands in for it
ORIGINAL_ATTR = "_qcoll_replicate_process_group"

_singletons: dict = {}


def _singleton_group(world: int):
    """This rank's group of one (every rank creates all of them, in the same order; cached)."""
    key = (id(dist.group.WORLD), world)
    if key not in _singletons:
        _singletons[key] = dist.new_subgroups_by_enumeration([[r] for r in range(world)])[0]
    return _singletons[key]


class QuantizedAllReduceHook:
    """FSDP2 all-reduce hook: the HSDP gradient shard all-reduced across nodes at ``bits``.

    Called with the shard group's reduced gradient (averaged over the shard group under
    FSDP2's default divide factor); averages it over ``group`` (the replicas) in place
    when ``average``, else sums (a custom ``set_gradient_divide_factor`` makes FSDP2 sum
    across replicas).
    """

    def __init__(self, group, bits: int = 4, block_size: int = fmt.DEFAULT_GRAD_BLOCK, param_group=None,
                 error_feedback: bool = False, feedback_beta: float = 0.0):
        self.group, self.bits, self.block_size = group, bits, block_size
        self._param_group = param_group
        #: the all-reduce's residuals (``error_feedback=True``): about (1 + 1/nodes) x the shard's fp32 bytes
        self.feedback = ErrorFeedback(beta=feedback_beta) if error_feedback else None

    def __repr__(self) -> str:
        return f"QuantizedAllReduceHook(bits={self.bits}, block_size={self.block_size})"

    def __call__(self, reduce_output: torch.Tensor) -> None:
        factor = getattr(self._param_group, "gradient_divide_factor", None)
        all_reduce_quantized(reduce_output, self.bits, self.block_size, group=self.group,
                             op="avg" if factor is None else "sum", error_feedback=self.feedback)


def check_installable(param_group) -> None:
    """A ``ValueError`` when the group already has an all-reduce hook of the user's."""
    hook = param_group._all_reduce_hook
    if hook is not None and not isinstance(hook, QuantizedAllReduceHook):
        raise ValueError(f"{param_group!r} already has an all-reduce hook of the user's ({hook!r}); qcoll's "
                         f"quantized HSDP all-reduce is installed as that hook: remove yours "
                         f"(set_all_reduce_hook) or pass quantize_comm(grad_bits=None)")


def install(param_group, topology: Topology, bits: int, block_size: int, error_feedback: bool = False,
            feedback_beta: float = 0.0) -> None:
    """Quantize ``param_group``'s (an FSDP2 ``FSDPParamGroup`` on an HSDP mesh) all-reduce."""
    check_installable(param_group)
    mesh_info = param_group.mesh_info
    if not hasattr(mesh_info, ORIGINAL_ATTR):
        setattr(mesh_info, ORIGINAL_ATTR, mesh_info.replicate_process_group)
    mesh_info.replicate_process_group = _singleton_group(topology.world_size)
    param_group._all_reduce_hook = QuantizedAllReduceHook(getattr(mesh_info, ORIGINAL_ATTR), bits, block_size,
                                                          param_group, error_feedback, feedback_beta)


def uninstall(param_group) -> None:
    """FSDP2's own HSDP all-reduce again (after :func:`install`; otherwise nothing to undo)."""
    mesh_info = param_group.mesh_info
    if hasattr(mesh_info, ORIGINAL_ATTR):
        mesh_info.replicate_process_group = getattr(mesh_info, ORIGINAL_ATTR)
        delattr(mesh_info, ORIGINAL_ATTR)
    if isinstance(param_group._all_reduce_hook, QuantizedAllReduceHook):
        param_group._all_reduce_hook = None
