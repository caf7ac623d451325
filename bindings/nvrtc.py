"""Compile the qcoll kernels to cubins with NVRTC (through CuPy's NVRTC binding).

:func:`compile_cubin` is the one entry point used by the runtime launcher and by
the CI compile test. It needs NVRTC but no GPU or driver. Results are cached in
memory and on disk (``$QCOLL_CACHE_DIR``, default ``~/.cache/qcoll``), keyed by a
hash of the sources, options, architecture and NVRTC version.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path

from . import sources

#: options every kernel is compiled with (``--fmad=false``: bit-exact fp32, see FORMAT.md)
BASE_OPTIONS = ("-std=c++17", "--fmad=false", "-default-device")

_memory: dict[str, bytes] = {}
_lock = threading.Lock()


class NVRTCCompileError(RuntimeError):
    """NVRTC rejected a qcoll kernel source; the message carries the compile log."""


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "qcoll's CUDA kernels need CuPy with NVRTC (install qcoll[cuda12] or qcoll[cuda13])"
        ) from exc
    return nvrtc


def normalize_arch(arch) -> str:
    """'sm_90', 'sm90', '90', 90 or (9, 0) -> 'sm_90'."""
    if isinstance(arch, tuple):
        arch = f"{arch[0]}{arch[1]}"
    text = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3}[af]?)", text)
    if not m:
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    return f"sm_{m.group(1)}"


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that CuPy loads."""
    return tuple(_nvrtc().getVersion())


def cache_dir() -> Path:
    """Where compiled cubins are kept: ``$QCOLL_CACHE_DIR``, else ``~/.cache/qcoll``."""
    return Path(os.environ.get("QCOLL_CACHE_DIR") or Path.home() / ".cache" / "qcoll")


def options_for(arch: str) -> tuple[str, ...]:
    """The NVRTC options for ``arch`` (any form :func:`normalize_arch` takes)."""
    return BASE_OPTIONS + (f"--gpu-architecture={normalize_arch(arch)}",)


def cache_key(source: str, arch: str) -> str:
    """32 hex digits naming a cubin: the source, every header, the options and the NVRTC version."""
    h = hashlib.sha256()
    h.update(sources.read_source(source).encode())
    for name, text in sorted(sources.headers().items()):
        h.update(name.encode() + b"\0" + text.encode())
    h.update("\0".join(options_for(arch)).encode())
    h.update(repr(nvrtc_version()).encode())
    return h.hexdigest()[:32]


def _compile(source: str, arch: str) -> bytes:
    nvrtc = _nvrtc()
    hdrs = sources.headers()
    names = list(hdrs)
    prog = nvrtc.createProgram(
        sources.read_source(source), source, [hdrs[n].encode() for n in names], [n.encode() for n in names]
    )
    try:
        try:
            nvrtc.compileProgram(prog, list(options_for(arch)))
        except nvrtc.NVRTCError as exc:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:  # pragma: no cover
                log = "<no log>"
            raise NVRTCCompileError(
                f"NVRTC {'.'.join(map(str, nvrtc_version()))} failed to compile {source} for {arch} "
                f"with options {' '.join(options_for(arch))}: {exc}\n{log}"
            ) from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(source: str, arch, *, use_disk_cache: bool = True) -> Path:
    """Compile kernel source file ``source`` (e.g. ``'quantize.cu'``) for ``arch``.

    Returns the path of the cubin on disk (cached). Raises :class:`NVRTCCompileError`
    with the NVRTC log when compilation fails.
    """
    arch = normalize_arch(arch)
    key = cache_key(source, arch)
    path = cache_dir() / f"{Path(source).stem}-{arch}-{key}.cubin"
    with _lock:
        if key in _memory and path.exists():
            return path
        if use_disk_cache and path.exists():
            _memory[key] = path.read_bytes()
            return path
        cubin = _compile(source, arch)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
        _memory[key] = cubin
        return path


def compile_all(arch, **kw) -> dict[str, Path]:
    """Every kernel source compiled for ``arch``: source name -> cubin path."""
    return {src: compile_cubin(src, arch, **kw) for src in sources.KERNELS}
