"""Sharded checkpoints of a ZeRO++ model and optimizer through ``torch.distributed.checkpoint``.

Each flat group's master shard (and every optimizer state tensor of the same
shape) is saved as a 1-D ``DTensor`` sharded ``Shard(0)`` over the world, of
global length ``total``, in the compact layout (the parameters without the
block-alignment padding, see :mod:`qcoll.zero.flat`): DCP records global offsets, so a
checkpoint written by 4 ranks loads into 2 (or any other world size, or block size). Scalars (Adam's ``step``), buffers,
the engine's micro-step counter (stochastic-rounding seeds) and the loss scaler
are saved as replicated values, so a resume in the same world size continues
bit-identically. qgZ's error-feedback residuals (``ZeroConfig.grad_error_feedback``) are saved
per rank and restored only into the same layout (:mod:`qcoll.zero.grad_feedback`): on another
world size or node count they start at zero, with a warning.

A save replaces its directory atomically (:mod:`qcoll.zero.atomic_dir`): the ranks write
into a fresh sibling directory and rank 0 moves it into place once all have written, so a
crash at any point leaves the previous checkpoint or the new one, never a mix.

No code from a checkpoint directory runs on :func:`load` (:mod:`qcoll.zero.checkpoint_safety`):
``.metadata`` is unpickled resolving only DCP's metadata classes, every entry must be a tensor
(the optimizer's hyper-parameters and each group's parameter names and shapes, ``model.layout``,
are JSON text in uint8 tensors), and tensors are read with ``torch.load(weights_only=True)``.
A load is strict: a checkpoint whose keys, sizes, parameter names or shapes differ from the
model's (and optimizer's) raises a ValueError listing the differences, on every rank, before any
tensor is changed; so do optimizer hyper-parameters the optimizer would not accept and a damaged
AutoTune state (:mod:`qcoll.zero.load_checks`: checked on every rank, and the ranks agree). A DCP
failure on some rank raises one exception naming that rank's error.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from . import atomic_dir, grad_feedback
from .checkpoint_safety import (SafeReader, decode_param_groups, differences, encode_param_groups, from_json_tensor,
                                json_tensor, layout_differences, read_metadata, summarize)
from .checkpoint_safety import upgrade_checkpoint  # noqa: F401  (the earlier format's converter)
from .load_checks import agreed, check_param_groups
from .rank0 import on_rank0
from .state import state_of
from .optimizer import Optimizer

_meshes = {}


def _mesh(device: torch.device):
    key = (device.type, dist.get_world_size())
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _meshes[key]


def _dtensor(group, local: torch.Tensor) -> DTensor:
    """``local`` (a ``[S]`` shard in the group's block-aligned layout) as this rank's slice of the
    compact layout, a 1-D DTensor of the group's ``total`` elements (collective when padded)."""
    return DTensor.from_local(group.compact_shard(local), _mesh(local.device), [Shard(0)], run_check=False,
                              shape=torch.Size([group.total]), stride=(1,))


def _per_rank(local: torch.Tensor) -> DTensor:
    """This rank's ``[n]`` tensor (its own, not a slice of a shared one) as its slice of a ``[W * n]`` DTensor."""
    return DTensor.from_local(local, _mesh(local.device), [Shard(0)], run_check=False,
                              shape=torch.Size([dist.get_world_size() * local.numel()]), stride=(1,))


def _model_state(model) -> dict:
    groups = state_of(model).groups
    state = {f"flat.{g.name}": _dtensor(g, g.master.detach()) for g in groups}
    managed = {id(p) for g in groups for p in g.params}
    for key, value in model._plain_state_dict().items():
        if id(value) not in managed:
            state[f"buffer.{key}"] = value.detach()
    return state


def _layout(model) -> dict:
    """Each group's parameter names and shapes, in layout order (``model.layout`` in a checkpoint)."""
    return {g.name: [[n, list(s)] for n, s in zip(g.names, g.shapes)] for g in state_of(model).groups}


def _ensure_optimizer_state(opt: Optimizer) -> bool:
    """Create the inner optimizer's lazily made state with a zero-lr step on zero gradients;
    True when it did (a save then drops it again: the first real step must start fresh)."""
    inner = opt.optimizer
    if any(inner.state.get(m) for m in opt.masters):  # (a defaultdict may hold empty entries: no state yet)
        return False
    saved_lr = []
    for pg in inner.param_groups:
        saved_lr.append(pg.get("lr"))
        if "lr" in pg:
            pg["lr"] = torch.tensor(0.0) if isinstance(pg["lr"], torch.Tensor) else 0.0
    grads = [m.grad for m in opt.masters]
    for m in opt.masters:
        m.grad = torch.zeros_like(m)
    inner.step()
    for m, g in zip(opt.masters, grads):
        m.grad = g
    for pg, lr in zip(inner.param_groups, saved_lr):
        if lr is not None:
            pg["lr"] = lr
    for st in inner.state.values():  # what a fresh optimizer starts from (Adam: step 0, zero moments)
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                v.zero_()
            elif isinstance(v, (int, float)):
                st[k] = type(v)(0)
    return True


def _optimizer_state(opt: Optimizer, scaler: bool = True) -> dict:
    """The optimizer's tensors (the hyper-parameters are saved apart, as JSON: see :func:`save`)."""
    groups = {id(g.master): g for g in state_of(opt.model).groups}
    state = {}
    for m in opt.masters:
        g = groups[id(m)]
        for k, v in opt.optimizer.state.get(m, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == m.shape:
                state[f"{g.name}.{k}"] = _dtensor(g, v)
            elif isinstance(v, torch.Tensor):
                state[f"{g.name}.{k}"] = v
            else:
                state[f"{g.name}.{k}"] = torch.tensor(v, dtype=torch.float64)
    out = {"state": state, "skipped_steps": torch.tensor(opt.skipped_steps)}
    if opt.loss_scaler is not None and scaler:
        out["loss_scaler"] = torch.tensor([opt.loss_scaler.value, opt.loss_scaler._clean], dtype=torch.float64)
    return out


def _adaptive_state(ctl) -> dict:
    """The controller's state as fixed-shape tensors (the history padded with NaN to its window)."""
    history = torch.full((ctl.window,), float("nan"), dtype=torch.float64)
    history[: len(ctl.history)] = torch.tensor(list(ctl.history), dtype=torch.float64)
    return {"batch": torch.tensor(ctl.batch, dtype=torch.float64), "steps": torch.tensor(ctl.steps),
            "history": history, "last_cosine": torch.tensor(ctl.last_cosine, dtype=torch.float64),
            "base_lrs": torch.tensor(ctl.base_lrs, dtype=torch.float64)}


def _restore_adaptive(ctl, saved: dict) -> None:
    history = [float(c) for c in saved["history"].tolist() if c == c]
    ctl.load_state_dict({"batch": float(saved["batch"]), "steps": int(saved["steps"]), "history": history,
                         "last_cosine": float(saved["last_cosine"]), "base_lrs": saved["base_lrs"].tolist()})


def _check(model, optimizer, adaptive=None, autotune=None):
    from .adaptive import AdaptiveBatch

    state_of(model)  # a TypeError unless qcoll.zero.shard(...) sharded it
    if autotune is not None and (getattr(autotune, "model", None) is not model
                                 or not callable(getattr(autotune, "check_state_dict", None))):
        raise TypeError("autotune must be the qcoll.tune.AutoTune of this model")
    if adaptive is not None and (not isinstance(adaptive, AdaptiveBatch) or adaptive.optimizer is not optimizer):
        raise TypeError("adaptive must be the qcoll.zero.AdaptiveBatch of this optimizer")
    if optimizer is not None and (not isinstance(optimizer, Optimizer) or optimizer.model is not model):
        raise TypeError("optimizer must be the qcoll.zero.Optimizer of this model")


def _install(tmp: str, path: str):
    try:
        return atomic_dir.install(tmp, path)
    except BaseException:
        atomic_dir.discard(tmp)  # gone already if it was moved into place before the error
        raise


def save(checkpoint_dir, model, optimizer: Optimizer | None = None, adaptive=None, autotune=None) -> None:
    """Save the sharded model (and optimizer) state to ``checkpoint_dir`` (collective).

    ``checkpoint_dir`` (a str or os.PathLike) is replaced as a whole and atomically: every rank
    writes into a fresh sibling directory, and once all have written, rank 0 moves it into place
    (see :mod:`qcoll.zero.atomic_dir`). At every instant ``checkpoint_dir`` holds a complete
    checkpoint, the previous one until the move and the new one after, whichever rank dies
    when. A failure on rank 0 raises on every rank. All ranks must see the same filesystem at
    the same path (a local disk for one node, a shared filesystem such as NFS or Lustre across
    nodes) and the parent directory must be writable. An existing ``checkpoint_dir`` that is not
    empty and not a checkpoint is refused with a ValueError, untouched. One save at a time per
    directory.

    ``adaptive``: an :class:`~qcoll.zero.AdaptiveBatch` whose state is stored too; ``autotune``: a
    :class:`qcoll.tune.AutoTune` of this model, whose measurements and phase are stored as JSON (a
    resumed run goes on from them instead of exploring again).

    Only tensors are stored: the optimizer's hyper-parameters as JSON (None, bool, int, float,
    str, tuples, lists, str-keyed dicts, real tensors; anything else is a TypeError naming it).
    A failure inside ``torch.distributed.checkpoint`` on some rank raises, on every rank, a
    :class:`~qcoll.zero.checkpoint_safety.CheckpointOSError` (an OSError, e.g. ENOSPC) or a
    :class:`~qcoll.zero.checkpoint_safety.CheckpointError` naming that rank's error.
    """
    _check(model, optimizer, adaptive, autotune)
    path = atomic_dir.checkpoint_path(checkpoint_dir)
    state_of(model).engine.wait_reduces()
    state_of(model).engine.sync_buffers()  # every rank's buffers rank 0's: DCP writes each from any rank
    tmp = on_rank0(atomic_dir.prepare_save, path)
    try:
        state = {"model": _model_state(model), "engine": {"micro_step": torch.tensor(state_of(model).engine.micro_step)}}
        state["model"]["layout"] = json_tensor({"groups": _layout(model)})
        feedback = grad_feedback.checkpoint_state(state_of(model).groups, _per_rank)
        if feedback is not None:
            state["feedback"] = feedback
        created = optimizer is not None and _ensure_optimizer_state(optimizer)
        if optimizer is not None:
            state["optim"] = _optimizer_state(optimizer)
            state["optim"]["param_groups"] = encode_param_groups(optimizer.optimizer.param_groups)
        if adaptive is not None:
            state["adaptive"] = _adaptive_state(adaptive)
        if autotune is not None:  # JSON text, the same on every rank (rank 0's measurements)
            state["autotune"] = {"state": json_tensor(autotune.state_dict())}
        try:
            dcp.save(state, storage_writer=atomic_dir.writer(tmp))
        except CheckpointException as e:
            raise summarize(e, "qcoll.zero.save") from e
        finally:
            if created:  # saving must not change training: the first real step starts from no state
                optimizer.optimizer.state.clear()
        dist.barrier()  # every rank's files are written and synced before rank 0 moves the directory
    except BaseException:
        if dist.get_rank() == 0:
            atomic_dir.discard(tmp)
        raise
    superseded = on_rank0(_install, tmp, path)
    if superseded is not None and dist.get_rank() == 0:
        atomic_dir.discard(superseded)


def load(checkpoint_dir, model, optimizer: Optimizer | None = None, adaptive=None, autotune=None) -> None:
    """Load a checkpoint written by :func:`save`, with any world size (collective).

    FileNotFoundError when ``checkpoint_dir`` does not exist or holds no checkpoint (on every
    rank). If a save was cut short at the one point where ``checkpoint_dir`` is missing (the
    fallback without an atomic exchange), the previous checkpoint is restored and loaded.

    Nothing from the directory is executed: a ``.metadata`` naming any global but DCP's metadata
    classes, or any non-tensor entry, is refused with an
    :class:`~qcoll.zero.checkpoint_safety.UnsafeCheckpointError` (a ValueError) naming the file and
    the global or key; a checkpoint of the earlier format (pickled hyper-parameters) is refused
    likewise, with the converter to run (:func:`upgrade_checkpoint`). Strict: missing or unexpected
    keys, size mismatches, and (in checkpoints that record them) other parameter names or shapes
    in a group raise a ValueError listing them before any tensor is changed; so do hyper-parameters
    the optimizer would not accept (an unknown key, a value of another type, a non-finite number, one
    the optimizer class refuses: :func:`~qcoll.zero.load_checks.check_param_groups`) and a damaged
    ``autotune`` state (``AutoTune.check_state_dict``), naming the key or field, the same error on
    every rank. A failure while reading (a truncated or missing data file) raises a
    ``CheckpointError`` or ``CheckpointOSError`` naming the rank and the file; the model may then be
    partly loaded: load again. ``adaptive`` and
    ``autotune`` (as in :func:`save`) are restored when given; the checkpoint must hold them."""
    _check(model, optimizer, adaptive, autotune)
    path = atomic_dir.checkpoint_path(checkpoint_dir)
    state_of(model).engine.wait_reduces()
    path = on_rank0(atomic_dir.resolve_load, path)
    md = on_rank0(read_metadata, path)  # unpickled safely on rank 0, the same checked object on every rank
    created = optimizer is not None and _ensure_optimizer_state(optimizer)
    try:
        state = {"model": _model_state(model), "engine": {"micro_step": torch.tensor(0)}}
        if optimizer is not None:
            state["optim"] = _optimizer_state(optimizer, scaler="optim.loss_scaler" in md.state_dict_metadata)
        if adaptive is not None:
            state["adaptive"] = _adaptive_state(adaptive)
        hparams, tuned = _compare(path, md, state, model, optimizer, adaptive, autotune)  # tuned: checked
        feedback = _feedback_to_load(path, md, model)
        if feedback:
            state["feedback"] = feedback
        _dcp_load(state, path, md)
    except BaseException:
        if created:  # the optimizer is left as it was: without state
            optimizer.optimizer.state.clear()
        raise
    groups = {g.name: g for g in state_of(model).groups}
    with torch.no_grad():
        for key, value in state["model"].items():
            kind, name = key.split(".", 1)
            if kind == "flat":
                g = groups[name]
                local = value.to_local().clone()  # may be a view of the master itself (loaded in place)
                g.shard_from_compact(local, g.master)
        buffers = model._plain_state_dict()
        for key, value in state["model"].items():
            if key.startswith("buffer."):
                buffers[key[len("buffer."):]].copy_(value)
    state_of(model).engine.micro_step = int(state["engine"]["micro_step"])
    grad_feedback.restore(state_of(model).groups, state.get("feedback", {}))
    if optimizer is not None:
        _restore_optimizer(optimizer, state["optim"], hparams, groups)
    if adaptive is not None:
        _restore_adaptive(adaptive, state["adaptive"])
    if autotune is not None:
        autotune.apply_checked(tuned)


def _feedback_to_load(path: str, md, model) -> dict | None:
    """The model's qgZ residuals to load from the checkpoint, or None: the model has none, or they cannot
    be restored (saved without them or in another layout: then they are zeroed, with a warning)."""
    groups = state_of(model).groups
    entries = grad_feedback.checkpoint_state(groups, _per_rank)
    if entries is None:
        return None
    saved = md.state_dict_metadata.get("feedback.layout")
    layout = None
    if saved is not None and list(saved.size) == [3] and saved.properties.dtype == torch.int64:
        small = {"feedback": {"layout": torch.zeros(3, dtype=torch.int64)}}
        _dcp_load(small, path, md)
        layout = small["feedback"]["layout"]
    if not grad_feedback.restorable(groups, md, layout, entries):
        return None
    return {k: v for k, v in entries.items() if k != "layout"}


def _dcp_load(state: dict, path: str, md) -> None:
    try:
        dcp.load(state, storage_reader=SafeReader(path, md))
    except CheckpointException as e:
        raise summarize(e, "qcoll.zero.load") from e


def _flat_sizes(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat_sizes(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.shape  # a DTensor's is the global size
    return out


_JSON_LIMIT = 1 << 26  # bytes: the JSON entries are a few KiB; a crafted size must not allocate without bound


def _compare(path: str, md, state: dict, model, optimizer, adaptive, autotune=None) -> tuple:
    """The ValueError listing every difference between the checkpoint and ``state`` (keys, sizes) and
    the model's layout, or naming a bad hyper-parameter or AutoTune field, on every rank; else
    ``(the checkpoint's optimizer hyper-parameters, its AutoTune state checked)`` (each None when
    not asked for)."""
    expected = _flat_sizes(state)
    if optimizer is not None:
        expected["optim.param_groups"] = None
    if autotune is not None:
        expected["autotune.state"] = None
    owned = ("model.", "engine.") + (("optim.",) if optimizer is not None else ()) + (
        ("adaptive.",) if adaptive is not None else ()) + (("autotune.",) if autotune is not None else ())
    diffs = differences(expected, md, owned, optional=("model.layout", "optim.loss_scaler"))
    entries = md.state_dict_metadata
    small = {}
    for key in ("model.layout",) + (("optim.param_groups",) if optimizer is not None else ()) + (
            ("autotune.state",) if autotune is not None else ()):
        if key in entries:
            size, dtype = entries[key].size, entries[key].properties.dtype
            if len(size) != 1 or dtype != torch.uint8 or size[0] > _JSON_LIMIT:
                raise ValueError(f"qcoll.zero.load: {path!r}: {key} is a {dtype} tensor of size {list(size)}, "
                                 f"not JSON text (uint8, at most {_JSON_LIMIT} bytes)")
            small[key] = torch.empty(size, dtype=torch.uint8)
    if small:
        _dcp_load(small, path, md)
    return agreed(_checked_entries, path, small, diffs, model, optimizer, autotune)


def _checked_entries(path: str, small: dict, diffs: list, model, optimizer, autotune) -> tuple:
    """:func:`_compare` once its JSON entries are read (this rank's part: local, no collectives; the
    ranks agree on the outcome): the differences raised, else the optimizer hyper-parameters
    (:func:`~qcoll.zero.load_checks.check_param_groups`) and the AutoTune state
    (``AutoTune.check_state_dict``) checked, before any tensor is changed."""
    hparams = checked = None
    if "model.layout" in small:
        saved = from_json_tensor(small["model.layout"], f"{path}: model.layout")
        diffs = diffs + layout_differences(saved, _layout(model))
    if "optim.param_groups" in small:
        hparams = decode_param_groups(small["optim.param_groups"], f"{path}: optim.param_groups")
        if len(hparams) != len(optimizer.optimizer.param_groups):
            diffs = diffs + [f"optimizer param groups: {len(hparams)} in the checkpoint, "
                             f"{len(optimizer.optimizer.param_groups)} in the optimizer"]
    if diffs:
        raise ValueError(f"qcoll.zero.load: checkpoint {path!r} does not match the "
                         f"{'model and optimizer' if optimizer is not None else 'model'} ({len(diffs)} "
                         "difference(s)); nothing was loaded:\n  " + "\n  ".join(diffs))
    where = f"qcoll.zero.load: {path!r}:"
    try:
        if hparams is not None:
            check_param_groups(optimizer.optimizer, hparams, f"{where} optim.param_groups")
        if "autotune.state" in small:
            tuned = from_json_tensor(small["autotune.state"], f"{path}: autotune.state")
            where += " autotune.state:"
            checked = autotune.check_state_dict(tuned)
    except ValueError as e:
        raise ValueError(f"{'' if str(e).startswith(where) else where + ' '}{e}; nothing was loaded") from e
    return hparams, checked


def _restore_optimizer(opt: Optimizer, saved: dict, hparams: list, groups: dict) -> None:
    by_master = {id(g.master): g for g in groups.values()}
    with torch.no_grad():
        for m in opt.masters:
            g = by_master[id(m)]
            for k, v in opt.optimizer.state[m].items():
                loaded = saved["state"][f"{g.name}.{k}"]
                if isinstance(v, torch.Tensor) and v.shape == m.shape:
                    g.shard_from_compact(loaded.to_local().clone(), v)
                elif isinstance(v, torch.Tensor):
                    v.copy_(loaded)
                else:
                    opt.optimizer.state[m][k] = type(v)(loaded.item())
        for pg, hp in zip(opt.optimizer.param_groups, hparams):
            for k, v in hp.items():
                cur = pg.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)  # a tensor lr keeps its device and identity (schedulers hold it)
                else:
                    pg[k] = v
    opt.skipped_steps = int(saved["skipped_steps"])
    if opt.loss_scaler is not None and "loss_scaler" in saved:
        value, clean = saved["loss_scaler"].tolist()
        opt.loss_scaler.value, opt.loss_scaler._clean = value, int(clean)
