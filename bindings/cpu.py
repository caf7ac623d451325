"""qcoll's native CPU codec (``src/cpu/codec.c``, package data ``qcoll.cpu_src``) on torch CPU tensors.

The C source is compiled once with the system C compiler (``$CC``, else ``cc``) into a
shared library in a cache directory (``$XDG_CACHE_HOME/qcoll``, else ``~/.cache/qcoll``; a
private temporary directory when that is not writable), named by a hash of the source, the
flags and the compiler's version, written atomically (ranks may compile at once), and loaded
with ctypes. The flags never change a result bit (``-O3 -ffp-contract=off``, no
``-ffast-math``); ``-mavx2 -mfma`` only where ``/proc/cpuinfo`` shows AVX2 (the choice is in
the hash, so a shared cache never loads code built for another CPU's features).

The work is split into ``torch.get_num_threads()`` contiguous ranges of blocks, run on the
threads of the OpenMP runtime torch already loaded (its ``GOMP_parallel``, found with
``RTLD_NOLOAD``: never a second runtime), so that they are torch's own intra-op threads: a
separate pool would compete with those threads' spinning after each torch op (on 2 cores a
quantize right after a ``copy_`` ran 1.7x slower). Without such a runtime a small persistent
thread pool runs them (ctypes releases the GIL during the foreign call). Small inputs are one
call. :func:`library` warns once and returns None for the rest of the process on any failure to
compile or load; ``QCOLL_NATIVE=0`` turns it off (:func:`enabled`). :mod:`qcoll.quant.cpu`
decides when these run; arguments (block sizes of docs/FORMAT.md, 32..4096) are trusted here.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import importlib.resources
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = "codec.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c99")
BITS = (8, 4, 2)
#: below this many elements one call runs on the calling thread (a thread hand-off costs ~20-50 us)
PARALLEL_NUMEL = 1 << 18

_broken: str | None = None  # why the library cannot be used (set once, warned once)
_lock = threading.Lock()
_calls = {"quantize": 0, "dequantize": 0}  # completed native calls (the tests check that it ran)


def enabled() -> bool:
    """Whether the native path may run: ``QCOLL_NATIVE`` is not ``0`` and nothing failed before."""
    return _broken is None and os.environ.get("QCOLL_NATIVE", "1") not in ("0", "false", "False")


def read_source() -> str:
    """Text of ``codec.c``: from the package ``qcoll.cpu_src``, or from this checkout's ``src/cpu``
    (an editable install made before that package existed maps only the packages it knew)."""
    try:
        return importlib.resources.files("qcoll.cpu_src").joinpath(SOURCE).read_text(encoding="utf-8")
    except ModuleNotFoundError:
        return (Path(__file__).resolve().parent.parent / "src" / "cpu" / SOURCE).read_text(encoding="utf-8")


def _has_avx2() -> bool:
    """Whether this CPU has AVX2 and FMA (Linux ``/proc/cpuinfo``; False where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def _cache_dir() -> Path:
    """The writable cache directory, else a new private temporary one."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "qcoll"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="qcoll-native-"))


def _compiler_version(cc: str) -> str:
    """``cc --version``'s output (part of the cache key); raises when the compiler does not run."""
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"{cc} --version failed with exit status {done.returncode}")
    return done.stdout


