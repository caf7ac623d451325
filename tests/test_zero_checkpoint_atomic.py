"""zero.save replaces its directory atomically: a crash at any point leaves a loadable checkpoint.

Oracles: the state captured right after each save (bit-exact comparison after a load into a
fresh model), and, for the move-into-place steps, single-process DCP checkpoints holding a
known tensor, read back with ``torch.distributed.checkpoint`` itself.
"""
import contextlib
import errno
import os
import re
import subprocess
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import qcoll
from qcoll import zero
from qcoll.testing import Batches, corpus, tiny_model, train_steps
from qcoll.zero import atomic_dir, checkpoint_safety

from distributed import PRELOAD, RankFailure, RankPool
from zero_helpers import make_optimizer

BATCH = 8
ZPP = zero.ZeroConfig(stochastic_grad_rounding=True)


# --- distributed, through the public API --------------------------------------------------------

def _trained(world, seed, steps):
    topo = qcoll.Topology(2 if world % 2 == 0 else 1)
    model = tiny_model(seed)
    m = zero.shard(model, topo, ZPP, units=model.units())
    cls, kw = make_optimizer("adamw")
    opt = zero.Optimizer(m, cls, **kw)
    train_steps(m, opt, Batches(corpus(), BATCH, 32, seed), steps, rank=dist.get_rank(), world=world)
    return m, opt


