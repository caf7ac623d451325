"""Error feedback for the quantized reductions: the residual a rank failed to send, kept by
the caller and added back before the next quantization (docs/FORMAT.md "Error feedback").

The collectives stay stateless: the caller holds one :class:`ErrorFeedback` per tensor it
reduces (as it holds a :class:`~qcoll.comm.SecondaryShard` per hpZ shard) and passes it on
every call for that tensor. Over many calls, what the group receives then sums to what it
was sent up to one call's rounding, instead of accumulating each call's rounding: the bias
that makes 2-bit reductions drift is fed back rather than lost.
"""
from __future__ import annotations

import torch

from ..checks import check_int

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
_STATE_KEYS = ("collective", "numel", "group_size", "nodes", "send", "own", "calls")


COLLECTIVES = ("all_reduce", "reduce_scatter")


def check_beta(beta) -> float:
    """``beta`` of :class:`ErrorFeedback`: a real number in ``[0, 1)``."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a float in [0, 1), got {beta!r}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    return float(beta)


def residual_sizes(collective: str, numel: int, group_size: int, nodes: int) -> tuple[int, int]:
    """Elements of the two residuals: the all-reduce's ``(g * S, S)`` (``S = ceil(numel / g)``);
    qgZ's ``(numel, N * S)`` (``S = numel / W``; the hop-2 residual only where both hops run)."""
    if collective == "all_reduce":
        S = -(-numel // group_size)
        return group_size * S, S
    S = numel // group_size
    both_hops = nodes > 1 and group_size // nodes > 1
    return numel, nodes * S if both_hops else 0


class ErrorFeedback:
    """The residuals of one tensor's quantized reduction on one rank.

    For :func:`qcoll.all_reduce_quantized` over ``g`` ranks: ``send`` ``[g * S]``, what the
    reduce-scatter stage failed to send of the ``g`` slices (``S = ceil(numel / g)``), and ``own``
    ``[S]``, what the all-gather stage failed to send of the reduced slice this rank owns:
    about ``(1 + 1/g)`` times the tensor's numel. For qgZ (:func:`qcoll.reduce_scatter_quantized`)
    over ``W`` ranks in ``N`` nodes: ``send`` ``[W * S]`` (the input's size), what hop 1 failed to
    send, and ``own`` ``[N * S]``, what hop 2 failed to send of the node's partial sums.
    Residuals are fp32, or bf16 (``dtype``) at half the memory.

    Built empty, it takes its shape from the first call that uses it; built with ``numel`` and
    ``group_size`` it is an all-reduce's from the start. A call of another collective or shape is
    a ValueError naming both. ``reset()`` forgets the residuals (a group whose membership
    changed: each slice has another owner). Non-finite values are never kept: a residual entry
    that is not finite is zeroed, so one overflow does not poison every later call (the call
    that met it still returns the non-finite value, as without error feedback).

    ``beta``: 0 (the default) keeps what the last call lost, classic error feedback. Above 0 the
    residual is a moving average of the losses, ``r = beta * r + (1 - beta) * lost`` (LoCo,
    Xie et al. 2024; DeepSpeed's ``err_beta``): each step re-sends a damped part of what earlier
    ones lost. Adam-family optimizers need it at 2 bits: a full residual piles up on a block's
    small entries until they are sent at once as a whole code step, bursts that Adam's per-entry
    normalization turns into large updates. (The sum of what the group receives then no longer
    telescopes to what it was sent.)

    ``state_dict()`` / ``load_state_dict()`` save and load it (torch.distributed.checkpoint or
    ``torch.save``); the residual is per rank, so give each rank's state its own key. ``beta`` and
    ``dtype`` are settings, not state: give them to the constructor.
    """

    def __init__(self, numel: int | None = None, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", beta: float = 0.0):
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"dtype must be one of {RESIDUAL_DTYPES}, got {dtype!r}")
        self.beta = check_beta(beta)
        if (numel is None) != (group_size is None):
            raise ValueError(f"numel and group_size are given together or not at all, got numel={numel!r}, "
                             f"group_size={group_size!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.collective: str | None = None
        self.numel: int | None = None
        self.group_size: int | None = None
        self.nodes = 1
        self.send: torch.Tensor | None = None
        self.own: torch.Tensor | None = None
        self.calls = 0
        if numel is not None:
            self._allocate("all_reduce", check_int(numel, "numel", minimum=0),
                           check_int(group_size, "group_size", minimum=1), 1)

    # ---------------------------------------------------------------- shape

    def _allocate(self, collective: str, numel: int, group_size: int, nodes: int) -> None:
        n_send, n_own = residual_sizes(collective, numel, group_size, nodes)
        self.collective, self.numel, self.group_size, self.nodes = collective, numel, group_size, nodes
        self.send = torch.zeros(n_send, dtype=self.dtype, device=self.device)
        self.own = torch.zeros(n_own, dtype=self.dtype, device=self.device)

    def _describe(self, collective, numel, group_size, nodes) -> str:
        where = f"{group_size} ranks" + (f" in {nodes} nodes" if collective == "reduce_scatter" else "")
        return f"{'a qgZ reduce-scatter' if collective == 'reduce_scatter' else 'an all-reduce'} of {numel} " \
               f"elements over {where}"

    def bind(self, numel: int, group_size: int, device: torch.device, name: str = "error_feedback",
             collective: str = "all_reduce", nodes: int = 1) -> None:
        """Take this shape on first use, or check that it is the one the state was built for."""
        if self.numel is None:
            self.device = torch.device(device)
            self._allocate(collective, numel, group_size, nodes)
            return
        if (self.collective, self.numel, self.group_size, self.nodes) != (collective, numel, group_size, nodes):
            raise ValueError(f"{name} was built for {self._describe(self.collective, self.numel, self.group_size, self.nodes)}"
                             f", but this call is {self._describe(collective, numel, group_size, nodes)}: hold one "
                             f"ErrorFeedback per tensor (and reset() it when the group changes)")
        if self.send.device != torch.device(device):
            raise ValueError(f"{name}'s residuals are on {self.send.device}, the tensor is on {device}")

    @property
    def nbytes(self) -> int:
        """Bytes this state holds (0 before its first use)."""
        return 0 if self.send is None else (self.send.numel() + self.own.numel()) * self.send.element_size()

    def reset(self) -> None:
        """Zero the residuals (keeps the shape)."""
        if self.send is not None:
            self.send.zero_()
            self.own.zero_()
        self.calls = 0

    # ---------------------------------------------------------------- the update

    @staticmethod
    def compensate(values: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """fp32 ``values + residual`` (what is quantized in place of ``values``)."""
        return values.float() + residual.view(values.shape)

    def keep(self, residual: torch.Tensor, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """``residual`` (this state's tensor or a view into it) = ``compensated - decoded``, what the wire
        lost (with ``beta``, its moving average), non-finite entries zeroed."""
        lost = compensated - decoded.reshape(compensated.shape)
        lost.masked_fill_(~torch.isfinite(lost), 0.0)
        lost = lost.reshape(residual.shape)
        if self.beta:
            lost.mul_(1.0 - self.beta).add_(residual.float(), alpha=self.beta)
        residual.copy_(lost)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """``{"collective", "numel", "group_size", "nodes", "send", "own", "calls"}`` (tensors are the
        live residuals)."""
        return {"collective": self.collective, "numel": self.numel, "group_size": self.group_size,
                "nodes": self.nodes, "send": self.send, "own": self.own, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by :meth:`state_dict`; a state of another shape (another tensor, group
        size or model) is a ValueError and changes nothing."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            raise ValueError(f"not an ErrorFeedback state: keys {sorted(state) if isinstance(state, dict) else state!r}")
        numel, g = state["numel"], state["group_size"]
        if numel is None:
            if state["send"] is not None or state["own"] is not None:
                raise ValueError("an ErrorFeedback state without a shape holds residuals")
            if self.numel is not None:
                raise ValueError(f"the saved ErrorFeedback was never used, this one holds {self.numel} elements")
            self.calls = check_int(state["calls"], "calls", minimum=0)
            return
        collective = state["collective"]
        if collective not in COLLECTIVES:
            raise ValueError(f"ErrorFeedback state 'collective' must be one of {COLLECTIVES}, got {collective!r}")
        check_int(numel, "numel", minimum=0)
        check_int(g, "group_size", minimum=1)
        nodes = check_int(state["nodes"], "nodes", minimum=1)
        if collective == "reduce_scatter" and (g % nodes or numel % g):
            raise ValueError(f"ErrorFeedback state: {numel} elements over {g} ranks in {nodes} nodes is no qgZ shape")
        saved = (collective, numel, g, nodes)
        if self.numel is not None and (self.collective, self.numel, self.group_size, self.nodes) != saved:
            raise ValueError(f"the saved ErrorFeedback is for {self._describe(*saved)}, this one for "
                             f"{self._describe(self.collective, self.numel, self.group_size, self.nodes)}: it was "
                             f"saved for another tensor or model")
        for key, n in zip(("send", "own"), residual_sizes(collective, numel, g, nodes)):
            t = state[key]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or not t.is_floating_point():
                raise ValueError(f"ErrorFeedback state {key!r} must be a float tensor of shape ({n},), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"ErrorFeedback state {key!r} holds non-finite values")
        calls = check_int(state["calls"], "calls", minimum=0)
        if self.numel is None:
            self._allocate(collective, numel, g, nodes)
        self.send.copy_(state["send"])
        self.own.copy_(state["own"])
        self.calls = calls

    def __repr__(self) -> str:
        shape = "unbound" if self.numel is None else self._describe(self.collective, self.numel, self.group_size,
                                                                     self.nodes)
        return f"ErrorFeedback({shape}, dtype={self.dtype}, beta={self.beta}, calls={self.calls})"
