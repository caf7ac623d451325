"""Files written whole or not at all: the one atomic writer of the project (a leaf: imports nothing of qcoll);
and a range of a file read without trusting the sizes it claims (:class:`FileRange`, :func:`check_stored_zip`)."""
from __future__ import annotations

import os
import secrets
import zipfile
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


class FileRange:
    """Bytes ``[offset, offset + length)`` of the open binary file ``f``, read as a file of their own
    (``seek`` / ``tell`` / ``read``): a read returns at most what is left of them, so a reader asking
    for a size the data claims never reads, nor allocates, more than the range."""

    def __init__(self, f: BinaryIO, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = max(0, min(self.length, pos + (0, self.pos, self.length)[whence]))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        self.f.seek(self.offset + self.pos)
        data = self.f.read(self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos))
        self.pos += len(data)
        return data


def check_stored_zip(f: BinaryIO, offset: int, length: int) -> None:
    """The zip archive at ``[offset, offset + length)`` of the open binary file ``f`` lists only records
    stored uncompressed, each within the range: a reader that allocates the size a record claims before
    reading it (``torch.load``) then allocates at most ``length`` bytes for it. ValueError otherwise
    (zipfile's error as ``__cause__`` when the range holds no zip archive)."""
    try:
        records = zipfile.ZipFile(FileRange(f, offset, length)).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise ValueError(f"not a zip archive ({e})") from e
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or not r.compress_size == r.file_size <= length:
            raise ValueError(f"zip record {r.filename!r} claims {r.file_size} bytes (compression method "
                             f"{r.compress_type}) in an archive of {length}")
