"""Choice between the torch reference and the CUDA kernels.

``QCOLL_BACKEND`` = ``auto`` (default: CUDA kernels for CUDA tensors when CuPy is
importable), ``reference`` (always the torch reference) or ``cuda`` (CUDA kernels
for CUDA tensors, an error if they cannot be loaded).
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "cuda")


def backend_setting() -> str:
    value = os.environ.get("QCOLL_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"QCOLL_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def _kernels_importable() -> bool:
    try:
        import cupy  # noqa: F401

        import qcoll.bindings.ops  # noqa: F401  (the launchers, not only CuPy)
    except Exception:
        return False
    return True


def use_cuda(x: torch.Tensor) -> bool:
    """True when the operation on ``x`` should run the CUDA kernels."""
    setting = backend_setting()
    if not x.is_cuda or setting == "reference":
        return False
    if _kernels_importable():
        return True
    if setting == "cuda":
        raise RuntimeError("QCOLL_BACKEND=cuda but CuPy is not importable; install qcoll[cuda12] or qcoll[cuda13]")
    return False


def kernels():
    """The CUDA launchers (imported lazily so CPU-only installs never touch CuPy)."""
    from qcoll.bindings import ops

    return ops
