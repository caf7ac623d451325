"""Replace a checkpoint directory so that, at every instant, it holds a complete checkpoint.

A save writes into a fresh sibling ``.<name>.qcoll-tmp-<hex>`` (same parent, so the
renames below stay on one filesystem and are atomic), and one process then moves it into
place (:func:`install`):

* ``<name>`` absent or an empty directory: ``rename(tmp, <name>)``.
* otherwise, on Linux: ``renameat2(tmp, <name>, RENAME_EXCHANGE)`` swaps the two
  directories atomically; the previous checkpoint is left under the temporary name.
* where the exchange is unavailable (no ``renameat2``, or a filesystem that refuses it,
  e.g. NFS): ``rename(<name>, .<name>.qcoll-old)``, then ``rename(tmp, <name>)``. A crash
  between the two leaves ``<name>`` missing and the complete previous checkpoint under
  ``.<name>.qcoll-old``: :func:`recover` (run by :func:`prepare_save` and
  :func:`resolve_load`) renames it back.

Files and directories are fsynced before and after each rename. Superseded
checkpoints are renamed to ``.<name>.qcoll-trash-<hex>`` before being deleted, so a
half-deleted directory never sits under a name that recovery trusts. Temporaries and
trash left by a crash are never loaded and are deleted by the next save.

Every rank writes its files into the temporary through :func:`writer`, DCP's
``FileSystemWriter`` that reports a failed write as the OSError that caused it (``ENOSPC``,
``EDQUOT``, ``EIO``), naming the file: ``torch.save`` replaces it by a ``RuntimeError`` of its
own ("unexpected pos ..."). A full disk thus fails the save before anything is moved, and the
previous checkpoint stays.

Everything else here runs on one process (rank 0). Only the names above, next to
``<name>``, are ever created, renamed or deleted, and an existing ``<name>`` is replaced
only when it holds a checkpoint (a ``.metadata`` file and nothing but
``torch.distributed.checkpoint`` files): any other non-empty directory is refused.
One save at a time per checkpoint directory (two concurrent saves would delete each
other's temporaries).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import uuid

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

METADATA = ".metadata"
# the files FileSystemWriter writes: data "__<rank>_<n>.distcp", ".metadata" (and "__<rank>.metadata"
# without collectives), each metadata first as "<name>.tmp"
_DCP_FILE = re.compile(r"(\.metadata|__\d+\.metadata)(\.tmp)?|__\d+_\d+\.distcp")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


class ExchangeUnsupported(OSError):
    """``renameat2(RENAME_EXCHANGE)`` is not available here (library, kernel or filesystem)."""


def checkpoint_path(checkpoint_dir) -> str:
    """Check the ``checkpoint_dir`` argument (every rank, no I/O) and return it as a str."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a str or os.PathLike, got {type(checkpoint_dir).__name__}")
    path = os.fspath(checkpoint_dir)
    if not isinstance(path, str):
        raise TypeError(f"checkpoint_dir must be a str or os.PathLike of a str, got a path of {type(path).__name__}")
    if not path:
        raise ValueError("checkpoint_dir must not be empty")
    if "\0" in path:
        raise ValueError(f"checkpoint_dir must not contain a NUL character: {path!r}")
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise ValueError(f"checkpoint_dir must be a filesystem path, not a URL: {path!r}")
    return path


class _Names:
    """The target (symlinks resolved: a link to a directory replaces the directory) and its siblings."""

    def __init__(self, checkpoint_dir: str):
        self.target = os.path.realpath(checkpoint_dir)
        self.parent, base = os.path.split(self.target)
        if not base:
            raise ValueError(f"checkpoint_dir must not be a filesystem root: {checkpoint_dir!r}")
        self.prefix = f".{base}.qcoll-"
        self.backup = os.path.join(self.parent, self.prefix + "old")
        self._garbage = re.compile(re.escape(self.prefix) + r"(tmp|trash)-[0-9a-f]{32}")

    def fresh(self, kind: str) -> str:
        return os.path.join(self.parent, f"{self.prefix}{kind}-{uuid.uuid4().hex}")

    def garbage(self) -> list[str]:
        """Temporaries and trash of earlier saves of this target."""
        try:
            entries = os.listdir(self.parent)
        except FileNotFoundError:
            return []
        return [os.path.join(self.parent, e) for e in sorted(entries) if self._garbage.fullmatch(e)]


