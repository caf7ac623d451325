"""Shared fixtures; the tests import this checkout's installed qcoll, never the source tree.

``python -m pytest`` puts the current directory first on ``sys.path``; run from the
repository root, the source tree's ``qcoll/`` would then shadow the installed package,
and it lacks ``qcoll.bindings`` and ``qcoll.cuda_src`` (pip maps them from ``bindings/``
and ``src/cuda/``). So the repository root is dropped from ``sys.path`` here, before
any test imports qcoll: ``pytest -q`` (the README's command) and ``python -m pytest -q``
test the same, installed code after an editable or a plain install alike. A qcoll that is
missing, or an editable install of another checkout, stops the run with the reason.
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

TESTS = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != ROOT]
sys.path.insert(0, TESTS)


def _not_this_checkout() -> str | None:
    """Why the qcoll the tests would import is not this checkout's installed package, or None."""
    spec = importlib.util.find_spec("qcoll")
    if spec is None:
        return f"qcoll is not installed in {sys.executable}"
    pkg = Path(spec.origin).resolve().parent
    bindings_spec = importlib.util.find_spec("qcoll.bindings")
    if bindings_spec is None:
        return f"{sys.executable} imports qcoll from {pkg}, which has no qcoll.bindings (not an installed qcoll)"
    bindings = Path(bindings_spec.origin).resolve().parent
    if bindings == pkg.parent / "bindings" and pkg.parent != Path(ROOT):
        return f"{sys.executable} has an editable install of another checkout, {pkg.parent}"
    return None


_why = _not_this_checkout()
if _why:
    raise pytest.UsageError(
        f"{_why}; the tests of {ROOT} test this checkout, installed: run `pip install -e '.[test]'` "
        "(or `pip install '.[test]'`) here first (see README.md). Beside a system-wide editable install of another "
        "checkout: `python3 -m venv --system-site-packages .venv && .venv/bin/pip install --no-deps -e .`, "
        "then `.venv/bin/python -m pytest -q`.")

from distributed import PRELOAD, RankPool  # noqa: E402


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks kept alive for the whole session (2 nodes x 2 by default in tests)."""
    pool = RankPool(4, preload=PRELOAD)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks (for resharding a 4-rank checkpoint into 2)."""
    pool = RankPool(2, preload=PRELOAD)
    yield pool
    pool.close()
