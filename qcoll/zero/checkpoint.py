"""Sharded checkpoints of a ZeRO++ model and optimizer through ``torch.distributed.checkpoint``.

Each flat group's master shard (and every optimizer state tensor of the same
shape) is saved as a 1-D ``DTensor`` sharded ``Shard(0)`` over the world, of
global length ``total``, in the compact layout (the parameters without the
block-alignment padding, see :mod:`qcoll.zero.flat`): DCP records global offsets, so a
checkpoint written by 4 ranks loads into 2 (or any other world size, or block size). Scalars (Adam's ``step``), buffers,
the engine's micro-step counter (stochastic-rounding seeds) and the loss scaler
are saved as replicated values, so a resume in the same world size continues
bit-identically.

A save replaces its directory atomically (:mod:`qcoll.zero.atomic_dir`): the ranks write
into a fresh sibling directory and rank 0 moves it into place once all have written, so a
crash at any point leaves the previous checkpoint or the new one, never a mix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from . import atomic_dir
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


def _model_state(model) -> dict:
    groups = state_of(model).groups
    state = {f"flat.{g.name}": _dtensor(g, g.master.detach()) for g in groups}
    managed = {id(p) for g in groups for p in g.params}
    for key, value in model._plain_state_dict().items():
        if id(value) not in managed:
            state[f"buffer.{key}"] = value.detach()
    return state


def _ensure_optimizer_state(opt: Optimizer) -> bool:
    """Create the inner optimizer's lazily made state with a zero-lr step on zero gradients;
    True when it did (a save then drops it again: the first real step must start fresh)."""
    inner = opt.optimizer
    if inner.state:
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


def _optimizer_state(opt: Optimizer) -> dict:
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
    hparams = [{k: v for k, v in pg.items() if k != "params"} for pg in opt.optimizer.param_groups]
    out = {"state": state, "param_groups": hparams, "skipped_steps": torch.tensor(opt.skipped_steps)}
    if opt.loss_scaler is not None:
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


def _check(model, optimizer, adaptive=None):
    from .adaptive import AdaptiveBatch

    state_of(model)  # a TypeError unless qcoll.zero.shard(...) sharded it
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


def save(checkpoint_dir, model, optimizer: Optimizer | None = None, adaptive=None) -> None:
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
    """
    _check(model, optimizer, adaptive)
    path = atomic_dir.checkpoint_path(checkpoint_dir)
    state_of(model).engine.wait_reduces()
    tmp = on_rank0(atomic_dir.prepare_save, path)
    try:
        state = {"model": _model_state(model), "engine": {"micro_step": torch.tensor(state_of(model).engine.micro_step)}}
        created = optimizer is not None and _ensure_optimizer_state(optimizer)
        if optimizer is not None:
            state["optim"] = _optimizer_state(optimizer)
        if adaptive is not None:
            state["adaptive"] = _adaptive_state(adaptive)
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, overwrite=False))
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


def load(checkpoint_dir, model, optimizer: Optimizer | None = None, adaptive=None) -> None:
    """Load a checkpoint written by :func:`save`, with any world size (collective).

    FileNotFoundError when ``checkpoint_dir`` does not exist or holds no checkpoint (on every
    rank). If a save was cut short at the one point where ``checkpoint_dir`` is missing (the
    fallback without an atomic exchange), the previous checkpoint is restored and loaded."""
    _check(model, optimizer, adaptive)
    path = atomic_dir.checkpoint_path(checkpoint_dir)
    state_of(model).engine.wait_reduces()
    path = on_rank0(atomic_dir.resolve_load, path)
    state = {"model": _model_state(model), "engine": {"micro_step": torch.tensor(0)}}
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        state["optim"] = _optimizer_state(optimizer)
    if adaptive is not None:
        state["adaptive"] = _adaptive_state(adaptive)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
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
    if optimizer is not None:
        _restore_optimizer(optimizer, state["optim"], groups)
    if adaptive is not None:
        _restore_adaptive(adaptive, state["adaptive"])


def _restore_optimizer(opt: Optimizer, saved: dict, groups: dict) -> None:
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
    for pg, hp in zip(opt.optimizer.param_groups, saved["param_groups"]):
        pg.update(hp)
    opt.skipped_steps = int(saved["skipped_steps"])
    if opt.loss_scaler is not None and "loss_scaler" in saved:
        value, clean = saved["loss_scaler"].tolist()
        opt.loss_scaler.value, opt.loss_scaler._clean = value, int(clean)
