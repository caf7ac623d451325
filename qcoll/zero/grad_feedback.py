"""qgZ's error feedback in ``qcoll.zero`` (``ZeroConfig.grad_error_feedback``): each
:class:`~qcoll.zero.flat.FlatGroup` keeps the residuals of its own gradient
(``group.grad_feedback``), and a coalesced reduction of several groups lays theirs side by side
for the call and hands each its columns back when it completes.

In a checkpoint (:mod:`qcoll.zero.checkpoint`) each rank's residuals are its slice of a 1-D
``DTensor`` sharded ``Shard(0)`` over the world (``feedback.<group>.send`` / ``.own``), beside
``feedback.layout``: the world size, the node count and whether the gradients were rotated. A
residual is what *this* rank failed to send in *this* layout, so it is restored only into the
same layout; in another (a resume on another world size, node count or rotation) every residual
starts at zero, with a warning that says why.
"""
from __future__ import annotations

import warnings

import torch

from ..comm import ErrorFeedback, Topology


def _feedback_views(ef: ErrorFeedback, topology: Topology, width: int, a: int, n: int):
    """The columns ``[a, a + n)`` of a reduction's residuals (hop 1's ``[W, width]``, hop 2's ``[N, width]``)."""
    send = ef.send.view(topology.world_size, width)[:, a:a + n]
    own = ef.own.view(topology.num_nodes, width)[:, a:a + n] if ef.own.numel() else None
    return send, own


def bind(group: "FlatGroup") -> ErrorFeedback:
    """The group's residuals, shaped for its qgZ reduce-scatter (zeros on first use)."""
    t = group.topology
    group.grad_feedback.bind(t.world_size * group.shard_numel, t.world_size, group.master.device,
                             f"group {group.name}'s residual", collective="reduce_scatter", nodes=t.num_nodes)
    return group.grad_feedback


def bucket_feedback(groups: list["FlatGroup"], starts: list[int], width: int) -> ErrorFeedback:
    """The residuals of one reduction of ``groups`` (a group's own, or the bucket's gathered from theirs:
    each group's slice starts at a gradient block, so no block's residual mixes two groups)."""
    t = groups[0].topology
    for g in groups:
        bind(g)
    if len(groups) == 1:
        return groups[0].grad_feedback
    bucket = ErrorFeedback(dtype=groups[0].grad_feedback.dtype, device=groups[0].master.device,
                           beta=groups[0].grad_feedback.beta)
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
    basis); kept across other changes (``grad_bits`` and ``grad_feedback_beta`` included: a residual
    is what the values lost)."""
    if group.replicated:
        return
    if not new.grad_error_feedback:
        group.grad_feedback = None
    elif group.grad_feedback is None:
        group.grad_feedback = ErrorFeedback(device=group.master.device, beta=new.grad_feedback_beta)
    else:
        group.grad_feedback.beta = new.grad_feedback_beta
        if new.grad_hadamard != old.grad_hadamard:
            group.grad_feedback.reset()


# ---------------------------------------------------------------- checkpoints

def _fed(groups) -> list:
    return [g for g in groups if getattr(g, "grad_feedback", None) is not None]


def layout_tensor(groups) -> torch.Tensor:
    """``[world size, nodes, rotated]``: what a residual is only valid in."""
    g = groups[0]
    return torch.tensor([g.topology.world_size, g.topology.num_nodes, int(bool(g.config.grad_hadamard))])


def checkpoint_state(groups, as_dtensor) -> dict | None:
    """The residuals of ``groups`` as checkpoint entries (None when none has error feedback):
    ``{"layout": [W, N, rotated], "<group>.send": DTensor, "<group>.own": DTensor}``; ``as_dtensor(local)``
    makes this rank's ``[n]`` residual its slice of a ``[W * n]`` DTensor. Binds unused residuals (zeros)."""
    fed = _fed(groups)
    if not fed:
        return None
    state = {"layout": layout_tensor(fed)}
    for g in fed:
        ef = bind(g)
        state[f"{g.name}.send"] = as_dtensor(ef.send)
        if ef.own.numel():
            state[f"{g.name}.own"] = as_dtensor(ef.own)
    return state


def _layout_words(layout) -> str:
    w, n, rotated = layout
    return f"{w} ranks in {n} node{'s' if n != 1 else ''}{' with rotated gradients' if rotated else ''}"


def restorable(groups, md, saved_layout, entries: dict) -> bool:
    """Whether the checkpoint's residuals (``md``: DCP metadata; ``saved_layout``: its ``feedback.layout``,
    or None when it has none) can be loaded into ``entries`` (:func:`checkpoint_state` of ``groups``);
    zeroes every residual and says why (a warning) when they cannot, so no residual of another run or
    layout survives a load."""
    fed = _fed(groups)
    if not fed:
        return False
    here = layout_tensor(fed).tolist()
    why = None
    if saved_layout is None:
        why = "the checkpoint holds no error-feedback residuals (saved without grad_error_feedback)"
    elif saved_layout.tolist() != here:
        why = (f"its residuals were saved on {_layout_words(saved_layout.tolist())}, this run has "
               f"{_layout_words(here)}: a residual is what one rank failed to send in one layout")
    else:
        saved = md.state_dict_metadata
        other = [k for k, v in entries.items() if k != "layout" and (
            f"feedback.{k}" not in saved or list(saved[f"feedback.{k}"].size) != list(v.shape))]
        if other:
            why = f"its residuals {other} are missing or of other sizes"
    if why is None:
        return True
    for g in fed:
        g.grad_feedback.reset()
    warnings.warn(f"qcoll.zero.load: qgZ's error-feedback residuals start at zero: {why}", stacklevel=3)
    return False


def restore(groups, loaded: dict) -> None:
    """Copy the loaded residual slices into the groups' (a no-op where DCP loaded them in place).
    Non-finite entries (a damaged file) are zeroed, with a warning naming the group: they would
    turn every later gradient non-finite."""
    for g in _fed(groups):
        for key, live in ((f"{g.name}.send", g.grad_feedback.send), (f"{g.name}.own", g.grad_feedback.own)):
            if key in loaded:
                local = loaded[key].to_local()
                if local.data_ptr() != live.data_ptr():
                    live.copy_(local)
                bad = ~torch.isfinite(live)
                if bool(bad.any()):
                    live.masked_fill_(bad, 0.0)
                    warnings.warn(f"qcoll.zero.load: {int(bad.sum())} non-finite residual(s) of {key} were zeroed",
                                  stacklevel=3)