def _opt_state(opt):
    """This rank's optimizer state (shards and scalars), in parameter order."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            for pg in opt.param_groups for p in pg["params"]]


def _assert_same(a: dict, b: dict, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k)


def _assert_same_opt(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), (what, i)
        for k in x:
            assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), (what, i, k)


def _save_a(rank, world, path):
    m, opt = _trained(world, 0, 2)
    zero.save(path, m, opt)
    return m.state_dict(), _opt_state(opt)


def _save_b_and_die(rank, world, path, victim):
    m, opt = _trained(world, 5, 1)
    if rank == victim:
        import torch.distributed.checkpoint.filesystem as fs

        write_item = fs._write_item

        def write_then_die(transforms, stream, *args, **kwargs):
            out = write_item(transforms, stream, *args, **kwargs)
            stream.flush()
            os.fsync(stream.fileno())
            os._exit(1)  # killed mid-save, after some of its bytes reached the file
            return out

        fs._write_item = write_then_die
    zero.save(path, m, opt)
    return "saved"


def _load_check_and_resave(rank, world, path):
    m, opt = _trained(world, 9, 0)  # other initial values, no optimizer state yet
    zero.load(path, m, opt)
    loaded = m.state_dict(), _opt_state(opt)
    zero.save(path, m, opt)  # a save after the crash works and clears what the crash left
    return loaded, sorted(os.listdir(os.path.dirname(path)))


def test_rank_killed_mid_save_keeps_previous_checkpoint(ranks4, tmp_path):
    path = str(tmp_path / "ckpt")
    victim = 1  # not rank 0, the one that moves the directory: it must not move a checkpoint missing a rank
    pool = RankPool(4, env={"QCOLL_TEST_GROUP_TIMEOUT": "10"}, preload=PRELOAD)  # the survivors give up after 10 s
    try:
        state_a, opt_a = pool.run(_save_a, path, timeout=90)[0]
        with pytest.raises(RankFailure) as failure:
            pool.run(_save_b_and_die, path, victim, timeout=40)
        # the survivors failed (within the group timeout) instead of hanging; the victim never answered
        assert set(failure.value.errors) == {0, 2, 3} and set(failure.value.dead) == {1}, failure.value
    finally:
        pool.close()
    results = ranks4.run(_load_check_and_resave, path, timeout=60)
    (state, opt0), listing = results[0]
    _assert_same(state, state_a, "model")
    _assert_same_opt(opt0, opt_a, "optimizer rank 0")
    assert listing == ["ckpt"], listing


def _save_twice_and_misuse(rank, world, root):
    path = os.path.join(root, "ckpt")
    m, opt = _trained(world, 0, 1)
    zero.save(path, m, opt)
    first = m.state_dict()
    m, opt = _trained(world, 3, 2)
    zero.save(path, m, opt)
    second, second_opt = m.state_dict(), _opt_state(opt)
    after_two = sorted(os.listdir(root))

    m2, opt2 = _trained(world, 9, 0)
    zero.load(path, m2, opt2)
    _assert_same(m2.state_dict(), second, "second save")
    _assert_same_opt(_opt_state(opt2), second_opt, "second save optimizer")
    assert any(not torch.equal(first[k], second[k]) for k in first)

    # directories that are not checkpoints are refused, untouched, on every rank
    user = os.path.join(root, "user")
    half = os.path.join(root, "half")
    if rank == 0:
        os.makedirs(user)
        with open(os.path.join(user, "notes.txt"), "w") as f:
            f.write("mine")
        os.makedirs(half)
        for name in (".metadata", "__0_0.distcp", "results.csv"):
            with open(os.path.join(half, name), "w") as f:
                f.write(name)
    dist.barrier()
    errors = {}
    for name, d in (("user", user), ("half", half)):
        try:
            zero.save(d, m2, opt2)
        except ValueError as e:
            errors[name] = str(e)
    for name, arg in (("missing", os.path.join(root, "nothing")), ("empty", os.path.join(root, "empty"))):
        if name == "empty" and rank == 0:
            os.makedirs(arg)
        dist.barrier()
        try:
            zero.load(arg, m2, opt2)
        except FileNotFoundError as e:
            errors[name] = str(e)
    for name, arg in (("int", 3), ("bytes", b"ckpt"), ("none", None)):
        try:
            zero.save(arg, m2, opt2)
        except TypeError as e:
            errors[name] = str(e)
        try:
            zero.load(arg, m2, opt2)
        except TypeError as e:
            errors[name + "-load"] = str(e)
    untouched = {d: sorted(os.listdir(os.path.join(root, d))) for d in ("user", "half")}
    return after_two, errors, untouched


def test_save_twice_second_wins_and_foreign_dirs_are_refused(ranks4, tmp_path):
    results = ranks4.run(_save_twice_and_misuse, str(tmp_path), timeout=60)
    for after_two, errors, untouched in results:
        assert after_two == ["ckpt"]  # the superseded checkpoint and the temporary are gone
        assert set(errors) == {"user", "half", "missing", "empty", "int", "bytes", "none",
                               "int-load", "bytes-load", "none-load"}, errors
        assert "checkpoint_dir" in errors["user"] and "notes.txt" in errors["user"]
        assert "results.csv" in errors["half"]
        assert "does not exist" in errors["missing"] and "nothing" in errors["missing"]
        assert "no checkpoint" in errors["empty"]
        for k in ("int", "bytes", "none"):
            assert "checkpoint_dir must be a str or os.PathLike" in errors[k] and errors[k] == errors[k + "-load"]
        assert untouched == {"user": ["notes.txt"], "half": [".metadata", "__0_0.distcp", "results.csv"]}
    with open(tmp_path / "user" / "notes.txt") as f:
        assert f.read() == "mine"


def _install_fails_on_rank0(rank, world, path):
    m, opt = _trained(world, 0, 1)
    zero.save(path, m, opt)
    saved = m.state_dict()
    m, opt = _trained(world, 4, 1)
    if rank == 0:
        real = atomic_dir._exchange

        def broken(a, b):
            raise OSError(errno.EIO, "injected I/O error", b)

        atomic_dir._exchange = broken
    try:
        zero.save(path, m, opt)
        outcome = "saved"
    except OSError as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        if rank == 0:
            atomic_dir._exchange = real
    m2, opt2 = _trained(world, 9, 0)
    zero.load(path, m2, opt2)
    _assert_same(m2.state_dict(), saved, "previous checkpoint")
    return outcome, sorted(os.listdir(os.path.dirname(path)))


def test_rank0_move_failure_raises_on_every_rank_and_keeps_previous(ranks4, tmp_path):
    results = ranks4.run(_install_fails_on_rank0, str(tmp_path / "ckpt"), timeout=60)
    for outcome, listing in results:
        assert outcome.startswith("OSError") and "injected I/O error" in outcome, outcome
        assert listing == ["ckpt"], listing  # the temporary was removed


# --- single process: the move-into-place steps ----------------------------------------------------

def _write(path, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save({"w": torch.full((4,), float(value))},
                                          storage_writer=dcp.FileSystemWriter(path))


def _read(path):
    state = {"w": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(state["w"], state["w"][:1].expand(4))
    return float(state["w"][0])


class _Crash(BaseException):
    """A process dying: nothing in atomic_dir catches it, so no clean-up runs."""


STEPS = ("_fsync_tree", "_exchange", "_rename", "_fsync_dir", "_rmtree")


def _instrument(monkeypatch, crash_at, log, exchange=True):
    """Count the filesystem steps; raise _Crash instead of running step number ``crash_at``."""
    for name in STEPS:
        real = getattr(atomic_dir, name)
        if name == "_exchange" and not exchange:
            def real(a, b):
                raise atomic_dir.ExchangeUnsupported(errno.EINVAL, "no RENAME_EXCHANGE here")

        def step(*args, _real=real, _name=name):
            if len(log) == crash_at:
                raise _Crash(_name)
            log.append((_name, [os.path.basename(a) for a in args]))
            return _real(*args)

        monkeypatch.setattr(atomic_dir, name, step)


def _save_new(target, value):
    tmp = atomic_dir.prepare_save(target)
    _write(tmp, value)
    return tmp


def _crash_sweep(tmp_path, monkeypatch, exchange):
    """Crash before each step of install + discard in turn; returns (steps, outcomes)."""
    steps, outcomes, k = None, [], 0
    while steps is None or k <= len(steps):
        root = tmp_path / f"{exchange}-{k}"
        target = str(root / "ckpt")
        _write(target, 1)
        tmp = _save_new(target, 2)
        log = []
        with monkeypatch.context() as mp:
            _instrument(mp, k, log, exchange)
            try:
                superseded = atomic_dir.install(tmp, target)
                if superseded is not None:
                    atomic_dir.discard(superseded)
                steps = list(log)
            except _Crash:
                pass
        missing = not os.path.exists(target)
        value = _read(atomic_dir.resolve_load(target))  # what a load finds after the crash
        outcomes.append((log[-1][0] if log else None, missing, value))
        nxt = atomic_dir.prepare_save(target)  # the next save recovers and clears the leftovers
        assert sorted(os.listdir(root)) == sorted(["ckpt", os.path.basename(nxt)]), (k, os.listdir(root))
        assert _read(target) == value
        k += 1
    return steps, outcomes


def test_fallback_crash_between_any_two_steps_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    steps, outcomes = _crash_sweep(tmp_path, monkeypatch, exchange=False)
    assert [s for s, _ in steps] == ["_fsync_tree", "_exchange", "_rename", "_fsync_dir", "_rename",
                                     "_fsync_dir", "_rename", "_rmtree"], steps
    assert steps[2][1] == ["ckpt", ".ckpt.qcoll-old"] and steps[4][1][1] == "ckpt", steps
    moved = 4  # crashing at step k means steps 0..k-1 ran: from k = 5 on, the new checkpoint is in place
    for k, (_, _, value) in enumerate(outcomes):
        assert value == (1.0 if k <= moved else 2.0), (k, outcomes)
    # the window that needs recovery was exercised: ckpt missing, the previous checkpoint in the backup
    assert [missing for _, missing, _ in outcomes] == [k in (3, 4) for k in range(len(outcomes))], outcomes


def test_exchange_crash_between_any_two_steps_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    try:
        atomic_dir._exchange(str(a), str(b))
    except atomic_dir.ExchangeUnsupported:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this filesystem")
    steps, outcomes = _crash_sweep(tmp_path, monkeypatch, exchange=True)
    assert [s for s, _ in steps] == ["_fsync_tree", "_exchange", "_fsync_dir", "_rmtree"], steps
    assert [v for _, _, v in outcomes] == [1.0, 1.0, 2.0, 2.0, 2.0], outcomes
    assert not any(missing for _, missing, _ in outcomes)


@pytest.mark.parametrize("failing", ["to-backup", "into-place", "into-place-and-back"])
def test_fallback_rename_error_keeps_previous_checkpoint(tmp_path, monkeypatch, failing):
    target = str(tmp_path / "ckpt")
    _write(target, 1)
    tmp = _save_new(target, 2)
    real = atomic_dir._rename

    def rename(src, dst):
        names = os.path.basename(src), os.path.basename(dst)
        if (failing == "to-backup" and names == ("ckpt", ".ckpt.qcoll-old")) or \
                (failing.startswith("into-place") and names[1] == "ckpt" and names[0] != ".ckpt.qcoll-old") or \
                (failing == "into-place-and-back" and names == (".ckpt.qcoll-old", "ckpt")):
            raise OSError(errno.EIO, "injected", src)
        real(src, dst)

    def no_exchange(a, b):
        raise atomic_dir.ExchangeUnsupported(errno.EINVAL, "no RENAME_EXCHANGE here")

    with monkeypatch.context() as mp:
        mp.setattr(atomic_dir, "_rename", rename)
        mp.setattr(atomic_dir, "_exchange", no_exchange)
        with pytest.raises(OSError, match="injected") as e:
            atomic_dir.install(tmp, target)
    if failing == "into-place-and-back":
        assert ".ckpt.qcoll-old" in str(e.value) and not os.path.exists(target)
    else:
        assert _read(target) == 1.0  # put back (or never moved)
    assert _read(atomic_dir.resolve_load(target)) == 1.0


def test_leftovers_are_ignored_by_load_and_removed_by_the_next_save(tmp_path):
    target = str(tmp_path / "ckpt")
    _write(target, 1)
    stale_tmp = str(tmp_path / (".ckpt.qcoll-tmp-" + "a" * 32))
    _write(stale_tmp, 7)  # complete, but never moved into place: not the checkpoint
    trash = tmp_path / (".ckpt.qcoll-trash-" + "b" * 32)
    trash.mkdir()
    lookalike = tmp_path / ".ckpt.qcoll-tmp-mine"  # not a name a save makes: the user's
    lookalike.mkdir()
    other = str(tmp_path / (".other.qcoll-tmp-" + "c" * 32))  # another checkpoint's temporary
    _write(other, 8)
    assert _read(atomic_dir.resolve_load(target)) == 1.0
    tmp = atomic_dir.prepare_save(target)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".ckpt.qcoll-tmp-mine", os.path.basename(other), "ckpt", os.path.basename(tmp)])
    _write(tmp, 2)
    atomic_dir.discard(atomic_dir.install(tmp, target))
    assert _read(atomic_dir.resolve_load(target)) == 2.0


def test_replace_refuses_what_is_not_a_checkpoint(tmp_path):
    cases = {
        "notes": {"notes.txt": "mine"},
        "metadata-and-more": {".metadata": "x", "__0_0.distcp": "x", "config.json": "{}"},
        "no-metadata": {"__0_0.distcp": "x"},
    }
    for name, files in cases.items():
        d = tmp_path / name
        d.mkdir()
        for f, text in files.items():
            (d / f).write_text(text)
        with pytest.raises(ValueError, match="checkpoint_dir .* is not a checkpoint"):
            atomic_dir.prepare_save(str(d))
        assert {p.name: p.read_text() for p in d.iterdir()} == files
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        atomic_dir.prepare_save(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="not a directory"):
        atomic_dir.resolve_load(str(tmp_path / "file"))
    assert sorted(os.listdir(tmp_path)) == ["file", "metadata-and-more", "no-metadata", "notes"]  # no temporaries
    if os.path.ismount("/proc"):  # a mount point cannot be renamed over: refused before anything is written
        with pytest.raises(ValueError, match="checkpoint_dir '/proc' is a mount point"):
            atomic_dir.prepare_save("/proc")
    # an empty directory and a missing one are fine to save into
    (tmp_path / "empty").mkdir()
    for d in ("empty", "new/deeper"):
        target = str(tmp_path / d)
        tmp = _save_new(target, 3)
        assert atomic_dir.install(tmp, target) is None
        assert _read(atomic_dir.resolve_load(target)) == 3.0


def test_checkpoint_dir_argument_errors(tmp_path):
    for bad in (3, None, b"ckpt", ["ckpt"]):
        with pytest.raises(TypeError, match="checkpoint_dir must be a str or os.PathLike"):
            atomic_dir.checkpoint_path(bad)
    with pytest.raises(ValueError, match="checkpoint_dir must not be empty"):
        atomic_dir.checkpoint_path("")
    with pytest.raises(ValueError, match="checkpoint_dir must be a filesystem path, not a URL"):
        atomic_dir.checkpoint_path("s3://bucket/ckpt")
    assert atomic_dir.checkpoint_path(tmp_path / "x") == str(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="checkpoint_dir .* does not exist"):
        atomic_dir.resolve_load(str(tmp_path / "nothing"))


def test_symlinked_checkpoint_dir_replaces_the_directory_it_points_to(tmp_path):
    real = tmp_path / "disk" / "ckpt"
    _write(str(real), 1)
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    tmp = _save_new(str(link), 2)
    assert os.path.dirname(tmp) == str(real.parent)  # the temporary is on the directory's filesystem
    atomic_dir.discard(atomic_dir.install(tmp, str(link)))
    assert link.is_symlink() and _read(str(link)) == 2.0
    assert sorted(os.listdir(real.parent)) == ["ckpt"]


# --- a full disk: the real ENOSPC, the previous checkpoint kept -------------------------------------

@contextlib.contextmanager
def _small_disk(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (a real ENOSPC once it is full); skipped unless root."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a full disk is a tmpfs of a few KiB, and mounting one needs root")
    os.makedirs(path)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                             text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (a container without CAP_SYS_ADMIN?): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def _assert_no_space(err, where: str, directory: str):
    """``err`` (or its ``_described`` tuple): a CheckpointOSError ENOSPC naming a data or metadata file
    of a temporary directory in ``directory``, in one line."""
    kind, code, filename, text = _described(err) if isinstance(err, BaseException) else err
    assert kind == "CheckpointOSError" and code == errno.ENOSPC, err
    assert filename and os.path.dirname(os.path.dirname(filename)) == directory, (filename, directory)
    assert re.fullmatch(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?", os.path.basename(filename)), filename
    assert text.startswith(f"{where}: rank ") and "No space left on device" in text, text
    assert repr(filename) in text and "unexpected pos" not in text and "\n" not in text, text


def _described(e):
    """What a rank returns of an exception (an OSError's errno does not survive pickling)."""
    return None if e is None else (type(e).__name__, getattr(e, "errno", None), getattr(e, "filename", None), str(e))


def test_upgrade_on_a_full_disk_is_enospc_and_keeps_the_checkpoint(tmp_path):
    from qcoll.zero.checkpoint_upgrade import upgrade_checkpoint

    with _small_disk(str(tmp_path / "disk"), "512k") as disk:
        legacy = os.path.join(disk, "ck")
        x = torch.arange(70_000, dtype=torch.float32)  # 280 KB: room for one copy, not two
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"x": x, "optim.param_groups.0.lr": 0.25}, storage_writer=dcp.FileSystemWriter(legacy))
        before = {n: open(os.path.join(legacy, n), "rb").read() for n in os.listdir(legacy)}
        with pytest.raises(checkpoint_safety.CheckpointOSError) as e:
            upgrade_checkpoint(legacy)
        _assert_no_space(e.value, "qcoll.zero.checkpoint_safety.upgrade_checkpoint", disk)
        assert os.listdir(disk) == ["ck"]  # the temporary is gone
        assert {n: open(os.path.join(legacy, n), "rb").read() for n in os.listdir(legacy)} == before
        upgrade_checkpoint(legacy, str(tmp_path / "converted"))  # and it still converts, elsewhere
    state = {"x": torch.zeros_like(x), "optim.param_groups": torch.zeros(0, dtype=torch.uint8)}
    md = checkpoint_safety.read_metadata(tmp_path / "converted")
    state["optim.param_groups"] = torch.zeros(md.state_dict_metadata["optim.param_groups"].size, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=checkpoint_safety.SafeReader(str(tmp_path / "converted"), md))
    assert torch.equal(state["x"], x)
    assert checkpoint_safety.decode_param_groups(state["optim.param_groups"], "x") == [{"lr": 0.25}]


