"""The shipped examples run and learn (in-process, on whatever world pytest runs in), and talk once per job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, sweep
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


def _cli_hash(p: subprocess.CompletedProcess[str]) -> str:
    """The hex of a job's last line, ``sha256 <hex>``, printed once (by rank 0)."""
    assert p.returncode == 0, p.stdout
    last = p.stdout.strip().splitlines()[-1].split()
    assert last[0] == "sha256" and len(last[1]) == 64 and p.stdout.count("sha256") == 1, p.stdout
    return last[1]


@pytest.fixture(scope="module")
def reproducible(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The hashes of the runs below, in one 4-rank job (tests/examples/sweep.py: each run on the first n ranks).

    Set up before the per-test watchdog (a module fixture); the job has its own time limit.
    """
    folder = tmp_path_factory.mktemp("reproducible")
    ckpt = str(folder / "ckpt")
    other = str(folder / "ckpt-3")
    plan = [(n, ["--steps", "2"]) for n in (1, 2, 3, 4)] + [
        (4, ["--steps", "1", "--save", ckpt]),  # each rank writes its share (mpidp.checkpoint)
        (3, ["--steps", "2", "--resume", ckpt]),
        (1, ["--steps", "3"]),
        # issue 33 item 6: the same with overlap, buckets summed as integers during the last backward
        (3, ["--steps", "2", "--overlap", "thread"]),
        (2, ["--steps", "2", "--overlap", "hooks"]),
        # saved by 3 ranks, resumed by the command itself (a run on the whole world is `python -m ...`'s main(argv))
        (3, ["--steps", "1", "--save", other]),
        (4, ["--steps", "2", "--resume", other]),
    ]
    runs = sweep("mpidp.examples.reproducible", 4, plan, folder, timeout=420)
    for r in runs:  # rank 0 prints, once: a summary, then the hash it returned
        printed = "".join(r["printed"])
        assert printed.count("sha256") == 1 and r["printed"][0].strip().splitlines()[-1] == f"sha256 {r['returned'][0]}", r
    return [r["returned"][0] for r in runs]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")
def test_reproducible_prints_one_hash_at_every_world_size_and_after_a_resume(reproducible: list[str]) -> None:
    """1 to 4 ranks, the same bits; stopped at 4 ranks and resumed at 3, stopped at 3 and resumed by the command at 4,
    the same bits; another K, others."""
    hashes = reproducible
    assert len(set(hashes[:4])) == 1, hashes
    assert hashes[5] == hashes[0] and hashes[6] != hashes[0]
    assert hashes[7] == hashes[8] == hashes[0]
    assert hashes[10] == hashes[0], hashes  # the command itself, at another world size than the checkpoint's
