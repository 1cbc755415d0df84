"""The sharded-optimizer example: one hash at 1 to 5 ranks with --exact, after a resume at another world size too, and 1/N of the optimizer bytes."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_env
from mpi4py import MPI

torch = pytest.importorskip("torch")
from mpidp import checkpoint
from mpidp.examples import sharded

SERIAL = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")


@functools.cache  # the same command, the same output: the uninterrupted runs are shared by the tests
def job(ranks: int, *argv: str) -> tuple[int, str]:
    """Run the example on ``ranks`` ranks: (optimizer bytes per rank, sha256 hex), its last two lines."""
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    p = subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpidp.examples.sharded", *argv],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=clean_env(),
    )
    assert p.returncode == 0, p.stdout
    lines = p.stdout.strip().splitlines()
    assert lines[-2].startswith("optimizer bytes per rank ") and lines[-1].startswith("sha256 "), p.stdout
    assert p.stdout.count("sha256") == 1 and p.stdout.count("sharded: windows") == 1, p.stdout  # rank 0 talks
    digest = lines[-1].split()[1]
    assert len(digest) == 64, p.stdout
    return int(lines[-2].split()[-1]), digest


@SERIAL
def test_exact_hash_is_the_same_at_1_to_5_ranks_and_optimizer_bytes_fall_as_1_over_n() -> None:
    runs = {n: job(n, "--exact", "--steps", "6") for n in (1, 2, 3, 4, 5)}
    assert len({h for _, h in runs.values()}) == 1, runs
    whole = runs[1][0]
    assert whole > 0 and whole % 8 == 0  # AdamW: two float32 moments per trainable element, all on one rank
    for n, (nbytes, _) in runs.items():
        assert nbytes == 8 * (whole // 8 // n), (n, nbytes, whole)  # rank 0 owns T // N of the T elements


@SERIAL
@pytest.mark.parametrize(("saved", "resumed"), [(4, 3), (1, 4), (2, 5)])
def test_a_run_stopped_and_resumed_at_another_world_size_ends_with_the_uninterrupted_hash(tmp_path: Path, saved: int, resumed: int) -> None:
    folder = tmp_path / "ckpt"
    _, uninterrupted = job(1, "--exact", "--steps", "6")
    _, stopped = job(saved, "--exact", "--steps", "6", "--save", str(folder), "--stop-after", "2")
    assert checkpoint.latest(folder) == folder / "window-00000002" and stopped != uninterrupted
    assert job(resumed, "--exact", "--steps", "6", "--resume", str(folder))[1] == uninterrupted


@SERIAL
def test_save_without_stop_after_is_one_error_per_job() -> None:
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    p = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mpidp.examples.sharded", "--save", "nowhere"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=clean_env(),
    )
    assert p.returncode == 2 and p.stdout.count("--save and --stop-after go together") == 1, p.stdout
    assert not Path("nowhere").exists()


@pytest.fixture
def folder(comm: MPI.Comm) -> Iterator[Path]:
    name = Path(comm.bcast(tempfile.mkdtemp(prefix="mpidp-sharded-") if comm.rank == 0 else None))
    yield name
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(name, ignore_errors=True)


def test_in_process_at_this_world_size_as_on_one_rank(comm: MPI.Comm, folder: Path) -> None:
    """In the test command's every pass (1 and 4 ranks, 2 simulated hosts): this world's hash is a 1-rank run's, resumed too."""
    threads = torch.get_num_threads()
    try:
        whole = sharded.main(["--exact", "--steps", "3"], comm)
        assert sharded.main(["--exact", "--steps", "3"], MPI.COMM_SELF) == whole  # every rank alone, the same bits
        sharded.main(["--exact", "--steps", "3", "--save", str(folder), "--stop-after", "1"], comm)
        assert sharded.main(["--exact", "--steps", "3", "--resume", str(folder)], MPI.COMM_SELF) == whole  # N -> 1
        assert sharded.main(["--steps", "3"], comm) != whole  # the float32 path: other bits
    finally:
        torch.set_num_threads(threads)
