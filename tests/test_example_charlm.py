"""The character LM example learns, resumes exactly from its checkpoints (at any world size, on a stop signal), and runs under mpiexec."""

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
from mpidp import checkpoint
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
        assert checkpoint.latest(folder) == folder / "step-00000004"
        rest = charlm.main(["--steps", "8", "--resume", str(folder)])
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    assert (first.steps, rest.steps) == (4, 4)
    assert first.tokens + rest.tokens == whole.tokens  # each step's data is the same
    # model and optimizer state continued: bitwise the run that never stopped
    assert snapshot(dict(rest.model.state_dict())) == snapshot(dict(whole.model.state_dict()))


SIGNALLED = """
import os, signal, sys
from mpi4py import MPI
from mpidp.checkpoint import stop
from mpidp.examples import charlm

comm, asked = MPI.COMM_WORLD, stop.StopSignal.requested
def requested(self, calls=[0]):
    calls[0] += 1
    if calls[0] == 5 and comm.rank == comm.size - 1:  # the batch system warns one rank, in the middle of step 5
        os.kill(os.getpid(), signal.SIGUSR1)
    return asked(self)
stop.StopSignal.requested = requested
charlm.main(sys.argv[1:])
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")
def test_a_signal_to_one_rank_saves_every_rank_and_another_world_size_resumes(tmp_path: Path) -> None:
    """Also the example's command under mpiexec: the resumed job is ``python -m mpi4py -m mpidp.examples.charlm``."""
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    script, folder = tmp_path / "signalled.py", tmp_path / "ckpt"
    script.write_text(SIGNALLED)

    def job(ranks: int, *args: str) -> str:
        p = subprocess.run(
            [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", *args, "--context", "32"],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=clean_env(MPIDP_TIMEOUT="120"),
        )
        assert p.returncode == 0, p.stdout
        return p.stdout

    out = job(2, str(script), "--steps", "1000", "--save", str(folder))
    assert "stop requested: saving at step 5" in out and "charlm: 5 steps on 2 ranks" in out, out
    assert checkpoint.latest(folder) == folder / "step-00000005"
    out = job(3, "-m", "mpidp.examples.charlm", "--steps", "8", "--resume", str(folder), "--save", str(folder))
    assert "charlm: 3 steps on 3 ranks" in out and out.count("replicas bitwise equal") == 1, out
    assert checkpoint.latest(folder) == folder / "step-00000008"
