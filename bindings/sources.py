"""Locate the CUDA C++ sources shipped as package data (``qcoll.cuda_src``).

``importlib.resources`` finds them in the editable install (``src/cuda``) and in an
installed wheel alike, so no source tree is needed at run time.
"""
from __future__ import annotations

import importlib.resources

PACKAGE = "qcoll.cuda_src"
#: the headers the kernels include, each by its bare name (NVRTC resolves an include only
#: by the exact name a header is registered under, so they stay flat in ``src/cuda``)
HEADERS = (
    "qcoll_format.cuh",          # host + device wire-format math (also built by tests/host)
    "qcoll_memory.cuh",          # vector loads / stores of codes, scales, element groups
    "qcoll_block_quantize.cuh",  # device: warp-cooperative block quantizer, dequantize loop
)

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
    "hadamard.cu": ("qcoll_hadamard_rows",),
}


def source_dir():
    """The ``Traversable`` folder holding the sources."""
    return importlib.resources.files(PACKAGE)


def read_source(name: str) -> str:
    """Text of one source file (a ``.cu`` or one of the headers)."""
    if name not in HEADERS and name not in KERNELS:
        raise KeyError(f"unknown qcoll CUDA source {name!r}; known: {sorted(KERNELS)} and {list(HEADERS)}")
    return source_dir().joinpath(name).read_text(encoding="utf-8")


def headers() -> dict[str, str]:
    """Include name -> text of every header the kernels include."""
    return {name: read_source(name) for name in HEADERS}


def kernel_for(name: str) -> str:
    """The source file that defines kernel ``name``."""
    for src, names in KERNELS.items():
        if name in names:
            return src
    raise KeyError(f"unknown qcoll kernel {name!r}")
