"""``pip install qcoll`` without extras runs every ``qcoll-bench`` subcommand but ``serve``, which says
which extra it needs (the base install is emulated by :mod:`base_install`: a virtual environment
holding only the distributions that qcoll's base requirements pull in)."""
import os
import subprocess

import pytest

from base_install import make_base_env
from qcoll.bench.cli import SUBCOMMANDS

EXTRAS_ONLY = ("starlette", "uvicorn", "aiohttp", "optuna", "onnxruntime", "matplotlib", "peft", "hypothesis")


@pytest.fixture(scope="module")
def base_python(tmp_path_factory):
    return make_base_env(str(tmp_path_factory.mktemp("base-venv") / "venv"))


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QCOLL_PROGRESS")}


def _run(python, *argv, timeout=120):
    return subprocess.run([python, "-m", "qcoll.bench", *argv], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd="/")


def test_the_base_environment_lacks_the_extras(base_python):
    script = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])" % (EXTRAS_ONLY,)
    out = subprocess.run([base_python, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_every_subcommand_shows_its_help_on_the_base_install(base_python):
    """Each subcommand's ``--help`` in one process (the parser imports every subcommand's module)."""
    script = ("import sys\nfrom qcoll.bench.cli import main\nfor c in sys.argv[1:]:\n    try:\n"
              "        main([c, '--help'])\n    except SystemExit as e:\n        assert e.code == 0, (c, e.code)\n")
    out = subprocess.run([base_python, "-c", script, *SUBCOMMANDS], capture_output=True, text=True, timeout=120,
                         cwd="/", env=_env())
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    for command in SUBCOMMANDS:
        assert f"usage: qcoll-bench {command}" in out.stdout, command


def test_serve_names_the_extra_it_needs(base_python):
    out = _run(base_python, "serve")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "needs the serve extra" in out.stderr and "pip install 'qcoll[serve]'" in out.stderr, out.stderr


def test_the_main_job_runs_on_the_base_install(base_python):
    out = _run(base_python, "collectives", "--nproc", "2", "--ranks-per-node", "1", "--min", "4K", "--max", "4K",
               "--iters", "1", "--warmup", "0", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "qwZ" in out.stdout or "qwz" in out.stdout.lower(), out.stdout
