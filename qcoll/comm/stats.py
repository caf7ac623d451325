"""Byte accounting: what this rank hands to intra-node and inter-node groups.

Counts what a bandwidth-optimal algorithm sends from this rank to others
(DESIGN.md): all-gather ``(g-1) x`` own buffer, all-to-all the buffers for the
other ``g-1`` peers, reduce-scatter ``(g-1)/g x`` input bytes. A group that spans
nodes counts as inter-node. The frame headers of the quantized collectives
(docs/FORMAT.md, "Frames") are part of those buffers and so of ``intra_bytes`` and
``inter_bytes``; ``header_bytes`` says how many of the bytes counted were headers.
``total_intra_bytes`` / ``total_inter_bytes`` count the same since the process started
and are never reset, so a caller can take differences around a region (the ZeRO
layer's generation mode does, per forward) while others reset the counters.
``blocked_seconds`` sums, per operation, the seconds this rank's thread spent blocked
waiting for the transport (``work.wait()``, not the decoding after it): the
communication that was not hidden behind compute (reset with the byte counters).
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from .c10d import is_bare
from .topology import current_topology


@dataclass
class CommStats:
    intra_bytes: int = 0
    inter_bytes: int = 0
    header_bytes: int = 0
    calls: dict = field(default_factory=lambda: defaultdict(int))
    total_intra_bytes: int = 0   # since start, untouched by reset()
    total_inter_bytes: int = 0
    blocked_seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, op: str, group, nbytes: int, header_bytes: int = 0) -> None:
        """Count ``nbytes`` handed to ``group``'s peers, ``header_bytes`` of them frame headers."""
        self.calls[op] += 1
        if nbytes <= 0:
            return
        self.header_bytes += header_bytes
        if group_spans_nodes(group):
            self.inter_bytes += nbytes
            self.total_inter_bytes += nbytes
        else:
            self.intra_bytes += nbytes
            self.total_intra_bytes += nbytes

    def add_blocked(self, op: str, seconds: float) -> None:
        """Count ``seconds`` this rank waited for ``op``'s transport."""
        self.blocked_seconds[op] += seconds

    def reset(self) -> None:
        """Zero the counters (``total_intra_bytes`` / ``total_inter_bytes`` keep counting)."""
        self.intra_bytes = 0
        self.inter_bytes = 0
        self.header_bytes = 0
        self.calls.clear()
        self.blocked_seconds.clear()

    def snapshot(self) -> dict:
        return {"intra_bytes": self.intra_bytes, "inter_bytes": self.inter_bytes,
                "header_bytes": self.header_bytes, "calls": dict(self.calls),
                "blocked_seconds": dict(self.blocked_seconds)}


stats = CommStats()


def group_spans_nodes(group) -> bool:
    if is_bare(group):   # torchft's replica group: one rank per replica, replicas on other nodes
        return True
    topo = current_topology()
    if topo is not None:
        per_node = topo.ranks_per_node
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return len({r // per_node for r in ranks}) > 1


def reset() -> None:
    stats.reset()


def snapshot() -> dict:
    return stats.snapshot()
