"""``Optimizer``: any torch optimizer stepping the fp32 master shards, with overflow skipping."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import user_grads
from .state import state_of


class LossScaler:
    """Dynamic loss scaling for fp16 compute (as ``torch.amp.GradScaler``).

    ``scale(loss)`` multiplies the loss; the :class:`Optimizer` divides the
    gradients by the scale before stepping, halves the scale (``backoff``) and skips
    the step when a gradient is non-finite, and doubles it (``growth``) after
    ``growth_interval`` clean steps.
    """

    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale!r}")
        if not growth > 1 or not 0 < backoff < 1:
            raise ValueError(f"growth must be > 1 and backoff in (0, 1), got {growth!r}, {backoff!r}")
        self.value = float(init_scale)
        self.growth, self.backoff = growth, backoff
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self._clean = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.value = max(self.min_scale, self.value * self.backoff)
            self._clean = 0
        else:
            self._clean += 1
            if self._clean >= self.growth_interval:
                self.value *= self.growth
                self._clean = 0

    def state_dict(self) -> dict:
        return {"value": self.value, "clean": self._clean}

    def load_state_dict(self, state: dict) -> None:
        self.value, self._clean = float(state["value"]), int(state["clean"])


class Optimizer(torch.optim.Optimizer):
    """Step ``optimizer_class`` (e.g. ``torch.optim.AdamW``) on the master shards of ``model``.

    ``model`` must come from :func:`qcoll.zero.shard`. A ``torch.optim.Optimizer``:
    LR schedulers and anything else that checks for one take it as it is. Its
    ``param_groups`` and ``state`` are those of the inner torch optimizer
    (``.optimizer``), so a scheduler's learning rate is the one that steps; step
    pre/post hooks run around :meth:`step`; ``state_dict`` is this rank's shard of the
    optimizer state (use :func:`qcoll.zero.save` for checkpoints). Each flat shard is one parameter
    of the inner optimizer, so per-parameter options (e.g. no weight decay on
    biases) apply per unit, and optimizers that need per-tensor norms (LAMB) see
    shards, not tensors.

    ``step()`` checks every rank's gradients for NaN/Inf (one all-reduce); if any is
    non-finite it skips the update, clears the gradients, counts it in
    ``skipped_steps``, sets ``last_step_skipped`` and returns False.

    ``requires_grad`` is read at each step: a parameter frozen after sharding (PEFT freezing the
    base model, a layer frozen by hand) keeps its exact values even when it shares a shard with
    trained ones (weight decay included), and a parameter that requires grad but whose shard is
    not stepped by this optimizer (frozen, or added to the model, when it was built) is a
    ValueError naming it: build the optimizer after such changes.
    """

    def __init__(self, model, optimizer_class, loss_scaler: LossScaler | None = None, **kwargs):
        state_of(model).engine.adopt_new_parameters()  # a TypeError unless qcoll.zero.shard(...) sharded it
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(f"loss_scaler must be a qcoll.zero.LossScaler, got {type(loss_scaler).__name__}")
        self.model = model
        self.masters = state_of(model).trainable_masters()
        if not self.masters:
            raise ValueError("model has no trainable parameters")
        self.optimizer = optimizer_class(self.masters, **kwargs)
        super().__init__(self.masters, self.optimizer.defaults)  # hooks, profiling of step
        self._share_inner()
        self.loss_scaler = loss_scaler
        self.skipped_steps = 0
        self.last_step_skipped = False

    def _share_inner(self) -> None:
        """One set of param groups and state: the inner optimizer's."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def state_dict(self) -> dict:
        """This rank's optimizer state (torch's format, over its master shards), plus
        the skipped-step count and the loss scaler under ``"qcoll"``."""
        out = super().state_dict()
        out["qcoll"] = {"skipped_steps": self.skipped_steps,
                        "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned on this rank (same world size)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        extra = state_dict.pop("qcoll", None)
        self.optimizer.load_state_dict(state_dict)
        self._share_inner()
        if extra is not None:
            self.skipped_steps = int(extra["skipped_steps"])
            if self.loss_scaler is not None and extra["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])

    def _found_inf(self) -> bool:
        local = torch.zeros(1)
        for m in self.masters:
            if m.grad is not None and not bool(torch.isfinite(m.grad).all()):
                local.fill_(1.0)
                break
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return bool(local.item())

    def step(self, closure=None) -> bool:
        """Update the master shards; False when skipped for non-finite gradients
        (True otherwise, where torch's optimizers return the closure's loss)."""
        if closure is not None:
            raise ValueError("closure is not supported by qcoll.zero.Optimizer")
        groups = self._synced_groups()
        self._check_trainable(groups)
        found_inf = self._found_inf()
        applied = self.loss_scaler.value if self.loss_scaler is not None else None
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if found_inf:
            self.skipped_steps += 1
            self.zero_grad()
            return False
        if applied is not None and applied != 1.0:
            for m in self.masters:
                if m.grad is not None:
                    m.grad.div_(applied)
        frozen = [g.master_slice(i) for g in groups if id(g.master) in self._stepped
                  for i, p in enumerate(g.params) if not p.requires_grad]
        kept = [f.clone() for f in frozen]
        inner_step = type(self.optimizer).step
        getattr(inner_step, "__wrapped__", inner_step)(self.optimizer)  # unhooked: the hooks ran around this step
        with torch.no_grad():
            for f, k in zip(frozen, kept):  # weight decay and momentum must not move a frozen parameter
                f.copy_(k)
        return True

    @property
    def _stepped(self) -> set:
        return {id(m) for m in self.masters}

    def _synced_groups(self) -> list:
        """The model's groups, their reductions waited for and the user's ``.grad = None`` taken."""
        state = state_of(self.model)
        state.engine.wait_reduces()
        for g in state.groups:
            user_grads.sync(g)
        return state.groups

    def _check_trainable(self, groups) -> None:
        stepped = self._stepped
        for g in groups:
            if g.trainable and id(g.master) not in stepped:
                names = [n for n, p in zip(g.names, g.params) if p.requires_grad]
                raise ValueError(f"qcoll.zero.Optimizer: parameter(s) {', '.join(map(repr, names[:3]))}"
                                 f"{' ...' if len(names) > 3 else ''} require grad, but were frozen or not part of "
                                 "the model when this Optimizer was built, so no step would change them; build the "
                                 "Optimizer after changing requires_grad or adding parameters (e.g. PEFT)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.masters:
            if set_to_none:
                m.grad = None
            elif m.grad is not None:
                m.grad.zero_()
        for g in state_of(self.model).groups:
            g.drop_param_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over all shards of all ranks) to ``max_norm``."""
        replicated = {id(g.master) for g in self._synced_groups() if g.replicated}
        sq = torch.zeros(1, dtype=torch.float64)
        world = dist.get_world_size()
        for m in self.masters:
            if m.grad is not None:  # a replicated master's gradient is on every rank: count it once
                sq += m.grad.double().pow(2).sum() / (world if id(m) in replicated else 1)
        dist.all_reduce(sq)
        norm = sq.sqrt()
        factor = float(max_norm) / (float(norm) + 1e-6)
        if factor < 1:
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(factor)
        return norm.float()
