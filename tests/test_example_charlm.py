"""The character LM example learns, resumes exactly from per-rank checkpoints, and runs under mpiexec."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import clean_env, snapshot
from mpi4py import MPI

pytest.importorskip("torch")
from mpidp.examples import charlm


def test_charlm_learns(comm: MPI.Comm) -> None:
    summary = charlm.main(["--steps", "60"])
    assert summary.steps == 60 and summary.tokens > 0
    assert summary.loss < math.log(charlm.VOCAB) - 0.5, summary.loss  # the uniform guess is log(30) = 3.4


def test_charlm_resumes_exactly_where_it_stopped(comm: MPI.Comm) -> None:
    folder = Path(comm.bcast(tempfile.mkdtemp(prefix="mpidp-charlm-") if comm.rank == 0 else None))
    try:
        whole = charlm.main(["--steps", "8"])
        first = charlm.main(["--steps", "4", "--save", str(folder)])
        assert (folder / f"rank{comm.rank}.pt").exists()
        rest = charlm.main(["--steps", "8", "--resume", str(folder)])
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    assert (first.steps, rest.steps) == (4, 4)
    assert first.tokens + rest.tokens == whole.tokens  # each rank's data generator continued
    # model and optimizer state continued: bitwise the run that never stopped
    assert snapshot(dict(rest.model.state_dict())) == snapshot(dict(whole.model.state_dict()))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")
def test_charlm_runs_under_mpiexec() -> None:
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    p = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mpidp.examples.charlm", "--steps", "6"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=clean_env(),
    )
    assert p.returncode == 0, p.stdout
    assert "charlm: 6 steps on 2 ranks" in p.stdout and "replicas bitwise equal" in p.stdout, p.stdout
