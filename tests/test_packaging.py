"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel, and the wheel, installed with
``[mpich]`` into a fresh virtual environment, runs an example under ``mpiexec -n 2`` from outside the checkout.

Every step is a subprocess in its own process group, killed after its time limit, so nothing hangs. The fresh
environment gets no torch (the NumPy example needs none) and pip's cache keeps the install to seconds after the
first run. These tests start their own MPI jobs, so they run in the serial pass only.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi_skip


def run(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; after ``timeout`` seconds its whole process group is killed and the test fails."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish in {timeout} s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out)


def checked(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    result = run(argv, cwd, timeout, env)
    assert result.returncode == 0, f"{' '.join(argv)} -> {result.returncode}:\n{result.stdout}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build`` of the checkout: the sdist, and the wheel built from it."""
    out = tmp_path_factory.mktemp("dist")
    # the build environments made by uv where scripts/venv.sh installed it (3 s instead of pip's 7; the same wheel)
    installer = ["--installer", "uv"] if importlib.util.find_spec("uv") is not None else []
    checked([sys.executable, "-m", "build", *installer, "--outdir", str(out), str(ROOT)], ROOT, 300)
    (sdist,) = out.glob("mpidp-*.tar.gz")
    (wheel,) = out.glob("mpidp-*-py3-none-any.whl")
    return {"sdist": sdist, "wheel": wheel}


def user_env(venv: Path) -> dict[str, str]:
    """The environment of a user whose shell has ``venv`` activated: no checkout on any path, no launcher."""
    env = clean_env()
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def installed(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fresh virtual environment outside the checkout with ``<wheel>[mpich]`` installed."""
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    env = user_env(venv)
    checked([sys.executable, "-m", "venv", str(venv)], home, 120, env)
    checked([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{dist['wheel']}[mpich]"], home, 600, env)
    return {"home": home, "venv": venv, "env": env}


def test_wheel_carries_the_package_the_examples_and_the_licence(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for name in ("mpidp/__init__.py", "mpidp/py.typed", "mpidp/examples/logreg.py", "mpidp/examples/charlm.py"):
        assert name in names, f"{name} is missing from {dist['wheel'].name}: {sorted(names)}"
    licences = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
    assert licences, f"no LICENSE in {dist['wheel'].name}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/"))], sorted(names)
    assert "License: MIT" in metadata or "License-Expression: MIT" in metadata, metadata[:2000]
    assert "Provides-Extra: mpich" in metadata and "Requires-Dist: mpi4py>=4" in metadata, metadata[:2000]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
    for name in ("LICENSE", "README.md", "pyproject.toml", "setup.cfg", "mpidp/py.typed", "mpidp/examples/logreg.py"):
        assert name in members, f"{name} is missing from {dist['sdist'].name}"


def test_installed_wheel_runs_an_example_outside_the_checkout(installed: dict[str, Any]) -> None:
    venv, home, env = installed["venv"], installed["home"], installed["env"]
    python = str(venv / "bin" / "python")
    where = checked(
        [python, "-c", "import importlib.util, mpidp; print(mpidp.__file__); print(importlib.util.find_spec('torch'))"],
        home, 60, env,
    ).split()
    site = Path(checked([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home, 60, env).strip())
    assert Path(where[0]).parent == site / "mpidp", f"mpidp imported from {where[0]}, not from {site}"
    assert not Path(where[0]).resolve().is_relative_to(ROOT)
    assert where[1] == "None", "torch is installed in the fresh environment; the test should stay small"
    mpiexec = venv / "bin" / "mpiexec"
    assert mpiexec.exists(), "the [mpich] extra installed no mpiexec into the environment"
    result = run([str(mpiexec), "-n", "2", python, "-m", "mpi4py", "-m", "mpidp.examples.logreg", "--steps", "30"], home, 120, env)
    assert result.returncode == 0, result.stdout
    assert "done: 30 steps on 2 ranks" in result.stdout, result.stdout
    assert result.stdout.count("done:") == 1, result.stdout
