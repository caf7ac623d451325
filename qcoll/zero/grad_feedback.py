"""qgZ's error feedback in ``qcoll.zero`` (``ZeroConfig.grad_error_feedback``): each
:class:`~qcoll.zero.flat.FlatGroup` keeps the residuals of its own gradient
(``group.grad_feedback``), and a coalesced reduction of several groups lays theirs side by side
for the call and hands each its columns back when it completes."""
from __future__ import annotations

from ..comm import ErrorFeedback, Topology


def _feedback_views(ef: ErrorFeedback, topology: Topology, width: int, a: int, n: int):
    """The columns ``[a, a + n)`` of a reduction's residuals (hop 1's ``[W, width]``, hop 2's ``[N, width]``)."""
    send = ef.send.view(topology.world_size, width)[:, a:a + n]
    own = ef.own.view(topology.num_nodes, width)[:, a:a + n] if ef.own.numel() else None
    return send, own


def bucket_feedback(groups: list["FlatGroup"], starts: list[int], width: int) -> ErrorFeedback:
    """The residuals of one reduction of ``groups`` (a group's own, or the bucket's gathered from theirs:
    each group's slice starts at a gradient block, so no block's residual mixes two groups)."""
    t = groups[0].topology
    for g in groups:
        g.grad_feedback.bind(t.world_size * g.shard_numel, t.world_size, g.master.device, f"group {g.name}'s residual",
                             collective="reduce_scatter", nodes=t.num_nodes)
    if len(groups) == 1:
        return groups[0].grad_feedback
    bucket = ErrorFeedback(dtype=groups[0].grad_feedback.dtype, device=groups[0].master.device)
    bucket.bind(t.world_size * width, t.world_size, groups[0].master.device, collective="reduce_scatter",
                nodes=t.num_nodes)
    for g, a in zip(groups, starts):
        for dst, src in zip(_feedback_views(bucket, t, width, a, g.shard_numel),
                            _feedback_views(g.grad_feedback, t, g.shard_numel, 0, g.shard_numel)):
            if dst is not None:
                dst.copy_(src)
    return bucket


def split_feedback(bucket: ErrorFeedback, groups: list["FlatGroup"], starts: list[int], width: int) -> None:
    t = groups[0].topology
    for g, a in zip(groups, starts):
        for src, dst in zip(_feedback_views(bucket, t, width, a, g.shard_numel),
                            _feedback_views(g.grad_feedback, t, g.shard_numel, 0, g.shard_numel)):
            if dst is not None:
                dst.copy_(src)
        g.grad_feedback.calls += 1


def follow_config(group: "FlatGroup", old, new) -> None:
    """``reconfigure``'s part: residuals made when error feedback is turned on, dropped (their memory
    freed) when it is turned off, forgotten when the rotation changes (they would be in the other
    basis); kept across other changes (``grad_bits`` included: a residual is what the values lost)."""
    if group.replicated:
        return
    if not new.grad_error_feedback:
        group.grad_feedback = None
    elif group.grad_feedback is None:
        group.grad_feedback = ErrorFeedback(device=group.master.device)
    elif new.grad_hadamard != old.grad_hadamard:
        group.grad_feedback.reset()
