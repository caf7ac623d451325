"""The tests exercise the installed qcoll: one install, never the source tree's ``qcoll/`` over it.

After a plain ``pip install .`` the source tree's ``qcoll/`` lacks ``bindings`` and
``cuda_src`` (pip maps them from ``bindings/`` and ``src/cuda/``); importing it would
test other code than the one installed, or fail at collection. See ``conftest.py``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import qcoll
import qcoll.bindings
import qcoll.cuda_src

ROOT = Path(__file__).resolve().parents[1]


def test_repository_root_is_not_on_sys_path():
    assert str(ROOT) not in [os.path.realpath(p or os.curdir) for p in sys.path]


def test_the_installed_qcoll_is_this_checkout_or_a_plain_install():
    """An editable install maps ``qcoll.bindings``/``qcoll.cuda_src`` to this checkout's ``bindings/`` and
    ``src/cuda/``; a plain one puts them inside the installed ``qcoll/``. Anything else (an editable install
    of another checkout, a half-shadowed package) would test other code than this checkout's."""
    pkg = Path(qcoll.__file__).resolve().parent
    bindings = Path(qcoll.bindings.__file__).resolve().parent
    cuda_src = Path(qcoll.cuda_src.__file__).resolve().parent
    if bindings == pkg.parent / "bindings":    # an editable install of the checkout pkg.parent
        assert pkg.parent == ROOT, (f"the tests of {ROOT} import qcoll from {pkg}, an editable install of "
                                    f"another checkout: run `pip install -e .` here (or use a virtual environment)")
        assert cuda_src == ROOT / "src" / "cuda"
    else:                                      # a plain install: one package directory, outside the checkout
        assert (bindings, cuda_src) == (pkg / "bindings", pkg / "cuda_src"), (pkg, bindings, cuda_src)
        assert ROOT not in pkg.parents, f"qcoll imported from the source tree {pkg}, not the installed package"
    assert sorted(cuda_src.glob("*.cu")), f"no kernel sources in {cuda_src}"


def test_every_package_of_the_source_tree_is_installed():
    """pyproject.toml lists the packages one by one: a new ``qcoll/<name>/`` left out of the list is
    missing from a plain install (CI's), though an editable one would still find it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qcoll").rglob("__init__.py")}
    assert found <= listed, f"packages missing from [tool.setuptools] packages: {sorted(found - listed)}"
    import qcoll.testing

    assert Path(qcoll.testing.__file__).resolve().parent.parent == Path(qcoll.__file__).resolve().parent
