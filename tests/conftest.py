"""Shared test set-up: a per-test watchdog and helpers for collective assertions.

Every test runs under a faulthandler watchdog: a test that deadlocks dumps
every thread's stack (to a duplicate of stderr taken before pytest's capture)
and exits the process, so under ``mpiexec`` the job ends instead of hanging.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import shutil
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

#: seconds one test may run before its stacks are dumped and the process exits
TEST_TIMEOUT = float(os.environ.get("MPIDP_TEST_TIMEOUT", "120"))
_stderr = None


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    _stderr = os.fdopen(os.dup(2), "w")
    if MPI.COMM_WORLD.Get_size() > 1 and MPI.COMM_WORLD.Get_rank() > 0:
        config.option.verbose = -2  # one report is enough; failures still print


@pytest.fixture(autouse=True)
def _watchdog() -> Any:
    faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True, file=_stderr)
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
    """Return os.environ without the launcher's variables, for a subprocess that starts its own MPI job."""
    prefixes = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_", "OMPI_", "PRTE_", "MPIR_CVAR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


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
