"""What :meth:`ZeroModule.generation_mode` counts: bytes and time of each forward it runs.

A forward in the mode is one call of the sharded model (its root module), so with
Hugging Face ``generate`` and a KV cache one forward is one new token per sequence;
the first also reads the prompt. Bytes are this rank's, counted by the rule of
:mod:`qcoll.comm.stats` (what the rank hands to intra-node and inter-node groups,
frame headers included); sum them over the ranks for the cluster's total.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Per-forward counts of one ``generation_mode()`` block, on this rank.

    ``inter_node_bytes_per_forward`` / ``intra_node_bytes_per_forward``: bytes this
    rank handed to groups that span nodes / stay inside its node during each forward
    (weight gathers; with hpZ the first forward's qwZ all-gather crosses nodes and the
    later ones are node-local ``replica_gather`` calls). ``seconds_per_forward``: wall
    time of each forward (from the root's pre-hook to its post-hook). ``refreshed``:
    secondary shards dropped because their group's master weights changed after they
    were kept (an optimizer step, ``load_state_dict``): the next forward gathered that
    group across nodes again. ``secondary_bytes_peak``: the most hpZ secondary bytes
    held at the end of a forward.
    """

    inter_node_bytes_per_forward: list[int] = field(default_factory=list)
    intra_node_bytes_per_forward: list[int] = field(default_factory=list)
    seconds_per_forward: list[float] = field(default_factory=list)
    refreshed: int = 0
    secondary_bytes_peak: int = 0

    @property
    def forwards(self) -> int:
        """Forwards run in the block so far."""
        return len(self.seconds_per_forward)

    @property
    def inter_node_bytes(self) -> int:
        """Bytes handed to groups spanning nodes, all forwards of the block."""
        return sum(self.inter_node_bytes_per_forward)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes handed to node-local groups, all forwards of the block."""
        return sum(self.intra_node_bytes_per_forward)

    def summary(self) -> dict:
        """The figures per token: the first forward's bytes and seconds, and the mean per
        forward after it (``None`` with fewer than two forwards)."""
        n = self.forwards
        after = n - 1

        def mean_after(values):
            return sum(values[1:]) / after if after > 0 else None

        return {
            "forwards": n,
            "inter_node_bytes": self.inter_node_bytes,
            "intra_node_bytes": self.intra_node_bytes,
            "inter_node_bytes_first": self.inter_node_bytes_per_forward[0] if n else None,
            "intra_node_bytes_first": self.intra_node_bytes_per_forward[0] if n else None,
            "seconds_first": self.seconds_per_forward[0] if n else None,
            "inter_node_bytes_per_forward_after_first": mean_after(self.inter_node_bytes_per_forward),
            "intra_node_bytes_per_forward_after_first": mean_after(self.intra_node_bytes_per_forward),
            "seconds_per_forward_after_first": mean_after(self.seconds_per_forward),
            "refreshed": self.refreshed,
            "secondary_bytes_peak": self.secondary_bytes_peak,
        }

    def _record(self, inter: int, intra: int, seconds: float, secondary_bytes: int) -> None:
        self.inter_node_bytes_per_forward.append(inter)
        self.intra_node_bytes_per_forward.append(intra)
        self.seconds_per_forward.append(seconds)
        self.secondary_bytes_peak = max(self.secondary_bytes_peak, secondary_bytes)
