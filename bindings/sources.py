"""Locate the CUDA C++ sources shipped as package data (``qcoll.cuda_src``).

``importlib.resources`` finds them in the editable install (``src/cuda``) and in an
installed wheel alike, so no source tree is needed at run time.
"""
from __future__ import annotations

import importlib.resources

PACKAGE = "qcoll.cuda_src"
HEADER = "qcoll_common.cuh"

#: kernel source file -> the extern "C" kernels it defines
KERNELS = {
    "quantize.cu": ("qcoll_quantize_f32", "qcoll_quantize_bf16", "qcoll_quantize_f16"),
    "dequantize.cu": ("qcoll_dequantize_f32", "qcoll_dequantize_bf16", "qcoll_dequantize_f16"),
    "swizzle_quantize.cu": (
        "qcoll_swizzle_quantize_f32",
        "qcoll_swizzle_quantize_bf16",
        "qcoll_swizzle_quantize_f16",
    ),
    "reduce_requantize.cu": ("qcoll_dequantize_reduce", "qcoll_reduce_requantize"),
}


def source_dir():
    """The ``Traversable`` folder holding the sources."""
    return importlib.resources.files(PACKAGE)


def read_source(name: str) -> str:
    """Text of one source file (a ``.cu`` or the shared header)."""
    if name != HEADER and name not in KERNELS:
        raise KeyError(f"unknown qcoll CUDA source {name!r}; known: {sorted(KERNELS)} and {HEADER}")
    return source_dir().joinpath(name).read_text(encoding="utf-8")


def headers() -> dict[str, str]:
    """Include name -> text of every header the kernels include."""
    return {HEADER: read_source(HEADER)}


def kernel_for(name: str) -> str:
    """The source file that defines kernel ``name``."""
    for src, names in KERNELS.items():
        if name in names:
            return src
    raise KeyError(f"unknown qcoll kernel {name!r}")