# The filesystem steps, one function each (the crash tests stop the sequence between any two).

def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def _fsync(path: str, directory: bool) -> None:
    if directory and os.name == "nt":
        return  # Windows cannot open a directory as a file; NTFS metadata is journaled
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a directory; their renames are then as durable as they get
        if not directory or e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    _fsync(path, True)


def _fsync_tree(path: str) -> None:
    """fsync every file directly in ``path`` (a DCP checkpoint is flat), then ``path`` itself."""
    with os.scandir(path) as it:
        files = [e.path for e in it if e.is_file(follow_symlinks=False)]
    for f in files:
        _fsync(f, False)
    _fsync(path, True)


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


_renameat2 = None


def _exchange(a: str, b: str) -> None:
    """Atomically swap two existing paths (Linux ``renameat2(..., RENAME_EXCHANGE)`` through libc)."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError, TypeError):
            fn = False  # not Linux, or a libc older than glibc 2.28
        else:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _renameat2 = fn
    if _renameat2 is False:
        raise ExchangeUnsupported(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        cls = ExchangeUnsupported if err in _NO_EXCHANGE else OSError
        raise cls(err, f"renameat2(RENAME_EXCHANGE): {os.strerror(err)}", a, None, b)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def recover(names: _Names) -> None:
    """Undo a fallback replacement cut short: the target missing and the previous checkpoint in the backup.
    A backup next to an existing target is superseded (the crash came after the new one was in place)."""
    if not os.path.lexists(names.backup):
        return
    if not os.path.lexists(names.target) and is_checkpoint(names.backup):
        _rename(names.backup, names.target)
        _fsync_dir(names.parent)
    else:
        discard(names.backup)


def _show(given: str, target: str) -> str:
    return repr(given) if os.path.abspath(given) == target else f"{given!r} ({target})"


def _check_replaceable(names: _Names, shown: str) -> None:
    target = names.target
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise ValueError(f"checkpoint_dir {shown!r} exists and is not a directory; refusing to replace it")
    if os.path.ismount(target):
        raise ValueError(f"checkpoint_dir {shown!r} is a mount point: a save replaces the whole directory by "
                         "renaming a sibling onto it; save into a directory inside it")
    entries = os.listdir(target)
    if not entries:
        return
    others = sorted(e for e in entries if not _DCP_FILE.fullmatch(e))
    if others or METADATA not in entries:
        what = f"it holds {', '.join(map(repr, others[:5]))}{' ...' if len(others) > 5 else ''}" if others \
            else f"it has no {METADATA}"
        raise ValueError(f"checkpoint_dir {_show(shown, target)} exists and is not a checkpoint ({what}); refusing "
                         "to replace it: a save replaces the whole directory. Choose another checkpoint_dir or "
                         "move its contents away")


def prepare_save(checkpoint_dir: str) -> str:
    """Before a save (one process): recover, refuse a directory that is not a checkpoint, delete earlier
    temporaries, and create and return a fresh temporary directory next to the target."""
    names = _Names(checkpoint_dir)
    os.makedirs(names.parent, exist_ok=True)
    recover(names)
    _check_replaceable(names, checkpoint_dir)
    for g in names.garbage():
        _rmtree(g)
    tmp = names.fresh("tmp")
    os.mkdir(tmp)
    return tmp


def _os_error(e: BaseException | None) -> OSError | None:
    """The first OSError in ``e``'s chain of causes and contexts (``e`` itself included), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class _FileSystem(FileSystem):
    """DCP's local file system whose streams raise an OSError naming the file when a write fails."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as e:
            cause = _os_error(e)
            if cause is None or (cause is e and e.filename is not None):
                raise
            # the OSError that torch.save's RuntimeError ("unexpected pos") hides, or a flush's without a name
            raise OSError(cause.errno, cause.strerror or str(cause), os.fspath(path)) from e


def writer(tmp: str) -> FileSystemWriter:
    """DCP's ``FileSystemWriter`` into ``tmp`` (from :func:`prepare_save`; every rank), reporting a
    failed write as the OSError that caused it, with the file's name (see the module docstring)."""
    w = FileSystemWriter(tmp, overwrite=False)
    w.fs = _FileSystem()
    return w


