"""Shared test set-up: the passes of scripts/test, a per-test watchdog and helpers for collective assertions.

Every test runs under a faulthandler watchdog: a test that deadlocks dumps
every thread's stack (to a duplicate of stderr taken before pytest's capture)
and exits the process, so under ``mpiexec`` the job ends instead of hanging.
Its limit is ``MPIDP_TEST_TIMEOUT`` (300 s), or a test's ``time_limit`` mark.

``--pass NAME`` keeps the tests that pass of scripts/test is for (``PASSES``;
docs/development.md): a test that takes ``comm`` (or ``either``) is marked
``collective`` here, one that takes ``where`` ``refusal``; ``transport``
(the bytes MPI moves, or how), ``hosts`` (simulated hosts only) and ``gpu``
(CuPy or its CPU stand-in) are marked by the test files.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from replicas import model

import mpidp

#: seconds one test may run before its stacks are dumped and the process exits (a hang, not a slow machine:
#: no test takes a tenth of it on a quiet 2-core machine; a test that starts longer jobs sets ``time_limit``)
TEST_TIMEOUT = float(os.environ.get("MPIDP_TEST_TIMEOUT", "300"))
_stderr = None

#: fixtures that make a test collective: it runs on every rank of the world and means more than one rank there
COLLECTIVE_FIXTURES = {"comm", "either"}

#: scripts/test's passes after the serial one (which runs every test): what each keeps, by the tests' marks
PASSES: dict[str, Callable[[set[str]], bool]] = {
    # mpiexec -n 4: what a world of several ranks changes; a test that does not take the world runs serially only
    "ranks": lambda marks: "collective" in marks,
    # MPIR_CVAR_NOLOCAL=1 (no shared memory between ranks): what depends on how MPI moves the bytes; a refusal
    # (bad input on one rank or on every rank) agrees on a few small records before anything moves: it does not
    "transport": lambda marks: {"collective", "transport"} <= marks and "refusal" not in marks,
    # tests/fakegpu, three schedules: what runs on device arrays
    "gpu": lambda marks: "gpu" in marks,
    # 2 simulated hosts over TCP (scripts/multihost.py): the transport's tests and what only hosts show
    "hosts": lambda marks: "collective" in marks and ("hosts" in marks or ("transport" in marks and "refusal" not in marks)),
    # mpiexec -n 4 where the hosts pass runs too: the collective tests that pass leaves out (it runs the others at
    # 4 ranks as well, 2 to a host: shared memory within a host, TCP between them)
    "ranks-not-hosts": lambda marks: PASSES["ranks"](marks) and not PASSES["hosts"](marks),
}
#: the fixture of a refusal test: bad input on one rank, or on every rank (marked ``refusal`` here)
REFUSAL_FIXTURES = {"where"}

#: the serial pass's longest test files, longest first (seconds on one of its two workers, quiet): its workers
#: take them first (``--no-loadscope-reorder``: in this order, not by their number of tests), so that the
#: short files fill the end instead of one worker running a long file alone
LONGEST_FIRST = (
    "tests/test_bench_smoke.py",  # 108
    "tests/test_faults.py",  # 67
    "tests/test_example_sharded.py",  # 49
    "tests/test_multihost.py",  # 45
    "tests/lightning/test_lightning.py",  # 43
    "tests/test_examples.py",  # 34
    "tests/test_example_charlm.py",  # 33
    "tests/torch_distributed/test_backend.py",  # 30
    "tests/test_readme.py",  # 24
    "tests/test_packaging.py",  # 15
    "tests/test_train_step_smoke.py",  # 14
    "tests/overlap/test_overlap.py",  # 13
    "tests/torch_distributed/test_clients.py",  # 13
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pass", dest="mpidp_pass", choices=sorted(PASSES), help="keep only the tests of this pass of scripts/test")
    parser.addoption("--list-passes", dest="mpidp_list_passes", metavar="DIR",
                     help="write DIR/PASS for every pass: the test files that hold its tests (before -k or -m narrow them)")


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    _stderr = os.fdopen(os.dup(2), "w")
    if MPI.COMM_WORLD.Get_size() > 1 and MPI.COMM_WORLD.Get_rank() > 0:
        config.option.verbose = -2  # one report is enough; failures still print
    for line in (
        "collective: takes the world (comm): runs on every rank; the mpiexec -n 4 pass (set by conftest)",
        "transport: its results depend on how MPI moves bytes: the off-shared-memory and two-host passes",
        "refusal: bad input on one rank or on every rank (takes `where`; set by conftest): not in those two passes",
        "hosts: shows what only several hosts show: the two-host pass",
        "gpu: runs on device arrays (CuPy or tests/fakegpu): the fake-GPU passes",
        "time_limit(seconds): this test's watchdog limit, for a test that starts long jobs of its own",
    ):
        config.addinivalue_line("markers", line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Close the watchdog's copy of stderr (left open, it was a ResourceWarning at every session's end)."""
    if _stderr is not None:
        _stderr.close()


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: the lists hold every test of a pass
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the serial pass: the longest files first, the others as collected
        first = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if COLLECTIVE_FIXTURES & fixtures:
            item.add_marker("collective")
        if REFUSAL_FIXTURES & fixtures:
            item.add_marker("refusal")
    folder = config.getoption("mpidp_list_passes")
    if folder is not None:  # scripts/test's later passes collect only these files (a test module imports torch, parses docs...)
        for name, keep in PASSES.items():
            files = sorted({item.nodeid.split("::")[0] for item in items if keep({m.name for m in item.iter_markers()})})
            Path(folder, name).write_text("".join(f"{f}\n" for f in files))
    name = config.getoption("mpidp_pass")
    if name is None:
        return
    keep = PASSES[name]
    selected = [item for item in items if keep({m.name for m in item.iter_markers()})]
    deselected = [item for item in items if item not in selected]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With ``MPIDP_FAKE_SCHEDULES=lazy,random:1,...``, every ``gpu`` test runs once per fake-GPU schedule, in one job."""
    schedules = [s for s in os.environ.get("MPIDP_FAKE_SCHEDULES", "").split(",") if s]
    if schedules and metafunc.definition.get_closest_marker("gpu") is not None:
        metafunc.fixturenames.append("fake_schedule")
        metafunc.parametrize("fake_schedule", schedules, indirect=True)


@pytest.fixture
def fake_schedule(request: pytest.FixtureRequest) -> Iterator[str]:
    """The schedule of tests/fakegpu's queued work for this test (``cupy.cuda.set_schedule``), reset afterwards."""
    import cupy

    cupy.cuda.set_schedule(request.param)
    yield request.param
    cupy.cuda.set_schedule(os.environ.get("MPIDP_FAKE_SCHEDULE", "lazy"))


