"""The "mpidp" torch.distributed backend: every collective against Gloo's at 1-4 ranks, DDP, errors, the watchdog, the launcher.

Each test starts its own MPI job (serial pass only); the collectives job
answers many questions at once and prints a summary line, read here.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env
from mpi4py import MPI

torch = pytest.importorskip("torch")

SERIAL = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")
HERE = Path(__file__).resolve().parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
#: torchrun's variables: a job of these tests must find them unset and take them from MPI
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job(ranks: int, *argv: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run ``mpiexec -n ranks python argv...`` from this folder: (exit status, stdout and stderr, seconds)."""
    env = {k: v for k, v in clean_env(PYTHONWARNINGS="ignore").items() if k not in TORCHRUN}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    start = time.monotonic()
    p = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, *argv], cwd=HERE, check=False,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env,
    )
    return p.returncode, p.stdout, time.monotonic() - start


@functools.cache
def collectives() -> tuple[int, str, float]:
    return job(4, "-m", "mpi4py", "collectives_job.py", timeout=400)


@SERIAL
@pytest.mark.time_limit(480)  # the watchdog waits past the job's own limit (400 s)
def test_every_collective_gives_glooss_bits_at_1_to_4_ranks_and_errors_agree() -> None:
    rc, out, _ = collectives()
    assert rc == 0, out[-6000:]
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "checks" and last[-2] == "failures", out[-6000:]
    checks, refused, failures = int(last[1]), int(last[3]), int(last[5])
    assert failures == 0, out[-6000:]
    assert checks > 3000 and refused > 0, out[-3000:]  # Gloo refuses some (BAND of floats, AVG of integers): mpidp must too
    for n in (1, 2, 3, 4):
        assert f"all_reduce at {n}:" in out and f"moves at {n}:" in out, out[-3000:]


@SERIAL
def test_a_rank_that_skips_a_collective_is_the_watchdogs_report() -> None:
    rc, out, seconds = job(2, "-m", "mpi4py", "hang_job.py", timeout=90)
    assert rc != 0 and "returned" not in out, out
    assert "mpidp watchdog: rank 0 has waited" in out and "torch.distributed #1: allreduce(SUM, float32, 3 values)" in out, out
    assert seconds < 60, seconds


@SERIAL
def test_an_exception_on_one_rank_under_the_launcher_aborts_the_job() -> None:
    rc, out, seconds = job(2, "-m", "mpidp.torch.run", "torchrun_script.py", "--fail", timeout=90)
    assert rc != 0 and "failing on purpose on rank 1" in out and "aborting the MPI job" in out, out
    assert "argv" not in out and seconds < 60, (seconds, out)


def test_the_launcher_reads_its_flags_then_the_script_or_module(capsys: pytest.CaptureFixture[str]) -> None:
    from mpidp.torch.run import _parse

    assert _parse(["--report", "-m", "pkg.train", "-m", "x"]) == ({"--report"}, "pkg.train", "pkg.train", ["-m", "x"])
    assert _parse(["--no-init", "train.py", "--lr", "1"]) == ({"--no-init"}, None, "train.py", ["--lr", "1"])
    for wrong in ([], ["-m"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as e:
            _parse(wrong)
        assert e.value.code == 2 and "usage: mpiexec -n N python -m mpidp.torch.run" in capsys.readouterr().err