def _size_of_a_save(rank, world, path):
    m, opt = _trained(world, 0, 1)
    zero.save(path, m, opt)
    return sum(-(-os.path.getsize(os.path.join(path, n)) // 4096) * 4096 for n in os.listdir(path))


def _save_on_a_full_disk(rank, world, path):
    m, opt = _trained(world, 0, 1)
    zero.save(path, m, opt)
    saved, saved_opt = m.state_dict(), _opt_state(opt)
    m, opt = _trained(world, 4, 1)
    try:
        zero.save(path, m, opt)
        err = None
    except Exception as e:
        err = e
    m2, opt2 = _trained(world, 9, 0)
    zero.load(path, m2, opt2)  # the previous checkpoint, bitwise
    _assert_same(m2.state_dict(), saved, "previous checkpoint")
    _assert_same_opt(_opt_state(opt2), saved_opt, f"previous optimizer state, rank {rank}")
    return _described(err)


def test_save_on_a_full_disk_is_enospc_on_every_rank_and_keeps_the_checkpoint(ranks4, tmp_path):
    size = ranks4.run(_size_of_a_save, str(tmp_path / "probe"), timeout=120)[0]
    with _small_disk(str(tmp_path / "disk"), f"{size * 3 // 2 // 1024}k") as disk:  # one save fits, not two
        path = os.path.join(disk, "ckpt")
        for err in ranks4.run(_save_on_a_full_disk, path, timeout=120):
            assert err is not None, "the second save fitted"
            _assert_no_space(err, "qcoll.zero.save", disk)
        assert os.listdir(disk) == ["ckpt"]  # the temporary is gone
