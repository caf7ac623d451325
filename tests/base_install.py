"""A base install of qcoll (``pip install qcoll``, no extras), emulated without downloading anything.

:func:`make_base_env` makes a virtual environment without the system's site-packages and links into
its site-packages exactly the installed distributions that qcoll's base requirements pull in
(the closure of ``Requires-Dist`` without extras, read from the installed metadata), plus qcoll
itself (its editable finder or its plain files). Everything of the extras (starlette, uvicorn,
aiohttp, optuna, onnx, matplotlib, peft, ...) is then as absent as on a fresh base install.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig

from packaging.requirements import Requirement


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_closure(root: str = "qcoll") -> set[str]:
    """Normalized names of ``root`` and every distribution its base requirements pull in."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(_key(name))
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _top_level(dist) -> set[str]:
    """The entries of site-packages that ``dist`` installed (packages, modules, .pth, its dist-info)."""
    out = set()
    for f in dist.files or []:
        parts = f.parts
        if parts and parts[0] not in ("..", "__pycache__"):
            out.add(parts[0])
    return out


def make_base_env(folder: str) -> str:
    """A virtual environment in ``folder`` holding only the base install; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    python = os.path.join(folder, "bin", "python")
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    keep = base_closure()
    here = sysconfig.get_paths()["purelib"]
    linked = set()
    for dist in md.distributions():
        if _key(dist.metadata["Name"]) not in keep or os.path.realpath(str(dist.locate_file(""))) != \
                os.path.realpath(here):
            continue
        for entry in _top_level(dist) - linked:
            source = os.path.join(here, entry)
            if os.path.lexists(source):
                os.symlink(source, os.path.join(target, entry))
                linked.add(entry)
    return python
