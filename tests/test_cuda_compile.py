"""Every kernel source compiles through qcoll.bindings.nvrtc (the runtime path) for sm_80 and
sm_90, defines its extern "C" kernels, and ptxas reports no register spills (nvcc -Xptxas -v)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from qcoll.bindings import sources

ARCHS = ("sm_80", "sm_90")
SRC_DIR = Path(str(sources.source_dir()))


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # cupy absent, or the NVRTC library cannot be loaded
        pytest.skip(f"CuPy with NVRTC is not available: {exc!r}")
    from qcoll.bindings import nvrtc as qnvrtc

    return qnvrtc


def _find_nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True):
        if os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def cubins(tmp_path_factory, monkeypatch_module):
    """(source, arch) -> cubin bytes, compiled once per module into a fresh cache dir."""
    qnvrtc = _nvrtc_or_skip()
    monkeypatch_module.setenv("QCOLL_CACHE_DIR", str(tmp_path_factory.mktemp("qcoll_cache")))
    jobs = [(src, arch) for arch in ARCHS for src in sources.KERNELS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda j: qnvrtc.compile_cubin(j[0], j[1], use_disk_cache=False), jobs))
    return {job: Path(p).read_bytes() for job, p in zip(jobs, paths)}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(sources.KERNELS))
def test_nvrtc_cubin_has_kernels(cubins, source, arch):
    cubin = cubins[(source, arch)]
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    for name in sources.KERNELS[source]:
        assert name.encode() + b"\0" in cubin, f"kernel {name} missing from the {arch} cubin of {source}"


def test_nvrtc_error_carries_log(tmp_path, monkeypatch):
    qnvrtc = _nvrtc_or_skip()
    monkeypatch.setenv("QCOLL_CACHE_DIR", str(tmp_path))
    real = sources.read_source
    monkeypatch.setattr(sources, "read_source",
                        lambda name: "this is not C++;" if name == "quantize.cu" else real(name))
    with pytest.raises(qnvrtc.NVRTCCompileError, match="quantize.cu"):
        qnvrtc.compile_cubin("quantize.cu", "sm_90")


def test_cache_reuses_cubin(tmp_path, monkeypatch):
    qnvrtc = _nvrtc_or_skip()
    monkeypatch.setenv("QCOLL_CACHE_DIR", str(tmp_path))
    calls = []
    real = qnvrtc._compile
    monkeypatch.setattr(qnvrtc, "_compile", lambda s, a: calls.append((s, a)) or real(s, a))
    p1 = qnvrtc.compile_cubin("dequantize.cu", "90")
    p2 = qnvrtc.compile_cubin("dequantize.cu", "sm_90")
    assert p1 == p2 and p1.parent == tmp_path and len(calls) == 1


SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
REGS_RE = re.compile(r"Used (\d+) registers")


def _ptxas_report(nvcc: str, src: str, arch: str, out_dir: Path):
    from qcoll.bindings import nvrtc as qnvrtc

    # -cubin: the device code alone, as NVRTC builds it at run time (-c would also run the host compiler over
    # the source, a third of the time, for an object nothing loads); ptxas's report is the same
    cmd = [nvcc, *[o for o in qnvrtc.BASE_OPTIONS if o != "-default-device"], f"-arch={arch}", "-Xptxas", "-v",
           "-cubin", str(SRC_DIR / src), "-o", str(out_dir / f"{Path(src).stem}-{arch}.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return cmd, res


def test_ptxas_no_spills(tmp_path):
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or in /usr/local/cuda*/bin")
    jobs = [(src, arch) for arch in ARCHS for src in sorted(sources.KERNELS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _ptxas_report(nvcc, j[0], j[1], tmp_path), jobs))
    problems, seen = [], set()
    for (src, arch), (cmd, res) in zip(jobs, results):
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
        text = res.stdout + res.stderr
        entry = None
        for line in text.splitlines():
            m = ENTRY_RE.search(line)
            if m:
                entry = m.group(1)
                seen.add(entry)
            m = SPILL_RE.search(line)
            if m and (int(m.group(1)) or int(m.group(2))):
                problems.append(f"{src} {arch} {entry}: {line.strip()}")
            m = REGS_RE.search(line)
            if m:
                print(f"{src} {arch} {entry}: {m.group(1)} registers")
    assert not problems, "ptxas reports spills:\n" + "\n".join(problems)
    expected = {name for names in sources.KERNELS.values() for name in names}
    assert expected <= seen, f"ptxas never compiled {sorted(expected - seen)}"


def test_every_kernel_source_is_compiled_and_checked():
    """sources.KERNELS drives the tests above: it must name every .cu file shipped, each with kernels."""
    on_disk = {p.name for p in SRC_DIR.glob("*.cu")}
    assert {"quantize.cu", "dequantize.cu", "swizzle_quantize.cu", "reduce_requantize.cu"} <= on_disk
    assert set(sources.KERNELS) == on_disk
    assert all(sources.KERNELS[s] for s in on_disk)


def test_every_header_is_passed_to_nvrtc():
    """NVRTC sees only the headers sources.headers() names: it must name every .cuh shipped, and
    every quoted #include of a source or header must be one of them."""
    headers = sources.headers()
    assert set(headers) == {p.name for p in SRC_DIR.glob("*.cuh")}
    for name in [*sources.KERNELS, *headers]:
        included = re.findall(r'^\s*#\s*include\s+"([^"]+)"', sources.read_source(name), re.M)
        assert set(included) <= set(headers), (name, included)
        assert included or name in headers, f"{name} includes no qcoll header"


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all_returns_every_source(arch, cubins):
    qnvrtc = _nvrtc_or_skip()
    paths = qnvrtc.compile_all(arch)  # the module fixture's cache directory: no recompilation
    assert set(paths) == set(sources.KERNELS)
    assert all(paths[s].read_bytes() == cubins[(s, arch)] for s in paths)
