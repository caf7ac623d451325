"""Every CUDA kernel compiles through the runtime's NVRTC path (sm_80, sm_90) and under nvcc without spills."""
import glob
import os
import re
import shutil
import subprocess

import pytest

CUDA_DIR = os.path.join(os.path.dirname(__file__), "..", "src", "cuda")
SOURCES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def _nvcc():
    return shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)


def test_there_are_kernel_sources():
    assert {"quantize.cu", "dequantize.cu", "swizzle_quantize.cu", "reduce_requantize.cu"} <= set(SOURCES)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_through_nvrtc(arch, tmp_path, monkeypatch):
    try:
        from cupy_backends.cuda.libs import nvrtc as _  # noqa: F401
    except Exception as e:
        pytest.skip(f"NVRTC (CuPy) is not installed: {e}")
    from qcoll.bindings import nvrtc

    monkeypatch.setenv("QCOLL_CACHE_DIR", str(tmp_path))
    cubins = nvrtc.compile_all(arch, use_disk_cache=False)
    assert set(cubins) == set(SOURCES)
    for path in cubins.values():
        data = path.read_bytes()
        assert data[:4] == b"\x7fELF" and len(data) > 1000


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_have_no_register_spills(arch, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    for src in SOURCES:
        res = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "--fmad=false", "-Xptxas", "-v", "-c",
                              "-I", CUDA_DIR, os.path.join(CUDA_DIR, src), "-o", str(tmp_path / "k.o")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
        assert spills, f"no ptxas report for {src}: {res.stderr}"
        assert all(s == ("0", "0") for s in spills), f"{src} spills registers on {arch}: {res.stderr}"
