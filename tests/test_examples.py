"""The shipped examples run and learn (in-process, on whatever world pytest runs in), and talk once per job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env
from mpi4py import MPI

from mpidp.examples import logreg


def test_logreg_learns() -> None:
    loss = logreg.main(["--steps", "60"])
    assert loss < 0.45  # the untrained loss is about 2


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")
@pytest.mark.parametrize(("argv", "status", "printed"), [(["--help"], 0, "usage:"), (["--steps", "x"], 2, "error:")])
def test_argparse_output_is_printed_once_per_job(argv: list[str], status: int, printed: str) -> None:
    """--help and argument errors: printed by one rank, not by each of the 3; every rank stops."""
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    p = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "mpidp.examples.logreg", *argv],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, env=clean_env(),
    )
    assert p.returncode == status, p.stdout
    assert p.stdout.count(printed) == 1 and p.stdout.count("usage:") == 1, p.stdout
    assert "step" not in p.stdout.replace("--steps", "").replace("STEPS", ""), p.stdout  # nobody trained


def _reproducible(ranks: int, *argv: str) -> str:
    """Run mpidp.examples.reproducible on ``ranks`` ranks; the hex of its last line, ``sha256 <hex>``."""
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    p = subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpidp.examples.reproducible", *argv],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=clean_env(),
    )
    assert p.returncode == 0, p.stdout
    last = p.stdout.strip().splitlines()[-1].split()
    assert last[0] == "sha256" and len(last[1]) == 64, p.stdout
    return last[1]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")
def test_reproducible_prints_one_hash_at_every_world_size_and_after_a_resume(tmp_path: Path) -> None:
    """1 to 4 ranks, the same bits; stopped at 4 ranks and resumed at 3, the same bits; another K, others."""
    hashes = {n: _reproducible(n, "--steps", "2") for n in (1, 2, 3, 4)}
    assert len(set(hashes.values())) == 1, hashes
    _reproducible(4, "--steps", "1", "--save", str(tmp_path / "ckpt"))  # each rank writes its share (mpidp.checkpoint)
    assert _reproducible(3, "--steps", "2", "--resume", str(tmp_path / "ckpt")) == hashes[1]
    assert _reproducible(1, "--steps", "3") != hashes[1]
    # issue 33 item 6: the same with overlap, buckets summed as integers during the last backward
    assert _reproducible(3, "--steps", "2", "--overlap", "thread") == hashes[1]
    assert _reproducible(2, "--steps", "2", "--overlap", "hooks") == hashes[1]
