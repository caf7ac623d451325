"""Files written whole or not at all: the one atomic writer of the project (a leaf: imports nothing of qcoll)."""
from __future__ import annotations

import os
import secrets
from typing import BinaryIO, Callable


def create_temp(folder: str, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``(fd, path)`` of a new empty file ``<prefix><8 random hex><suffix>`` in ``folder``, created
    exclusively (``O_EXCL``, ``O_NOFOLLOW``: a symlink planted at the name is never followed), with the
    permissions of a plain ``open`` (``0o666`` less the umask). A name already taken: another is drawn."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = os.path.join(folder, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


TEMP_PREFIX, TEMP_SUFFIX = ".qcoll-", ".tmp"   # the default temporary name: .qcoll-<random>.tmp


def write_atomic(path: str, write: Callable[[BinaryIO], object], prefix: str = TEMP_PREFIX,
                 suffix: str = TEMP_SUFFIX) -> None:
    """Call ``write`` on a new binary file (:func:`create_temp` in ``path``'s folder), then rename it onto
    ``path``. An interrupted write never leaves half a file at ``path`` (the temporary file is removed
    when ``write`` or the rename raises), and a symlink at ``path`` is replaced, never followed:
    ``os.replace`` renames onto the link itself."""
    fd, tmp = create_temp(os.path.dirname(os.path.abspath(path)), prefix, suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