def install(tmp: str, checkpoint_dir: str) -> str | None:
    """Move the complete checkpoint ``tmp`` (from :func:`prepare_save`) to ``checkpoint_dir``.

    Returns the path now holding the superseded checkpoint (pass it to :func:`discard`), or None.
    On an error the target still holds the previous checkpoint (or, if even putting it back failed,
    the backup does, and :func:`recover` restores it)."""
    names = _Names(checkpoint_dir)
    if os.path.dirname(tmp) != names.parent:
        raise ValueError(f"{tmp!r} is not next to {names.target!r}")
    if not is_checkpoint(tmp):
        raise ValueError(f"{tmp!r} holds no complete checkpoint (no {METADATA}); not installing it")
    _fsync_tree(tmp)
    if not os.path.lexists(names.target) or (os.path.isdir(names.target) and not os.listdir(names.target)):
        _rename(tmp, names.target)  # replaces an empty directory atomically
        _fsync_dir(names.parent)
        return None
    try:
        _exchange(tmp, names.target)
    except ExchangeUnsupported:
        pass
    else:
        _fsync_dir(names.parent)
        return tmp
    # fallback: two renames, with the previous checkpoint under the backup name in between
    if os.path.lexists(names.backup):
        raise FileExistsError(errno.EEXIST, "a backup of an earlier save is in the way", names.backup)
    _rename(names.target, names.backup)
    _fsync_dir(names.parent)
    try:
        _rename(tmp, names.target)
    except OSError as e:
        try:
            _rename(names.backup, names.target)
            _fsync_dir(names.parent)
        except OSError as e2:
            raise OSError(f"moving the new checkpoint into place failed ({e}), and putting the previous one back "
                          f"failed too ({e2}); it is complete in {names.backup!r}, and the next load or save "
                          "restores it") from e
        raise
    _fsync_dir(names.parent)
    return names.backup


def discard(path: str) -> None:
    """Delete a superseded checkpoint or a temporary, best effort (the next save retries): renamed to a
    trash name first, so that a half-deleted directory is never taken for a backup."""
    parent, base = os.path.split(path)
    m = re.fullmatch(r"\.(.+)\.qcoll-old", base)
    if m:
        trash = _Names(os.path.join(parent, m.group(1))).fresh("trash")
        try:
            _rename(path, trash)
        except OSError:
            return
        path = trash
    _rmtree(path)


def resolve_load(checkpoint_dir: str) -> str:
    """The directory to load ``checkpoint_dir`` from (one process), after recovering a cut-short save;
    FileNotFoundError when there is no checkpoint there."""
    names = _Names(checkpoint_dir)
    if not os.path.lexists(names.target) and is_checkpoint(names.backup):
        try:
            _rename(names.backup, names.target)
            _fsync_dir(names.parent)
        except OSError:  # e.g. a read-only filesystem: load the backup where it is
            return names.backup
    if not os.path.lexists(names.target):
        raise FileNotFoundError(errno.ENOENT, f"checkpoint_dir {checkpoint_dir!r} does not exist", names.target)
    if not os.path.isdir(names.target):
        raise ValueError(f"checkpoint_dir {_show(checkpoint_dir, names.target)} is not a directory")
    if not is_checkpoint(names.target):
        raise FileNotFoundError(errno.ENOENT, f"checkpoint_dir {checkpoint_dir!r} holds no checkpoint "
                                f"(no {METADATA})", names.target)
    return names.target