@pytest.fixture(autouse=True)
def _watchdog(request: pytest.FixtureRequest) -> Any:
    mark = request.node.get_closest_marker("time_limit")
    limit = max(TEST_TIMEOUT, float(mark.args[0])) if mark else TEST_TIMEOUT
    faulthandler.dump_traceback_later(limit, exit=True, file=_stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def comm() -> MPI.Comm:
    return MPI.COMM_WORLD


@pytest.fixture
def folder(comm: MPI.Comm) -> Iterator[Path]:
    """A fresh folder every rank sees (made on rank 0, its name broadcast), removed afterwards."""
    name = comm.bcast(tempfile.mkdtemp(prefix="mpidp-test-") if comm.rank == 0 else None)
    yield Path(name)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(name, ignore_errors=True)


@pytest.fixture
def dp(comm: MPI.Comm) -> Any:
    """A session on :func:`replicas.model` (``frozen`` frozen); ``dp.params`` is its parameter mapping."""
    params = model(100 + comm.rank)
    d = mpidp.DataParallel.initialize(params, comm, frozen=["frozen"])
    d.params = params  # type: ignore[attr-defined]
    yield d
    d.close()


@pytest.fixture(params=["one", "every"])
def where(request: pytest.FixtureRequest, comm: MPI.Comm) -> tuple[bool, int]:
    """Whether this rank holds the bad input, and the first rank that does."""
    if request.param == "one":
        bad = comm.size - 1
        return comm.rank == bad, bad
    return True, 0


def outcome(fn: Callable[[], Any]) -> tuple[str, str] | None:
    """Run ``fn`` and return ``(exception type, message)``, or None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e).__name__, str(e)
    return None


def same_error_everywhere(comm: MPI.Comm, fn: Callable[[], Any], kind: type, *fragments: str) -> str:
    """Assert that ``fn`` raises the same ``kind`` with the same message on every rank.

    Every fragment must appear in the message. Returns the message.
    """
    mine = outcome(fn)
    every = comm.allgather(mine)
    assert mine is not None, f"rank {comm.rank} raised nothing; all ranks: {every}"
    assert all(o == every[0] for o in every), f"ranks disagree: {every}"
    assert mine[0] == kind.__name__, mine
    for fragment in fragments:
        assert fragment in mine[1], (fragment, mine[1])
    return mine[1]


@contextlib.contextmanager
def first_ranks(comm: MPI.Comm, n: int) -> Iterator[MPI.Comm | None]:
    """A communicator of ``comm``'s first ``n`` ranks (collective on ``comm``); None on the other ranks."""
    sub = comm.Split(0 if comm.rank < n else MPI.UNDEFINED, comm.rank)
    try:
        yield None if sub == MPI.COMM_NULL else sub
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()


def clean_env(**extra: str) -> dict[str, str]:
    """Return os.environ without the launcher's variables, for a subprocess that starts its own MPI job.

    MPICH's ranks of that job sleep briefly when they wait (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``) instead of spinning:
    the serial pass's two workers start jobs of up to 5 ranks on 2 cores, and a rank that spins takes a core from
    the ranks with work, its own job's and the other worker's (the pass: 367 to 344 s, 108 to 77 kernel seconds).
    How MPI waits changes nothing a test checks; ``extra`` may set it otherwise.
    """
    prefixes = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_", "OMPI_", "PRTE_", "MPIR_CVAR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    env.update(extra)
    return env


def checkpoint_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m mpidp.checkpoint ARGS``: a process of its own in a world of one, as a user runs it; in a larger world
    (one rank runs it while the others wait) its ``main`` here, on the same files, without a process that imports
    NumPy and MPI anew while the waiting ranks spin (it uses no MPI: what the world adds is the files it reads)."""
    if MPI.COMM_WORLD.Get_size() == 1:
        command = [sys.executable, "-m", "mpidp.checkpoint", *args]
        return subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=clean_env())
    from mpidp.checkpoint.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["mpidp.checkpoint.__main__.main", *args], code, out.getvalue(), err.getvalue())


def snapshot(arrays: dict[str, Any]) -> dict[str, bytes]:
    """Return the exact bytes of every array, to prove nothing was modified."""
    out = {}
    for k, v in arrays.items():
        if type(v).__module__.startswith("torch"):
            v = v.detach().cpu().view(-1).view(__import__("torch").uint8).numpy()
        out[k] = np.ascontiguousarray(v).tobytes()
    return out


def load_file(name: str, path: Path) -> ModuleType:
    """Import the script or benchmark at ``path`` as module ``name`` (they are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(module: str, ranks: int, plan: list[tuple[int, list[str]]], folder: Path, timeout: float, **env: str) -> list[dict[str, Any]]:
    """Run ``module.main`` once per ``(n, argv)`` of ``plan``, on the first n ranks of one ``mpiexec -n ranks`` job.

    Returns, per run, ``{"ranks", "argv", "returned": [each rank's value], "printed": [each rank's output]}``
    (tests/examples/sweep.py). One job for many runs: on a 2-core machine starting a job's processes (torch's
    import) costs more than a short run. ``timeout`` bounds the whole job; the job is killed after it.
    """
    plan_path, out_path = folder / "plan.json", folder / "runs.json"
    plan_path.write_text(json.dumps(plan))
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    argv = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(Path(__file__).with_name("examples") / "sweep.py"),
            module, str(plan_path), str(out_path)]
    try:
        p = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=clean_env(MPIDP_TIMEOUT=str(timeout), **env))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module}: {len(plan)} runs at up to {ranks} ranks did not finish in {timeout:g} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    runs: list[dict[str, Any]] = json.loads(out_path.read_text())
    assert [(r["ranks"], r["argv"]) for r in runs] == [(n, list(a)) for n, a in plan], p.stdout
    for r in runs:
        assert len(r["returned"]) == r["ranks"] and len(set(r["returned"])) == 1, r  # every rank of a run, the same
    return runs
