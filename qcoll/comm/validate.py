"""Argument checks shared by the collectives, done before any communication.

With ``QCOLL_DEBUG=1`` the collectives also all-gather a small metadata record
over the group and raise the same clear error on every rank when ranks disagree,
instead of hanging or reading garbage.
"""
from __future__ import annotations

import os

import torch

from ..checks import check_bool
from .c10d import all_gather_flat, group_ranks, group_size, is_bare, my_rank
from ..quant import format as fmt
from .errors import RankMismatchError
from .topology import Topology, group_is_live

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_COLLECTIVES = {"all_gather": 1, "replica_gather": 2, "reduce_scatter": 3, "all_reduce": 4}
_REDUCE_OPS = {None: 0, "sum": 1, "avg": 2}


def check_tensor(t, name: str, contiguous: bool = True) -> torch.Tensor:
    fmt.check_float_tensor(t, name)
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def check_same(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{names} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{names} must be on the same device, got {a.device} and {b.device}")


def check_quant_args(bits, block_size) -> None:
    if bits is not None:
        fmt.check_bits(bits)
    fmt.check_block_size(block_size)


def check_hop_bits(bits, block_size) -> tuple[int, int] | None:
    """qgZ's ``bits``: None, one width for both hops, or ``(intra, inter)``; returns the pair (or None)."""
    fmt.check_block_size(block_size)
    if bits is None:
        return None
    if isinstance(bits, (tuple, list)):
        if len(bits) != 2:
            raise ValueError(f"bits must be an int or a pair (intra-node bits, inter-node bits), got {bits!r}")
        return fmt.check_bits(bits[0], "bits[0] (intra-node)"), fmt.check_bits(bits[1], "bits[1] (inter-node)")
    fmt.check_bits(bits)
    return bits, bits


def check_async(async_op) -> None:
    check_bool(async_op, "async_op")


def check_group(group, name: str = "group") -> None:
    """``group`` is None (the default group) or a live process group."""
    if group is not None and not is_bare(group) and not group_is_live(group):
        raise ValueError(f"{name} {group!r} is not a live process group: it was destroyed "
                         f"(torch.distributed.destroy_process_group); create groups (and a qcoll.Topology) "
                         f"again after init_process_group")


def check_topology(topology, name: str = "topology") -> Topology:
    """``topology`` is a qcoll Topology whose process groups still exist."""
    if not isinstance(topology, Topology):
        raise TypeError(f"{name} must be a qcoll Topology, got {topology!r}")
    topology.check_live()
    return topology


def debug_enabled() -> bool:
    return os.environ.get("QCOLL_DEBUG", "0") not in ("", "0", "false", "False")


def debug_check(collective: str, group, numel: int, bits, block_size: int, dtype: torch.dtype, device=None,
                reduce_op: str | None = None) -> None:
    """All ranks of ``group`` agree on the collective's metadata, or all raise: which ``collective``
    (``all_gather``, ``replica_gather``, ``reduce_scatter``, ``all_reduce``), the size, bits, block
    size, dtype and, for the reductions, ``reduce_op`` (``"sum"`` / ``"avg"``; None otherwise)."""
    if not debug_enabled():
        return
    intra, inter = bits if isinstance(bits, (tuple, list)) else (bits, bits)
    mine = torch.tensor([_COLLECTIVES[collective], numel, intra or 0, inter or 0, block_size, _DTYPE_CODES[dtype],
                         _REDUCE_OPS[reduce_op]], dtype=torch.int64, device=device)
    size = group_size(group)
    every = torch.empty(size, mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every.view(-1), mine, group=group)
    if bool((every == every[0]).all()):
        return
    names = {"collective": {v: k for k, v in _COLLECTIVES.items()}, "dtype": {v: str(k) for k, v in _DTYPE_CODES.items()},
             "op": {v: str(k) for k, v in _REDUCE_OPS.items()}}
    fields = ("collective", "numel", "bits", "inter_bits", "block_size", "dtype", "op")
    ranks = group_ranks(group)
    rows = ", ".join(f"rank {r}: " + " ".join(f"{f}={names.get(f, {}).get(int(v), int(v))}" for f, v in zip(fields, row))
                     for r, row in zip(ranks, every.tolist()))
    raise RankMismatchError(f"qcoll {collective}: ranks passed different metadata (QCOLL_DEBUG check): {rows}",
                            collective, my_rank(group))
