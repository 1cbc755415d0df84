"""mpidp.launch: a world of one that the launcher meant to be larger is reported, with the fix."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import launch
from mpidp.launch import check_world

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ...\n"
OPEN_MPI = "Open MPI v5.0.8, package: Open MPI root@host Distribution, ident: 5.0.8, repo rev: v5.0.8"
INTEL = "Intel(R) MPI Library 2021.13 for Linux* OS"

SRUN_4 = {"SLURM_JOB_ID": "17", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"PATH": "/usr/bin"},
        {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "17"},  # srun -n 1 in a 4-task allocation
        {"PMI_SIZE": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "17"},  # mpiexec -n 1 in a 4-task allocation
        {"OMPI_COMM_WORLD_SIZE": "1"},
        {"SLURM_NTASKS": "1"},
        {"SLURM_NTASKS": ""},
        {"SLURM_NTASKS": "four"},
        {"SLURM_NTASKS": "0"},
        {"FLUX_JOB_SIZE": "1"},
    ],
)
def test_nothing_to_report(environ: dict[str, str]) -> None:
    assert check_world(1, MPICH, environ) is None


@pytest.mark.parametrize("environ", [SRUN_4, {"PMI_SIZE": "4"}, {"OMPI_COMM_WORLD_SIZE": "8"}, {"FLUX_JOB_SIZE": "2"}])
def test_a_real_world_is_never_reported(environ: dict[str, str]) -> None:
    assert check_world(4, MPICH, environ) is None
    assert check_world(2, None, environ) is None


def test_srun_without_pmi_names_variable_and_fix_for_mpich() -> None:
    text = check_world(1, MPICH, SRUN_4)
    assert text is not None
    assert "SLURM_STEP_NUM_TASKS=4" in text
    assert "world of 1" in text
    assert "srun --mpi=pmi2" in text and "--mpi=pmix" not in text
    assert "srun --mpi=list" in text
    assert "without a process-management interface" in text


def test_srun_without_pmi_fix_for_open_mpi() -> None:
    text = check_world(1, OPEN_MPI, SRUN_4)
    assert text is not None
    assert "srun --mpi=pmix" in text and "--mpi=pmi2" not in text


def test_intel_mpi_is_an_mpich_derivative() -> None:
    text = check_world(1, INTEL, SRUN_4)
    assert text is not None and "srun --mpi=pmi2" in text


def test_unknown_library_suggests_both() -> None:
    for library in (None, "", "Some Vendor MPI 1.0"):
        text = check_world(1, library, SRUN_4)
        assert text is not None
        assert "srun --mpi=pmi2" in text and "srun --mpi=pmix" in text


def test_step_count_wins_over_allocation_count() -> None:
    text = check_world(1, MPICH, {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "8"})
    assert text is not None and "SLURM_STEP_NUM_TASKS=3" in text and "SLURM_NTASKS" not in text


@pytest.mark.parametrize("name", ["SLURM_NTASKS", "SLURM_NPROCS"])
def test_older_slurm_variables(name: str) -> None:
    text = check_world(1, MPICH, {name: "6", "SLURM_STEPID": "0"})
    assert text is not None and f"{name}=6" in text and "srun --mpi=pmi2" in text


def test_python_run_directly_in_the_batch_script() -> None:
    # the batch script's own environment: an allocation of 4 tasks, no job step
    text = check_world(1, OPEN_MPI, {"SLURM_JOB_ID": "17", "SLURM_NTASKS": "4"})
    assert text is not None
    assert "SLURM_NTASKS=4" in text
    assert "started directly in the batch script" in text
    assert "srun --mpi=pmix" in text


@pytest.mark.parametrize("name", launch.MPI_SIZE_VARIABLES)
def test_launcher_of_another_mpi(name: str) -> None:
    text = check_world(1, MPICH, {name: "4"})
    assert text is not None
    assert f"{name}=4" in text
    assert "different MPI" in text
    assert "MPICH Version:      5.0.2" in text  # what mpi4py uses, first line only
    assert "Release date" not in text
    assert "srun" not in text.split("Fix:")[1].replace("srun with a --mpi= plugin", "")


def test_launcher_of_another_mpi_under_slurm_adds_srun_fix() -> None:
    text = check_world(1, OPEN_MPI, {"PMI_SIZE": "4", "SLURM_JOB_ID": "17", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"})
    assert text is not None
    assert "PMI_SIZE=4" in text  # the MPI launcher's variable is named, not Slurm's
    assert "srun --mpi=pmix" in text


def test_mpi_launcher_variable_wins_over_scheduler() -> None:
    # mpiexec -n 2 inside an allocation of 8: the launcher's 2 is what was asked for
    text = check_world(1, MPICH, {"PMI_SIZE": "2", "SLURM_NTASKS": "8"})
    assert text is not None and "PMI_SIZE=2" in text and "SLURM_NTASKS" not in text


def test_flux() -> None:
    text = check_world(1, OPEN_MPI, {"FLUX_JOB_SIZE": "4"})
    assert text is not None and "FLUX_JOB_SIZE=4" in text and "pmi" in text


def test_whitespace_is_tolerated() -> None:
    text = check_world(1, MPICH, {"SLURM_NTASKS": " 4\n"})
    assert text is not None and "SLURM_NTASKS=4" in text


@pytest.mark.parametrize("size", [0, -1, True, 1.0, "1", None])
def test_size_must_be_a_positive_int(size: object) -> None:
    with pytest.raises(ValueError, match="size must be a positive int"):
        check_world(size, MPICH, {})  # type: ignore[arg-type]


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in launch.MPI_SIZE_VARIABLES + launch.SCHEDULER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert check_world(1) is None
    monkeypatch.setenv("SLURM_NTASKS", "5")
    text = check_world(1)
    assert text is not None and "SLURM_NTASKS=5" in text


def test_launch_imports_no_mpi() -> None:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(launch))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.startswith("mpi4py") for name in imported), imported


def test_warning_category() -> None:
    assert issubclass(launch.LaunchWarning, RuntimeWarning)


@pytest.mark.mpi_skip  # in a world of one only: a real world warns of nothing (see the tests above)
def test_initialize_warns_on_a_world_of_one_under_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in launch.MPI_SIZE_VARIABLES + launch.SCHEDULER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, MPI.COMM_SELF):
            pass
    found = [w for w in caught if issubclass(w.category, launch.LaunchWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "SLURM_STEP_NUM_TASKS=4" in str(found[0].message)
    assert found[0].filename == __file__  # stacklevel points at the caller of initialize


# ------------------------------------------------------------ MPIDP_ names mpidp does not read

ROOT = Path(__file__).resolve().parent.parent


# (names built here: a quoted misspelt name would count as a variable the project reads, for tests/test_readme.py)
UP, LOW = "MPIDP_", "mpidp_"


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({UP + "TIMOUT": "5"}, f"ignoring {UP}TIMOUT (did you mean MPIDP_TIMEOUT?): mpidp reads no such environment variable"),
        ({LOW + "timeout": "5"}, f"ignoring {LOW}timeout (names are upper-case: MPIDP_TIMEOUT)"),
        ({"Mpidp_Reduction": "allreduce"}, "ignoring Mpidp_Reduction (names are upper-case: MPIDP_REDUCTION)"),
        ({UP + "CUDAAWARE": "1"}, f"ignoring {UP}CUDAAWARE (did you mean MPIDP_CUDA_AWARE?)"),
        ({UP + "REDUCE": "x", UP + "TIMOUT": "1"}, f"ignoring {UP}REDUCE (did you mean MPIDP_REDUCTION?), {UP}TIMOUT (did you"),
        ({UP + "XYZZY": "1"}, f"ignoring {UP}XYZZY: mpidp reads"),  # nothing close: no guess
    ],
)
def test_unknown_mpidp_variables_are_named_with_the_closest_known_one(environ: dict[str, str], fragment: str) -> None:
    text = launch.unknown_variables({"PATH": "/usr/bin", "MPIDP_TIMEOUT": "60", **environ})
    assert text is not None and fragment in text, text
    assert text.endswith("It reads MPIDP_TIMEOUT, MPIDP_REDUCTION, MPIDP_CUDA_AWARE, MPIDP_CASTS, MPIDP_EXACT_KERNELS (docs/environment.md).")


def test_the_names_of_the_library_and_of_the_projects_scripts_are_known() -> None:
    every = {name: "1" for name in launch.LIBRARY_VARIABLES + launch.TOOL_VARIABLES}
    assert launch.unknown_variables({**every, "MPIDPX": "1", "XMPIDP_TIMOUT": "1", "PATH": "/bin"}) is None


def _names_in(paths: list[Any]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        found |= set(re.findall(r"\bMPIDP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    return found


def test_every_variable_mpidp_reads_is_known_and_every_other_one_the_project_uses_is_too() -> None:
    """The library's names, from its source; the scripts', tests' and benchmarks' names: none of them warns."""
    library = _names_in([p for p in sorted((ROOT / "mpidp").rglob("*.py")) if p.name != "launch.py"])  # (the lists themselves)
    assert library == set(launch.LIBRARY_VARIABLES), library ^ set(launch.LIBRARY_VARIABLES)
    tools = [
        p for d in ("scripts", "tests", "benchmarks") for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in ("", ".py", ".sh", ".sbatch") and p.resolve() != Path(__file__).resolve()  # (misspellings on purpose)
    ]
    used = _names_in(tools) - {UP + "VARIANTS"}  # a list in tests/test_bench_smoke.py, not a variable
    assert used <= set(launch.LIBRARY_VARIABLES + launch.TOOL_VARIABLES), used - set(launch.LIBRARY_VARIABLES + launch.TOOL_VARIABLES)
    rows = [line.split("|")[1] for line in (ROOT / "docs" / "environment.md").read_text().splitlines() if line.startswith("|")]
    documented = set(re.findall(r"\bMPIDP_[A-Z0-9_]*[A-Z0-9]\b", " ".join(rows)))  # the table's first column
    assert documented == set(launch.LIBRARY_VARIABLES + launch.TOOL_VARIABLES), documented ^ set(launch.LIBRARY_VARIABLES + launch.TOOL_VARIABLES)


@pytest.mark.mpi_skip  # a world of one: the process's first session warns
def test_initialize_warns_once_about_a_misspelt_variable(tmp_path: Any) -> None:
    """In a fresh process: the first session's root warns, pointing at the caller; the second session does not."""
    import subprocess
    import sys

    from conftest import clean_env

    script = tmp_path / "misspelt.py"
    script.write_text(
        "import warnings, numpy as np, mpidp\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    mpidp.DataParallel.initialize({'w': np.zeros(3, np.float32)}).close()\n"
        "    mpidp.DataParallel.initialize({'w': np.zeros(3, np.float32)}).close()\n"
        "found = [w for w in caught if issubclass(w.category, mpidp.launch.VariableWarning)]\n"
        "print(len(found), found[0].filename == __file__, found[0].message)\n"
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False,
                       env=clean_env(**{UP + "TIMOUT": "5", LOW + "reduction": "allreduce"}))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"1 True mpidp: ignoring {UP}TIMOUT (did you mean MPIDP_TIMEOUT?), {LOW}reduction (names are"), p.stdout