def build() -> Path:
    """Compile ``codec.c`` unless a library of this source, flags and compiler is cached; its path."""
    cc = os.environ.get("CC") or "cc"
    flags = list(FLAGS) + (["-mavx2", "-mfma"] if _has_avx2() else [])
    source = read_source()
    key = hashlib.sha256("\0".join([source, " ".join(flags), cc, _compiler_version(cc)]).encode()).hexdigest()
    cache = _cache_dir()
    lib = cache / f"codec-{key[:24]}.so"
    if lib.exists():
        return lib
    fd, tmp_src = tempfile.mkstemp(prefix=".codec-", suffix=".c", dir=cache)
    tmp_lib = tmp_src[:-2] + ".so"
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source)
        done = subprocess.run([cc, *flags, "-o", tmp_lib, tmp_src, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cc} failed with exit status {done.returncode}: {done.stderr.strip()[:500]}")
        os.replace(tmp_lib, lib)
    finally:
        for p in (tmp_src, tmp_lib):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    return lib


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' argument types set."""
    lib = ctypes.CDLL(str(path))
    i64, i32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.qcoll_quantize_blocks.argtypes = [p, i64, p, i64, p, i64, i64, i32, i32, i64, i64]
    lib.qcoll_quantize_blocks.restype = i64
    lib.qcoll_dequantize_blocks.argtypes = [p, i64, p, i64, p, i64, i32, i64, i32, i32, i64, i64]
    lib.qcoll_dequantize_blocks.restype = None
    lib.qcoll_quantize_parallel.argtypes = [p, i64, p, i64, p, i64, i64, i32, i32, i64, i32, p, p, p, p]
    lib.qcoll_quantize_parallel.restype = i64
    lib.qcoll_dequantize_parallel.argtypes = [p, i64, p, i64, p, i64, i32, i64, i32, i32, i64, i32, p, p, p, p]
    lib.qcoll_dequantize_parallel.restype = None
    return lib


@functools.lru_cache(maxsize=1)
def openmp() -> tuple[int, int, int] | None:
    """Addresses of ``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` of the
    OpenMP runtime torch runs its intra-op threads on, or None (another parallel backend, no such
    library mapped in this process, or not Linux)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError:
        return None
    names = ("libgomp", "libiomp5", "libomp")
    for path in sorted(p for p in paths if os.path.basename(p).startswith(names)):
        try:  # RTLD_NOLOAD: a handle of the library already loaded, never a new load
            rt = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            return tuple(ctypes.cast(getattr(rt, name), ctypes.c_void_p).value
                         for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"))
        except (OSError, AttributeError):
            continue
    return None


@functools.lru_cache(maxsize=1)
def _library():
    return _load(build())


def library():
    """The loaded library, or None (after one warning naming the reason) when it cannot be built
    or loaded; from then on :func:`enabled` is False for the rest of the process."""
    global _broken
    if _broken is not None:
        return None
    with _lock:
        try:
            return _library()
        except Exception as e:  # no compiler, a read-only file system, a failed build: never break the codec
            _broken = f"{type(e).__name__}: {e}"
            warnings.warn(f"qcoll: native CPU codec disabled ({_broken}); using the torch.compile path "
                          f"or the reference", RuntimeWarning, stacklevel=2)
            return None


@functools.lru_cache(maxsize=4)
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qcoll-native")


def _workers(nblocks: int, numel: int) -> int:
    """Threads for a call: 1 for small inputs, else ``torch.get_num_threads()`` (at most one per block)."""
    return max(1, min(torch.get_num_threads(), nblocks)) if numel >= PARALLEL_NUMEL else 1


def _run(lib, name: str, nblocks: int, numel: int, *args) -> int:
    """``qcoll_<name>_blocks(*args, start, end)`` over blocks ``[0, nblocks)``: one call for small
    inputs, else ``qcoll_<name>_parallel`` on torch's OpenMP threads, else one contiguous range per
    thread of a pool (the last on this thread). The sum of the calls' results."""
    workers = _workers(nblocks, numel)
    if workers <= 1:
        return getattr(lib, f"qcoll_{name}_blocks")(*args, 0, nblocks) or 0
    omp = openmp()
    if omp is not None:
        results = (ctypes.c_int64 * workers)()
        return getattr(lib, f"qcoll_{name}_parallel")(*args, nblocks, workers, *omp, results) or 0
    fn = getattr(lib, f"qcoll_{name}_blocks")
    bounds = [nblocks * k // workers for k in range(workers + 1)]
    futures = [_pool(workers - 1).submit(fn, *args, bounds[k], bounds[k + 1]) for k in range(workers - 1)]
    last = fn(*args, bounds[-2], bounds[-1]) or 0
    return sum(f.result() or 0 for f in futures) + last


def quantize_blocks(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, full: int,
                    block_size: int, bits: int) -> bool | None:
    """Round-to-nearest quantize of the first ``full`` whole blocks of each row of ``x`` (fp32
    ``[rows, >= full*block_size]``, last dimension contiguous) into ``codes`` (uint8 ``[rows,
    >= full*block_bytes]``) and ``scales`` (uint8 ``[rows, >= 4*full]``), both with a contiguous
    last dimension. True when done; False when a block is in the subnormal range (the caller
    runs the reference; the outputs hold garbage); None when the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    rows = x.shape[0]
    tiny = _run(lib, "quantize", rows * full, rows * full * block_size,
                x.data_ptr(), x.stride(0), codes.data_ptr(), codes.stride(0), scales.data_ptr(),
                scales.stride(0), full, block_size, bits)
    _calls["quantize"] += 1
    return not tiny


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, full: int,
                      block_size: int, bits: int) -> bool:
    """The first ``full`` whole blocks of each row: uint8 ``codes`` ``[rows, >= full*block_bytes]``
    and fp32 scale bytes ``scales`` ``[rows, >= 4*full]`` (any alignment) into ``out`` (fp32 or
    bf16 ``[rows, >= full*block_size]``), each with a contiguous last dimension and ``out`` not
    overlapping them. False (nothing written) when the library is unavailable."""
    lib = library()
    if lib is None:
        return False
    rows = codes.shape[0]
    _run(lib, "dequantize", rows * full, rows * full * block_size,
         codes.data_ptr(), codes.stride(0), scales.data_ptr(), scales.stride(0), out.data_ptr(),
         out.stride(0), int(out.dtype == torch.bfloat16), full, block_size, bits)
    _calls["dequantize"] += 1
    return True
