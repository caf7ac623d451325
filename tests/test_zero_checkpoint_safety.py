"""qcoll.zero.load runs no code from a checkpoint directory, refuses mismatched checkpoints before
changing anything, and reports DCP failures as one line.

The crafted payloads create a marker file when unpickled the way DCP would (``pickle.load`` of
``.metadata``, ``torch.load(weights_only=False)`` of non-tensor entries): each test asserts the
refusal and that the marker never appears.
"""
import dataclasses
import errno
import io
import math
import os
import pickle
import shlex

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import qcoll
from qcoll import zero
from qcoll.testing import Batches, corpus, tiny_model, train_steps
from qcoll.testing.models import TINY, TransformerConfig
from qcoll.zero import checkpoint_safety as cs

from zero_helpers import make_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one-process DCP
THREE_BLOCKS = TransformerConfig(context=32, d_model=64, n_layers=3, n_heads=2)


class _Touch:
    """Unpickling this runs ``touch <path>`` (what a crafted checkpoint could do with any command)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.path)}",)


def _model(cfg=TINY, seed=0, edit=None):
    model = tiny_model(seed, cfg)
    if edit is not None:
        edit(model)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(stochastic_grad_rounding=True), units=model.units())
    cls, kw = make_optimizer("adamw")
    return m, zero.Optimizer(m, cls, **kw)


def _trained(cfg=TINY, seed=0, steps=1, edit=None):
    m, opt = _model(cfg, seed, edit)
    train_steps(m, opt, Batches(corpus(), 8, 32, seed), steps, rank=dist.get_rank(), world=dist.get_world_size())
    return m, opt


def _opt_state(opt):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            for pg in opt.param_groups for p in pg["params"]]


def _error(fn, *args):
    """(type name, message, is an OSError, errno, type name of __cause__) of what ``fn`` raised, or None."""
    try:
        fn(*args)
    except BaseException as e:  # CheckpointException is a BaseException
        return (type(e).__name__, str(e), isinstance(e, OSError), getattr(e, "errno", None),
                type(e.__cause__).__name__ if e.__cause__ is not None else None)
    return None


def _save(rank, world, path, cfg=TINY, steps=1):
    m, opt = _trained(cfg, 0, steps)
    zero.save(path, m, opt)
    return m.state_dict(), [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]


def _load_fresh(rank, world, path, cfg=TINY):
    """Load into a fresh model and optimizer: (error or None, state_dict, param groups)."""
    m, opt = _model(cfg, 99)
    err = _error(zero.load, path, m, opt)
    return err, m.state_dict(), [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]


# --- 1. no code from the directory runs -------------------------------------------------------

def test_metadata_unpickler_allows_dcp_metadata_only(tmp_path):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)
    entries = {f"t{i}": TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size([4]),
                                              [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
               for i, dt in enumerate([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])}
    storage = {MetadataIndex(k, [0]): _StorageInfo("__0_0.distcp", 64 * i, 64) for i, k in enumerate(entries)}
    md = Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    got = cs.read_metadata(tmp_path)
    assert got.state_dict_metadata == entries and got.storage_data == storage

    marker = tmp_path / "MARKER"
    md.planner_data = _Touch(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(cs.UnsafeCheckpointError, match=r"\.metadata: refusing to unpickle the global (posix|nt)\.system"):
        cs.read_metadata(tmp_path)
    assert not marker.exists()

    md.planner_data = None  # a data location outside the directory
    md.storage_data = {MetadataIndex("t0", [0]): _StorageInfo("../../etc/passwd", 0, 16)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(cs.UnsafeCheckpointError, match=r"the data of 't0' is in '\.\./\.\./etc/passwd'"):
        cs.read_metadata(tmp_path)


def _load_crafted(rank, world, path, marker):
    m, opt = _model(TINY, 7)
    before = m.state_dict()
    err = _error(zero.load, path, m, opt)
    after = m.state_dict()
    return err, all(torch.equal(before[k], after[k]) for k in before), os.path.exists(marker), len(opt.state)


def test_crafted_metadata_is_refused_and_runs_nothing(ranks4, tmp_path):
    path, marker = str(tmp_path / "ck"), str(tmp_path / "MARKER")
    ranks4.run(_save, path, timeout=120)
    md = cs.read_metadata(path)
    md.planner_data = _Touch(marker)  # otherwise a valid checkpoint: plain pickle.load would run it and go on
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    for err, unchanged, marker_seen, opt_entries in ranks4.run(_load_crafted, path, marker, timeout=120):
        assert err is not None and err[0] == "UnsafeCheckpointError", err
        assert os.path.join(path, ".metadata") in err[1] and "system" in err[1], err
        assert unchanged and not marker_seen and opt_entries == 0
    assert not os.path.exists(marker)


def _full_state(path, allow_bytes=False):
    """Every entry of a checkpoint, read in this one process (tensors only, unless ``allow_bytes``)."""
    md = cs.read_metadata(path, allow_bytes=allow_bytes)
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(state, storage_reader=cs.SafeReader(path, md), no_dist=True)
    return state


def _write_legacy(src, dst):
    """``src`` rewritten as the earlier qcoll wrote it: param_groups pickled (BYTE_IO), no layout."""
    state = _full_state(src)
    del state["model.layout"]
    state["optim.param_groups"] = cs.decode_param_groups(state.pop("optim.param_groups"), "test")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)


def _poison(path, key, payload: bytes, new_entry: bool):
    """Point ``key`` (a BYTE_IO entry, added when ``new_entry``) at ``payload`` appended to a data file."""
    md = cs.read_metadata(path, allow_bytes=True)
    data = os.path.join(path, "__0_0.distcp")
    offset = os.path.getsize(data)
    with open(data, "ab") as f:
        f.write(payload)
    if new_entry:
        md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset, len(payload))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_crafted_pickled_entries_are_refused_and_run_nothing(ranks4, tmp_path):
    src, marker = str(tmp_path / "ck"), str(tmp_path / "MARKER")
    ranks4.run(_save, src, timeout=120)
    # (a) a checkpoint in the earlier format whose pickled lr runs a command when torch.load-ed
    legacy = str(tmp_path / "legacy")
    _write_legacy(src, legacy)
    _poison(legacy, "optim.param_groups.0.lr", _torch_saved(_Touch(marker)), new_entry=False)
    for err, unchanged, marker_seen, opt_entries in ranks4.run(_load_crafted, legacy, marker, timeout=120):
        assert err is not None and err[0] == "UnsafeCheckpointError", err
        assert "'optim.param_groups.0.lr'" in err[1] and "upgrade_checkpoint" in err[1], err
        assert unchanged and not marker_seen and opt_entries == 0
    with pytest.raises(cs.CheckpointError, match=r"'optim.param_groups.0.lr' is refused by torch.load\(weights_only"
                       r"=True\): .*GLOBAL (posix|nt)\.system"):  # the converter reads them weights_only
        cs.upgrade_checkpoint(legacy, str(tmp_path / "converted"))
    assert not os.path.exists(marker)
    # (b) a current checkpoint with an added non-tensor entry
    _poison(src, "optim.extra", _torch_saved(_Touch(marker)), new_entry=True)
    for err, unchanged, marker_seen, _ in ranks4.run(_load_crafted, src, marker, timeout=120):
        assert err is not None and err[0] == "UnsafeCheckpointError" and "'optim.extra'" in err[1], err
        assert unchanged and not marker_seen
    assert not os.path.exists(marker)


def test_earlier_format_converts_and_loads(ranks4, tmp_path):
    src, legacy = str(tmp_path / "ck"), str(tmp_path / "legacy")
    saved, groups = ranks4.run(_save, src, timeout=120)[0]
    _write_legacy(src, legacy)
    assert isinstance(cs.read_metadata(legacy, allow_bytes=True).state_dict_metadata["optim.param_groups.0.betas"],
                      BytesStorageMetadata)
    cs.upgrade_checkpoint(legacy)  # in place
    with pytest.raises(ValueError, match="already in the current format"):
        cs.upgrade_checkpoint(legacy)
    for err, loaded, loaded_groups in ranks4.run(_load_fresh, legacy, timeout=120):
        assert err is None, err
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
        assert loaded_groups == groups


def test_hyper_parameters_round_trip_as_json():
    groups = [{"params": [1], "lr": torch.tensor(3e-3), "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "foreach": None, "nesterov": True, "momentum": 0, "name": "decay",
               "initial_lr": float("inf"), "extra": {"a": [1, (2.5, None)]}, "nan": float("nan")}]
    t = cs.encode_param_groups(groups)
    assert t.dtype == torch.uint8 and t.dim() == 1
    (back,) = cs.decode_param_groups(t, "x")
    assert back.keys() == groups[0].keys() - {"params"}
    assert isinstance(back["lr"], torch.Tensor) and back["lr"].dtype == torch.float32
    assert back["lr"].item() == groups[0]["lr"].item()
    assert back["betas"] == (0.9, 0.95) and type(back["betas"]) is tuple
    assert back["momentum"] == 0 and type(back["momentum"]) is int and back["eps"] == 1e-8
    assert back["foreach"] is None and back["amsgrad"] is False and back["name"] == "decay"
    assert back["extra"] == {"a": [1, (2.5, None)]} and back["initial_lr"] == math.inf and math.isnan(back["nan"])
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['fn'\] is a function"):
        cs.encode_param_groups([{"fn": lambda: 0}])
    with pytest.raises(ValueError, match="unexpected value"):
        cs.decode_param_groups(cs.json_tensor({"qcoll_param_groups": 1, "groups": [{"lr": {"x": 1}}]}), "x")


# --- 2. strict loads --------------------------------------------------------------------------

def _rename_final_norm(model):
    class Norm(torch.nn.Module):  # same size as ln_f, other parameter names
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(64))
            self.shift = torch.nn.Parameter(torch.zeros(64))

        def forward(self, x):
            return torch.nn.functional.layer_norm(x, (64,), self.gain, self.shift)

    model.ln_f = Norm()


def _reshape_positions(model):
    model.pos = torch.nn.Parameter(torch.zeros(64, 32))  # 2048 elements, as (32, 64)


_EDITS = {"rename": _rename_final_norm, "reshape": _reshape_positions}


def _load_mismatched(rank, world, path, cfg, edit, trained):
    m, opt = (_trained if trained else _model)(cfg, 5, edit=_EDITS.get(edit))
    before, opt_before = m.state_dict(), _opt_state(opt)
    step = zero.state_of(m).engine.micro_step
    err = _error(zero.load, path, m, opt)
    after, opt_after = m.state_dict(), _opt_state(opt)
    same = all(torch.equal(before[k], after[k]) for k in before) and len(opt_before) == len(opt_after) and all(
        x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
        for x, y in zip(opt_before, opt_after))
    return err, same and zero.state_of(m).engine.micro_step == step


def _assert_refused(results, *needles):
    for err, unchanged in results:
        assert err is not None and err[0] == "ValueError" and "does not match the model" in err[1], err
        for n in needles:
            assert n in err[1], (n, err[1])
        assert unchanged


def test_strict_load_lists_differences_and_changes_nothing(ranks4, tmp_path):
    three, two = str(tmp_path / "three"), str(tmp_path / "two")
    ranks4.run(_save, three, THREE_BLOCKS, timeout=120)
    ranks4.run(_save, two, TINY, timeout=120)
    _assert_refused(ranks4.run(_load_mismatched, three, TINY, None, True, timeout=120),
                    "unexpected keys", "model.flat.blocks.2", "optim.state.blocks.2.exp_avg")
    _assert_refused(ranks4.run(_load_mismatched, two, THREE_BLOCKS, None, False, timeout=120),
                    "missing keys", "model.flat.blocks.2")
    _assert_refused(ranks4.run(_load_mismatched, two, TINY, "rename", True, timeout=120),
                    "group 'ln_f': parameters only in the checkpoint: ln_f.weight, ln_f.bias",
                    "parameters only in the model: ln_f.gain, ln_f.shift")
    _assert_refused(ranks4.run(_load_mismatched, two, TINY, "reshape", False, timeout=120),
                    "shape mismatch for pos (group '<root>'): [32, 64] in the checkpoint, [64, 32] in the model")


def test_strict_load_without_layout_compares_sizes(ranks4, tmp_path):
    """A checkpoint without ``model.layout`` (the earlier format, converted) is checked by group sizes."""
    src, legacy = str(tmp_path / "ck"), str(tmp_path / "legacy")
    ranks4.run(_save, src, timeout=120)
    _write_legacy(src, legacy)
    cs.upgrade_checkpoint(legacy)
    assert "model.layout" not in cs.read_metadata(legacy).state_dict_metadata
    for err, unchanged in ranks4.run(_load_mismatched, legacy, TINY, "rename", False, timeout=120):
        assert err is None, err  # same sizes, other names: not detectable without the layout
    _assert_refused(ranks4.run(_load_mismatched, legacy, THREE_BLOCKS, None, True, timeout=120),
                    "missing keys", "model.flat.blocks.2")


# --- 3. DCP failures as one line --------------------------------------------------------------

def test_truncated_data_file_names_the_file(ranks4, tmp_path):
    path = str(tmp_path / "ck")
    ranks4.run(_save, path, timeout=120)
    data = os.path.join(path, "__1_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    for err, _, _ in ranks4.run(_load_fresh, path, timeout=120):
        assert err is not None and err[0] == "CheckpointError" and not err[2], err
        assert err[1].startswith("qcoll.zero.load: rank 1 failed: ") and "\n" not in err[1], err
        assert repr(data) in err[1] and "truncated" in err[1], err
        assert err[4] == "CheckpointException", err


def _save_out_of_space(rank, world, path, victim):
    import torch.distributed.checkpoint.filesystem as fs

    m, opt = _trained(TINY, 3, 1)
    write_item = fs._write_item

    def no_space(transforms, stream, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)

    if rank == victim:
        fs._write_item = no_space
    try:
        return _error(zero.save, path, m, opt)
    finally:
        fs._write_item = write_item


def test_save_failure_is_one_oserror(ranks4, tmp_path):
    path = str(tmp_path / "ck")
    saved, _ = ranks4.run(_save, path, timeout=120)[0]
    for err in ranks4.run(_save_out_of_space, path, 1, timeout=120):
        assert err is not None and err[0] == "CheckpointOSError" and err[2] and err[3] == errno.ENOSPC, err
        assert err[1].startswith("qcoll.zero.save: rank 1 failed: [Errno 28] No space left on device: '"), err
        assert "__1_0.distcp'" in err[1] and "\n" not in err[1] and err[4] == "CheckpointException", err
    for err, loaded, _ in ranks4.run(_load_fresh, path, timeout=120):  # the previous checkpoint is intact
        assert err is None and all(torch.equal(saved[k], loaded[k]) for k in saved), err


def test_metadata_cannot_set_attributes_of_a_class():
    """BUILD on an allowed class itself (not an instance) would change it for the whole process."""
    import io
    import pathlib

    from qcoll.zero.checkpoint_safety import MetadataUnpickler, UnsafeCheckpointError

    payload = b"cpathlib\nPosixPath\n(N}S'_qcoll_marker'\nI1\nstb."
    with pytest.raises(UnsafeCheckpointError, match="refusing to set the attributes"):
        MetadataUnpickler(io.BytesIO(payload), "ckpt/.metadata").load()
    assert not hasattr(pathlib.PosixPath, "_qcoll_marker")


# --- 4. sizes a checkpoint claims are bounded by its files --------------------------------------

def _legacy(path, n=1000):
    """A one-process checkpoint of the earlier format: a tensor and pickled hyper-parameters."""
    x = torch.arange(n, dtype=torch.float32)
    dcp.save({"optim.param_groups.0.lr": 0.25, "model.flat.x": x}, storage_writer=dcp.FileSystemWriter(path),
             no_dist=True)
    return x


def _claim(path, edit):
    """Rewrite the ``.metadata`` of ``path`` with ``edit(entries, storage)`` applied."""
    md = cs.read_metadata(path, allow_bytes=True)
    edit(md.state_dict_metadata, md.storage_data)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _huge(entries, storage, chunk=True, length=False):
    """``model.flat.x`` claims 2**60 float32 elements (4 EiB): in its size, its chunk, its data length."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    e, big = entries["model.flat.x"], torch.Size([1 << 60])
    entries["model.flat.x"] = dataclasses.replace(e, size=big, chunks=[ChunkStorageMetadata(torch.Size([0]), big)]
                                                  if chunk else e.chunks)
    if length:
        index = MetadataIndex("model.flat.x", [0])
        storage[index] = dataclasses.replace(storage[index], length=1 << 62)


