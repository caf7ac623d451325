"""Generation mode's bookkeeping (:class:`GenerationSession`) and what it counts (:class:`GenerationStats`).

Inside ``ZeroModule.generation_mode(max_cached_bytes=...)`` the forwards run without
backward, and the weights do not change between them (unless the user steps an optimizer).
So a group's full weights need not be gathered again for every token: the session *pins*
groups (:meth:`FlatGroup.pin`), in the model's order, while their full bytes fit in
``max_cached_bytes``; a pinned group is gathered once (qwZ across nodes) and kept as
gathered, so the tokens after the first cost no gather and no dequantize at all, as
DeepSpeed's hybrid engine keeps the gathered weights for generation. Groups beyond the
budget keep their hpZ secondary shard instead (the packed node-local bytes) and gather from
it inside the node for every forward. Both are the same dequantized bytes the first
gather gave, so the tokens are the exported quantized model's either way. A kept group whose
master changed (an optimizer step inside the block) is dropped at the next forward and
gathered again (``refreshed``).

A forward in the mode is one call of the sharded model (its root module), so with
Hugging Face ``generate`` and a KV cache one forward is one new token per sequence;
the first also reads the prompt. Bytes are this rank's, counted by the rule of
:mod:`qcoll.comm.stats` (what the rank hands to intra-node and inter-node groups,
frame headers included); sum them over the ranks for the cluster's total.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch.autograd.profiler import record_function

from ..comm.stats import stats


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
    held at the end of a forward. ``cached_bytes``: full (dequantized) weight bytes kept
    gathered across forwards under ``max_cached_bytes`` (the most at once); ``cached_groups``
    / ``groups``: how many of the model's sharded groups that is, out of how many.
    """

    inter_node_bytes_per_forward: list[int] = field(default_factory=list)
    intra_node_bytes_per_forward: list[int] = field(default_factory=list)
    seconds_per_forward: list[float] = field(default_factory=list)
    refreshed: int = 0
    secondary_bytes_peak: int = 0
    cached_bytes: int = 0
    cached_groups: int = 0
    groups: int = 0

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
            "cached_bytes": self.cached_bytes,
            "cached_groups": self.cached_groups,
            "groups": self.groups,
        }

    def _record(self, inter: int, intra: int, seconds: float, secondary_bytes: int) -> None:
        self.inter_node_bytes_per_forward.append(inter)
        self.intra_node_bytes_per_forward.append(intra)
        self.seconds_per_forward.append(seconds)
        self.secondary_bytes_peak = max(self.secondary_bytes_peak, secondary_bytes)


class GenerationSession:
    """One ``generation_mode()`` block on the engine's groups: the secondary shards set aside
    on entry, the kept shards' master versions, the cache's pins, the forward's counters."""

    def __init__(self, groups: list, max_cached_bytes: int | None):
        self.stats = GenerationStats(groups=sum(not g.replicated for g in groups))
        self.budget = max_cached_bytes
        self._set_aside = {g.index: g.begin_generation() for g in groups}  # a pending backward's: kept for it
        self._kept_version = {}      # group index -> master._version when its secondary was kept
        self._start = None           # (inter, intra, seconds) when the forward began
        self._profile = None

    def begin_forward(self, groups: list) -> None:
        """Before a forward: drop what went stale, pin what the budget allows, start the counters."""
        gen = self.stats
        for g in groups:
            if g.pin_stale:
                g.unpin()          # gathered before the master changed: gather it again
                gen.refreshed += 1
            if not g.config.hpz or g.pinned:
                continue
            version = g.master._version  # in-place updates of the master (optimizer steps, loads) bump it
            if g.secondary is not None and self._kept_version.get(g.index) != version:
                g.drop_secondary()  # kept before the master changed: stale, gather it across nodes again
                gen.refreshed += 1
        used = sum(g.full_nbytes for g in groups if g.pinned)
        for g in groups:
            if g.replicated or g.pinned or (self.budget is not None and used + g.full_nbytes > self.budget):
                continue
            g.drop_secondary()
            g.pin()
            used += g.full_nbytes
        for g in groups:
            if g.config.hpz and not g.pinned and g.secondary is None:
                self._kept_version[g.index] = g.master._version  # this forward's gather keeps it from this master
        gen.cached_bytes = max(gen.cached_bytes, used)
        gen.cached_groups = max(gen.cached_groups, sum(g.pinned for g in groups))
        self._close_profile()
        self._profile = record_function("qcoll.zero::generation_forward")
        self._profile.__enter__()
        self._start = (stats.total_inter_bytes, stats.total_intra_bytes, time.perf_counter())

    def end_forward(self, groups: list) -> None:
        """After a forward: record its bytes and seconds."""
        if self._start is None:
            return
        inter, intra, t0 = self._start
        self._start = None
        self._close_profile()
        held = sum(g.secondary.nbytes for g in groups if g.secondary is not None)
        self.stats._record(stats.total_inter_bytes - inter, stats.total_intra_bytes - intra,
                           time.perf_counter() - t0, held)

    def end(self, groups: list) -> None:
        """Leave the mode: unpin and release the cache, drop the kept secondaries, put back those
        set aside on entry."""
        self._close_profile()
        for g in groups:
            if g.pinned:
                g.unpin()
            g.end_generation(self._set_aside.get(g.index))

    def _close_profile(self) -> None:
        if self._profile is not None:
            profile, self._profile = self._profile, None
            profile.__exit__(None, None, None)
