"""``AutoTune``: the fastest communication configuration for the link the job has, found and kept
while it trains (RRL from :mod:`qcoll.tune`, online).

    model = qcoll.zero.shard(model, topo)                 # quantized weights: a block-aligned layout
    opt = qcoll.zero.Optimizer(model, torch.optim.AdamW, lr=1e-3)
    auto = qcoll.tune.AutoTune(model)                     # every rank
    for x, y in batches:
        model(x, y).backward(); opt.step(); auto.update(); opt.zero_grad()

:meth:`AutoTune.update` is called once per training step on every rank, after the optimizer step
(and before ``zero_grad``: the gradients are read for the error budget). It times the steps and,
when rank 0's :class:`~qcoll.tune.OnlinePolicy` decides, switches the model's wire format with
:func:`qcoll.zero.reconfigure.reconfigure`, on every rank before the same forward: rank 0 broadcasts
each decision (a few int64; the bytes are counted in :mod:`qcoll.comm.stats` as
``autotune.decision``), and the other ranks hear from it only at decision steps (the policy says
in its broadcast how many steps pass until the next). Only the wire format changes: the master
weights, gradients and optimizer state are the same tensors, so a run that switches computes
what a run using each configuration for the same steps computes.

The same on FSDP2: build it on the module given to :func:`qcoll.fsdp.quantize_comm` (every rank,
after ``quantize_comm``); it switches that module's wire format with
:func:`qcoll.fsdp.reconfigure_comm` (default space: weight bits 4/8/None, gradient bits
4/(8,4)/8/None, and 2 with error feedback; blocks and hpZ stay as installed) and measures the
errors on each rank's local shards (:mod:`qcoll.tune.drivers`). Its state is
:meth:`AutoTune.state_dict` (JSON), to save beside a DCP checkpoint.

Feasibility: before a configuration runs, the codec's relative error on the model's live weights
and gradients (:mod:`qcoll.tune.live_error`; one 32-byte all-reduce) must be within
``weight_error`` / ``grad_error`` (``feedback_error`` for gradients that run with error feedback,
whose lost part is re-sent at the next step); configurations over budget are told to the tuner as
infeasible and never run.
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch
import torch.distributed as dist

from ..checks import check_int, check_number
from ..comm.agreement import Agreement, wait_timeout
from ..comm.stats import stats
from ..zero.load_checks import agreed
from ..zero.config import ZeroConfig
from ..zero.reconfigure import with_knobs
from .drivers import driver_for
from .online_policy import OnlinePolicy, point_of
from .space import Space, config_label
from .tuners import TUNERS

_CHECK, _SWITCH, _KEEP, _FAILED = 0, 1, 2, 3


class AutoTune:
    """Online configuration search for a model sharded by :func:`qcoll.zero.shard` (module docstring).

    ``tuner``: ``"rrl"`` (default), ``"random"`` or ``"tpe"`` (optuna). ``space``: a
    :class:`~qcoll.tune.Space` of ZeroConfig fields (default :func:`~qcoll.tune.online_space`:
    weight bits 4/6/8/None, gradient bits 4/(8,4)/8/None, and 2 as well on a model sharded with
    ``grad_error_feedback=True``, hpZ, prefetch 0-2, reduce bucket 0/1M, hierarchical gathers); the
    configuration the model was sharded with must be one of its points (it is measured first).
    ``window``, ``explore``, ``reexplore``, ``abort``, ``drift_tolerance``, ``drift_patience``,
    ``confirm``: :class:`~qcoll.tune.OnlinePolicy`. ``weight_error`` / ``grad_error``: the budgets of
    the codec's relative L2 error on the live weights and gradients (:func:`~qcoll.tune.live_error.
    relative_errors`: for an int ``grad_bits``, the root sum of squares of qgZ's two hops' errors).
    ``seed``: the tuner's.

    ``feedback_error`` (default 1.25): the gradients' budget, in place of ``grad_error``, for the
    configurations whose gradients run with error feedback (``grad_error_feedback`` still true in
    ``with_knobs(model's config, **point)``: not with unquantized gradients nor an outlier reserve).
    There a step's error is not lost: what its codes failed to send is added to the next step's
    gradient and sent then (the sum received over T steps is the sum sent less the last residual),
    so it is delay, not loss, and the budget for loss (``grad_error``) would refuse 2-bit gradients
    always (0.77 per hop at block 128 on Gaussian data, 1.09 over the two hops; 1.0-1.15 over the
    first steps of a small transformer's gradients). What it still bounds is the delay: with a
    per-hop error ``e`` each residual is at most ``e`` times (gradient + previous residual), so it
    stays below ``e / (1 - e)`` steps of gradient, unbounded as ``e`` nears 1 (codes that send
    almost nothing, e.g. near-sparse heavy-tailed blocks). 1.25 over two hops is 0.88 per hop (a
    residual within about 8 steps of gradient); 2-bit passes at every Gaussian block size up to
    512 (1.19); a budget of sqrt(2) or more refuses nothing (a per-hop error is below 1 at any
    width). Whether 2-bit gradients with feedback train as well as wider ones is for benchmarks
    over hundreds of steps to show, not this per-step proxy. A point with 2-bit gradients on a
    model without feedback is held to ``grad_error`` like any other (infeasible at the defaults).

    Every rank builds it with the same arguments: they are compared through the store first, and
    ranks that differ get a ``ValueError`` on every rank naming the arguments and the ranks.
    One AutoTune per model: it owns the wire format (``ValueError`` for a second one). After each
    :meth:`update`: ``config`` (the ZeroConfig in use), ``label``, ``history`` (per step
    after the first: ``step``, ``label``, ``seconds`` (this rank's), ``phase``), ``switches``,
    ``decision_bytes`` (this rank's part of the decisions' broadcasts and error all-reduces).
    """

    def __init__(self, model, tuner: str = "rrl", space: Space | None = None, window: int = 4, explore: int = 12,
                 reexplore: int | None = 8, abort: float = 1.5, drift_tolerance: float = 0.2, drift_patience: int = 2,
                 confirm: int = 3, weight_error: float = 0.15, grad_error: float = 0.25,
                 feedback_error: float = 1.25, seed: int = 0):
        driver = driver_for(model)   # a TypeError for a model neither engine runs
        space = driver.default_space() if space is None else space
        _agree_arguments(tuner=tuner, space=[[k.name, repr(k.values)] for k in space.knobs] if isinstance(
            space, Space) else repr(space), window=window, explore=explore, reexplore=reexplore, abort=abort,
            drift_tolerance=drift_tolerance, drift_patience=drift_patience, confirm=confirm,
            weight_error=weight_error, grad_error=grad_error, feedback_error=feedback_error, seed=seed)
        if tuner not in ("rrl", "random", "tpe"):
            raise ValueError(f"tuner must be 'rrl', 'random' or 'tpe', got {tuner!r}")
        if not isinstance(space, Space):
            raise TypeError(f"space must be a qcoll.tune.Space, got {type(space).__name__}")
        fields = set(ZeroConfig.__dataclass_fields__)
        unknown = [k.name for k in space.knobs if k.name not in fields]
        if unknown:
            raise ValueError(f"space knobs must be ZeroConfig fields; unknown: {unknown}")
        fixed = [k.name for k in space.knobs if k.name not in driver.knob_fields]
        if fixed:
            raise ValueError(f"space knobs {fixed} cannot be switched on {driver.engine} (its knobs: "
                             f"{sorted(driver.knob_fields)})")
        self.weight_error = check_number(weight_error, "weight_error", above=0)
        self.grad_error = check_number(grad_error, "grad_error", above=0)
        self.feedback_error = check_number(feedback_error, "feedback_error", above=0)
        self.model, self.space, self.tuner_name, self.seed = model, space, tuner, check_int(seed, "seed")
        self.driver = driver
        self.base = driver.config
        self.point = self._point_of(self.base)
        for k in space.knobs:  # every configuration of the space must be buildable on this layout
            if k.name == "weight_bits" and not all(driver.allows(with_knobs(self.base, weight_bits=v))
                                                   for v in k.values):
                raise ValueError("AutoTune switches to quantized weights, which need a block-aligned layout: "
                                 "shard the model with quantized weights (e.g. the default ZeroConfig(); AutoTune "
                                 "may still pick weight_bits=None)")
        if driver.owner() is not None:
            raise ValueError("this model has an AutoTune already; one tuner owns a model's wire format")
        self.rank = dist.get_rank()
        self._settings = dict(window=window, explore=explore, reexplore=reexplore, abort=abort,
                              drift_tolerance=drift_tolerance, drift_patience=drift_patience, confirm=confirm)
        # built on every rank, so that every rank refuses the same bad arguments; only rank 0 keeps it
        policy = OnlinePolicy(TUNERS[tuner](space, seed=seed), self.point, feasible=self._feasible, **self._settings)
        self.policy = policy if self.rank == 0 else None
        driver.claim(self)
        self._next = policy.due()   # steps until the next decision (the same on every rank)
        self._last = None           # perf_counter at the previous update
        self._errors = {}           # rank 0: (exploration, quantization) -> feasible
        self.steps = 0
        self.switches = 0
        self.decision_bytes = 0
        self.history: list[dict] = []
        self.last_errors: dict | None = None   # the last error check: label, weight, grad, grad_budget

    # ------------------------------------------------------------------ what runs
    @property
    def config(self):
        """The :class:`~qcoll.zero.ZeroConfig` the model runs now."""
        return self.driver.config

    @property
    def label(self) -> str:
        return config_label(self.space.config(self.point))

    @property
    def phase(self) -> str:
        """``"explore"`` or ``"exploit"`` (rank 0's; ``"follow"`` on the other ranks)."""
        return self.policy.phase.value if self.policy is not None else "follow"

    def _point_of(self, config) -> tuple:
        point = []
        for k in self.space.knobs:
            value = getattr(config, k.name)
            if value not in k.values:
                raise ValueError(f"the model's {k.name}={value!r} is not among the space's values {k.values}: "
                                 f"shard with one of them, or add it to the knob")
            point.append(k.values.index(value))
        return tuple(point)

    # ------------------------------------------------------------------ the step
    def update(self) -> None:
        """End of a training step (every rank, after ``optimizer.step()``, before ``zero_grad()``):
        time it, and at decision steps switch the configuration on every rank. The first call
        only starts the clock."""
        now = time.perf_counter()
        if self._last is None:
            self._last = now
            return
        seconds, self._last = now - self._last, now
        self.steps += 1
        self.history.append({"step": self.steps, "label": self.label, "seconds": seconds, "phase": self.phase})
        if self.policy is not None:
            self.policy.observe(seconds)
        self._next -= 1
        if self._next == 0:
            self._decide()

    def _decide(self) -> None:
        if self.policy is not None:
            try:
                point = self.policy.decide()   # its feasibility checks are collectives (_feasible)
            except BaseException:              # the other ranks wait for a decision: tell them, not hang them
                self._send(_FAILED, 1, self.point)
                raise
            _, due, _ = self._send(_SWITCH if point is not None else _KEEP, self.policy.due(), self.policy.current)
        else:
            while True:
                kind, due, point = self._send(None, 0, self.point)
                if kind == _FAILED:
                    raise RuntimeError("qcoll.tune.AutoTune: rank 0 failed while deciding the next configuration "
                                       "(its error says why)")
                if kind != _CHECK:
                    break
                self._check(point)
        self._next = due

    def _send(self, kind, due: int, point) -> tuple:
        """Rank 0 broadcasts ``[kind, due, *point]``; every rank applies a switch and returns the message."""
        msg = torch.tensor([-1 if kind is None else kind, due, *point], dtype=torch.int64)
        dist.broadcast(msg, src=0)
        sent = msg.numel() * msg.element_size() if self.rank == 0 else 0
        self.decision_bytes += sent
        stats.add("autotune.decision", None, sent)
        kind, due, *point = msg.tolist()
        if kind == _SWITCH:
            self._apply(tuple(point))
        return kind, due, tuple(point)

    def _config_of(self, point):
        return with_knobs(self.base, **self.space.config(point))

    def _apply(self, point) -> None:
        self.driver.apply(self._config_of(point))
        self.point = point
        self.switches += 1

    # ------------------------------------------------------------------ the error budget
    def _feasible(self, point) -> bool:
        """Rank 0 (the policy's callback): whether ``point``'s codec error on the live tensors is within
        the budgets; measured on every rank (a CHECK broadcast, then :meth:`_check`), once per
        quantization per exploration."""
        cfg = self._config_of(point)
        key = (self.policy.explorations, cfg.weight_bits, cfg.grad_bits, cfg.weight_block, cfg.grad_block,
               cfg.grad_error_feedback)
        if key not in self._errors:
            self._send(_CHECK, 0, point)
            self._errors[key] = self._check(point)
        return self._errors[key]

    def grad_budget(self, config) -> float:
        """The gradients' error budget of a configuration (a ZeroConfig): ``feedback_error`` when its
        gradients run with error feedback, else ``grad_error``."""
        return self.feedback_error if config.grad_error_feedback else self.grad_error

    def _check(self, point) -> bool:
        cfg = self._config_of(point)
        weight, grad = self.driver.errors(cfg)
        self.decision_bytes += 32
        budget = self.grad_budget(cfg)
        self.last_errors = {"label": config_label(self.space.config(point)), "weight": weight, "grad": grad,
                            "grad_budget": budget}
        return not weight > self.weight_error and not grad > budget   # NaN (no gradient yet): not over

    # ------------------------------------------------------------------ checkpoints
    def _space_doc(self) -> list:
        return [[k.name, repr(k.values)] for k in self.space.knobs]

    def state_dict(self) -> dict:
        """The tuner's state, JSON-able and the same on every rank (rank 0's measurements and phase;
        a collective: every rank calls it). :func:`qcoll.zero.save` (``autotune=``) stores it."""
        doc = None
        if self.rank == 0:
            doc = {"version": 1, "tuner": self.tuner_name, "seed": self.seed, "space": self._space_doc(),
                   "point": list(self.point), "next": self._next, "steps": self.steps, "switches": self.switches,
                   "policy": self.policy.state_dict()}
        return _broadcast_json(doc)

    def load_state_dict(self, doc: dict) -> None:
        """Restore :meth:`state_dict` (every rank, the same ``doc``, between steps; a collective): the
        configuration it ran is switched to, and rank 0's policy goes on from the saved
        measurements (a resumed run does not explore from scratch).

        :meth:`check_state_dict` on every rank first, then the ranks agree
        (:func:`qcoll.zero.load_checks.agreed`), then :meth:`apply_checked`: a ``doc`` that fails
        any check on any rank raises the same ``ValueError`` (naming the field) on every rank and
        changes nothing on any."""
        self.apply_checked(agreed(self.check_state_dict, doc))

    def check_state_dict(self, doc: dict) -> "CheckedState":
        """``doc`` checked, nothing changed (this rank alone: no collectives); ``ValueError`` naming
        the field when it is not a :meth:`state_dict` of this AutoTune's tuner and space.

        Every field is checked on every rank, rank 0's policy included: a policy is built (as in
        ``__init__``) and the saved ``policy`` loaded into it (:meth:`OnlinePolicy.load_state_dict`);
        ``point`` must be a list of ints, a point of the space, and the policy's current
        configuration (AutoTune runs what the policy chose); ``steps`` and ``switches`` ints >= 0. ``next`` (steps until the next
        decision) is bounded by the restored policy itself: AutoTune sets it to ``policy.due()`` at
        each decision, and each step adds one time to the policy's window and takes one off
        ``next``, so between steps ``next == policy.due()`` (at most ``window``). A larger value
        would hold the policy's decision back (``10**30``: the tuner never decides again) and is
        refused; a smaller one (>= 1) is accepted: it only brings the decision forward (a resume
        with a larger ``window``). Pass the result to :meth:`apply_checked`."""
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise ValueError("not an AutoTune state (version 1)")
        missing = [k for k in _STATE_FIELDS if k not in doc]
        unknown = [k for k in doc if k not in _STATE_FIELDS]
        if missing or unknown:
            raise ValueError(f"the AutoTune state {'lacks ' + ', '.join(map(repr, missing)) if missing else ''}"
                             f"{' and ' if missing and unknown else ''}"
                             f"{'has unknown fields ' + ', '.join(map(repr, unknown)) if unknown else ''}")
        if doc["tuner"] != self.tuner_name or doc["space"] != self._space_doc():
            raise ValueError(f"the AutoTune state was saved with tuner {doc['tuner']!r:.40} and space "
                             f"{doc['space']!r:.400}; this AutoTune has {self.tuner_name!r} and {self._space_doc()}")
        point = point_of(self.space, doc["point"], "the AutoTune state's 'point'")
        steps = check_int(doc["steps"], "the AutoTune state's 'steps'", minimum=0)
        switches = check_int(doc["switches"], "the AutoTune state's 'switches'", minimum=0)
        if not isinstance(doc["policy"], dict):
            raise ValueError(f"the AutoTune state's 'policy' must be a dict, got {type(doc['policy']).__name__}")
        policy = OnlinePolicy(TUNERS[self.tuner_name](self.space, seed=self.seed), point, feasible=self._feasible,
                              **self._settings)
        try:
            policy.load_state_dict(doc["policy"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"the AutoTune state's 'policy': {e}") from e
        if policy.current != point:
            raise ValueError(f"the AutoTune state's 'point' {list(point)} is not its policy's current configuration "
                             f"{list(policy.current)}")
        due = policy.due()
        nxt = check_int(doc["next"], "the AutoTune state's 'next'", minimum=1)
        if nxt > due:
            raise ValueError(f"the AutoTune state's 'next' must be at most {due} (the restored policy's next decision "
                             f"is due in {due} step(s); window={policy.window}), got {nxt!r:.40}")
        config = self._config_of(point)
        if not self.driver.allows(config):
            raise ValueError(f"the AutoTune state's 'point' {list(point)} needs quantized weights on a layout "
                             "without them")
        self.driver.check(config, f"the AutoTune state's 'point' {list(point)}")
        return CheckedState(self, point, nxt, steps, switches, policy)

    def apply_checked(self, checked: "CheckedState") -> None:
        """Restore a state :meth:`check_state_dict` returned (on every rank, once every rank's
        check passed): switch to its configuration (:func:`qcoll.zero.reconfigure`), then take its
        counters and (rank 0) its policy."""
        if not isinstance(checked, CheckedState) or checked.owner is not self:
            raise TypeError("apply_checked takes what this AutoTune's check_state_dict returned")
        if checked.point != self.point:
            self.driver.apply(self._config_of(checked.point))
            self.point = checked.point
        self._next, self.steps, self.switches = checked.next, checked.steps, checked.switches
        self.policy = checked.policy if self.rank == 0 else None
        self._last = None
        self._errors = {}


#: the fields of :meth:`AutoTune.state_dict`
_STATE_FIELDS = ("version", "tuner", "seed", "space", "point", "next", "steps", "switches", "policy")


@dataclasses.dataclass(frozen=True, eq=False)
class CheckedState:
    """An AutoTune state checked by :meth:`AutoTune.check_state_dict`, for :meth:`AutoTune.apply_checked`."""

    owner: AutoTune
    point: tuple
    next: int
    steps: int
    switches: int
    policy: OnlinePolicy


_AGREEMENT = Agreement("AutoTune")


def _agree_arguments(**arguments) -> None:
    """Every rank built its AutoTune with the same arguments (only rank 0's policy decides, and the
    decisions' broadcast has the space's length), or every rank raises a ValueError naming the
    arguments that differ from rank 0's and the ranks; compared before anything is checked, so a
    value only some ranks refuse leaves no rank waiting."""
    _AGREEMENT.same_fields({k: repr(v) for k, v in arguments.items()}, wait_timeout(),
                           "Every rank must build the model's AutoTune.")


def _broadcast_json(doc):
    """Rank 0's JSON-able ``doc`` on every rank (UTF-8 bytes: length, then the bytes)."""
    data = json.dumps(doc).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.tolist()).decode())