def _twice(entries, storage):
    """``model.flat.y``: the same bytes as ``model.flat.x`` (N entries on one range claim N times the file)."""
    entries["model.flat.y"] = entries["model.flat.x"]
    storage[MetadataIndex("model.flat.y", [0])] = storage[MetadataIndex("model.flat.x", [0])]


CLAIMS = [
    ("beyond the data file", lambda e, s: _huge(e, s, length=True), ValueError, "__0_0.distcp"),
    ("beyond the recorded length", _huge, cs.UnsafeCheckpointError, ".metadata"),
    ("chunks not covering the size", lambda e, s: _huge(e, s, chunk=False), cs.UnsafeCheckpointError, ".metadata"),
    ("two entries on one range", _twice, ValueError, "__0_0.distcp"),
]


@pytest.mark.parametrize("name,edit,error,file", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_upgrade_bounds_every_claimed_size_by_the_files(tmp_path, name, edit, error, file):
    """Without the bounds: a 4 EiB torch.empty (or the data read twice)."""
    src = str(tmp_path / "legacy")
    _legacy(src)
    _claim(src, edit)
    with pytest.raises(error) as e:
        cs.upgrade_checkpoint(src, str(tmp_path / "converted"))
    assert repr(os.path.join(src, file)) in str(e.value) or f"{os.path.join(src, file)}:" in str(e.value), str(e.value)
    assert "'model.flat.y'" in str(e.value) if edit is _twice else "'model.flat.x'" in str(e.value), str(e.value)
    assert not os.path.exists(tmp_path / "converted")


def test_metadata_lengths_read_at_most_the_file(tmp_path):
    """A pickle opcode claiming 8 GiB of bytes: read from the file's own bytes, not allocated."""
    import struct
    import tracemalloc

    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 33) + b"abc")
    tracemalloc.start()
    try:
        with pytest.raises(cs.UnsafeCheckpointError, match="not a readable") as e:
            cs.read_metadata(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 26 and "MemoryError" not in str(e.value), (peak, str(e.value))


def _deflated(archive: bytes, extra: int) -> bytes:
    """``archive`` (a torch.save zip) with its tensor's record deflated and ``extra`` zero bytes longer."""
    import zipfile

    src, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data/0"):
                z.writestr(info.filename, data + bytes(extra), compress_type=zipfile.ZIP_DEFLATED)
            else:
                z.writestr(info, data)
    return out.getvalue()


def test_a_record_claiming_more_than_its_entry_is_refused_before_torch_load(tmp_path):
    """torch.load allocates (and inflates) what a zip record claims before it checks the size: a
    64-KiB entry would cost 64 MiB; a crafted directory claims any size."""
    src = str(tmp_path / "legacy")
    _legacy(src)
    md = cs.read_metadata(src, allow_bytes=True)
    index = MetadataIndex("model.flat.x", [0])
    info, data = md.storage_data[index], os.path.join(src, "__0_0.distcp")
    with open(data, "rb") as f:
        raw = f.read()
    assert info.offset + info.length == len(raw)  # DCP writes tensors last
    bomb = _deflated(raw[info.offset:], 1 << 26)
    with open(data, "wb") as f:
        f.write(raw[:info.offset] + bomb)
    md.storage_data[index] = dataclasses.replace(info, length=len(bomb))
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(cs.CheckpointError) as e:
        cs.upgrade_checkpoint(src, str(tmp_path / "converted"))
    assert repr(data) in str(e.value) and "'model.flat.x'" in str(e.value), str(e.value)
    assert f"claims {(1 << 26) + 4000} bytes (compression method 8)" in str(e.value), str(e.value)
