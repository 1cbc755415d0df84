"""The sharded-optimizer example: one hash at 1 to 5 ranks with --exact, after a resume at another world size too, and 1/N of the optimizer bytes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env, sweep
from mpi4py import MPI

torch = pytest.importorskip("torch")
from mpidp import checkpoint
from mpidp.examples import sharded

SERIAL = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI jobs")


#: (saved at, resumed at) world sizes
RESUMES = [(4, 3), (1, 4), (2, 5)]
Runs = dict[tuple[Any, ...], tuple[int, str]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    """Every run the tests below read, in one 5-rank job (tests/examples/sweep.py), and the folder of their checkpoints.

    ``("whole", n)``: 6 windows on n ranks; ``("saved", a, b)``: stopped after 2 windows on a ranks;
    ``("resumed", a, b)``: that one resumed on b ranks; each -> (optimizer bytes per rank, sha256 hex).
    Set up before the per-test watchdog (a module fixture); the job has its own time limit.
    """
    folder = tmp_path_factory.mktemp("sharded")
    keys: list[tuple[Any, ...]] = [("whole", n) for n in (1, 2, 3, 4, 5)]
    plan: list[tuple[int, list[str]]] = [(n, ["--exact", "--steps", "6"]) for n in (1, 2, 3, 4, 5)]
    for a, b in RESUMES:
        ckpt = str(folder / f"ckpt-{a}-{b}")
        keys += [("saved", a, b), ("resumed", a, b)]
        plan += [(a, ["--exact", "--steps", "6", "--save", ckpt, "--stop-after", "2"]), (b, ["--exact", "--steps", "6", "--resume", ckpt])]
    out = {}
    for key, r in zip(keys, sweep("mpidp.examples.sharded", 5, plan, folder, timeout=600)):
        printed = "".join(r["printed"])
        lines = r["printed"][0].strip().splitlines()  # rank 0 talks, once
        assert lines[-2].startswith("optimizer bytes per rank ") and lines[-1].startswith("sha256 "), printed
        assert printed.count("sha256") == 1 and printed.count("sharded: windows") == 1, printed
        digest = lines[-1].split()[1]
        assert len(digest) == 64 and digest == r["returned"][0], printed
        out[key] = (int(lines[-2].split()[-1]), digest)
    return out, folder


@SERIAL
def test_exact_hash_is_the_same_at_1_to_5_ranks_and_optimizer_bytes_fall_as_1_over_n(runs: tuple[Runs, Path]) -> None:
    whole_runs = {n: runs[0]["whole", n] for n in (1, 2, 3, 4, 5)}
    assert len({h for _, h in whole_runs.values()}) == 1, whole_runs
    whole = whole_runs[1][0]
    assert whole > 0 and whole % 8 == 0  # AdamW: two float32 moments per trainable element, all on one rank
    for n, (nbytes, _) in whole_runs.items():
        assert nbytes == 8 * (whole // 8 // n), (n, nbytes, whole)  # rank 0 owns T // N of the T elements


@SERIAL
@pytest.mark.parametrize(("saved", "resumed"), RESUMES)
def test_a_run_stopped_and_resumed_at_another_world_size_ends_with_the_uninterrupted_hash(runs: tuple[Runs, Path], saved: int, resumed: int) -> None:
    done, folder = runs
    uninterrupted, stopped, after = (done[key][1] for key in (("whole", 1), ("saved", saved, resumed), ("resumed", saved, resumed)))
    ckpt = folder / f"ckpt-{saved}-{resumed}"
    assert checkpoint.latest(ckpt) == ckpt / "window-00000002" and stopped != uninterrupted
    assert after == uninterrupted


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
    """In the serial and the 4-rank pass: this world's hash is a 1-rank run's, resumed too."""
    threads = torch.get_num_threads()
    try:
        whole = sharded.main(["--exact", "--steps", "3"], comm)
        assert sharded.main(["--exact", "--steps", "3"], MPI.COMM_SELF) == whole  # every rank alone, the same bits
        sharded.main(["--exact", "--steps", "3", "--save", str(folder), "--stop-after", "1"], comm)
        assert sharded.main(["--exact", "--steps", "3", "--resume", str(folder)], MPI.COMM_SELF) == whole  # N -> 1
        assert sharded.main(["--steps", "3"], comm) != whole  # the float32 path: other bits
    finally:
        torch.set_num_threads(threads)
