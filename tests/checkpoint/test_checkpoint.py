"""Checkpoints (mpidp.checkpoint): each rank writes its share, any world size loads, complete or absent, errors everywhere."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import checkpoint_cli, clean_env, first_ranks, same_error_everywhere, snapshot
from mpi4py import MPI
from replicas import model

import mpidp
from mpidp import ContractError, checkpoint
from mpidp.checkpoint import files


def digest(params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


def session(comm: MPI.Comm, seed: int) -> tuple[Any, dict[str, Any]]:
    params = model(seed)
    return mpidp.DataParallel.initialize(params, comm, frozen=["frozen"]), params


def test_save_then_load_gives_the_same_bytes_and_extras(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 1)
    want = digest(params)
    rng = np.random.default_rng(5).bit_generator.state
    path = checkpoint.save(dp, folder, params, extras={"position": 17, "rng": rng, "seen": np.arange(5, dtype=np.int64)}, tag="first")
    assert path == folder / "first" and checkpoint.latest(folder) == path
    assert sorted(p.name for p in path.iterdir()) == sorted([files.MANIFEST] + [files.rank_file(r, comm.size) for r in range(comm.size)])
    for v in params.values():
        v[...] = 0
    extras = checkpoint.load(dp, folder, params)
    assert digest(params) == want
    assert params["embed"] is params["head"]  # ties stay ties
    assert extras["position"] == 17 and extras["rng"] == rng and extras["seen"].tolist() == [0, 1, 2, 3, 4]
    dp.close()


def test_every_rank_writes_only_its_share(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 2)
    path = checkpoint.save(dp, folder, params, tag="t")
    sizes = [(path / files.rank_file(r, comm.size)).stat().st_size for r in range(comm.size)]
    total = sum(v.nbytes for k, v in params.items() if k != "head")
    assert max(sizes) < total / comm.size + 16 * 1024, sizes  # a share of the bytes plus headers: nothing gathered on one rank
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_loads_at_every_smaller_world_size(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 3)
    want = digest(params)
    checkpoint.save(dp, folder, params)
    dp.close()
    for n in range(1, comm.size):
        with first_ranks(comm, n) as sub:
            if sub is not None:
                small, mine = session(sub, 100 + n)
                assert digest(mine) != want
                checkpoint.load(small, folder, mine)
                assert digest(mine) == want, n
                small.close()


def test_a_checkpoint_of_another_model_is_one_error_and_touches_nothing(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 4)
    checkpoint.save(dp, folder, params, tag="a")
    dp.close()
    other = model(4)
    other["bias"] = np.zeros(8, np.float32)
    dp2 = mpidp.DataParallel.initialize(other, comm, frozen=["frozen"])
    before = snapshot(other)
    message = same_error_everywhere(comm, lambda: checkpoint.load(dp2, folder, other), ContractError, "manifest.json", "'param/bias'", "[7]", "[8]")
    assert "float32" in message
    assert snapshot(other) == before
    renamed = {("bias2" if k == "bias" else k): v for k, v in model(4).items()}
    dp3 = mpidp.DataParallel.initialize(renamed, comm, frozen=["frozen"])
    same_error_everywhere(comm, lambda: checkpoint.load(dp3, folder, renamed), ContractError, "another model", "'bias'")
    dp2.close()
    dp3.close()


def test_a_truncated_file_is_one_error_naming_it(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 6)
    path = checkpoint.save(dp, folder, params)
    comm.Barrier()
    victim = path / files.rank_file(comm.size - 1, comm.size)
    if comm.rank == 0:
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    comm.Barrier()
    before = snapshot(params)
    same_error_everywhere(comm, lambda: checkpoint.load(dp, folder, params), ContractError, str(victim), "truncated")
    assert snapshot(params) == before
    dp.close()


def test_no_checkpoint_is_one_error(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 7)
    same_error_everywhere(comm, lambda: checkpoint.load(dp, folder / "nothing", params), ContractError, "nothing", "neither a checkpoint")
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_ranks_saving_into_different_folders_is_one_error(comm: MPI.Comm, folder: Path) -> None:
    dp, params = session(comm, 8)
    tag = "x" if comm.rank == 0 else "y"
    same_error_everywhere(comm, lambda: checkpoint.save(dp, folder, params, tag=tag), ContractError, "different folders or tags")
    bad = {"position": object()} if comm.rank == comm.size - 1 else {}
    same_error_everywhere(comm, lambda: checkpoint.save(dp, folder, params, extras=bad), ContractError, f"rank {comm.size - 1}:", "JSON")
    assert checkpoint.latest(folder) is None
    dp.close()


def test_a_stop_signal_on_one_rank_stops_every_rank(comm: MPI.Comm) -> None:
    dp, _ = session(comm, 9)
    with checkpoint.StopSignal(dp) as stop:
        assert stop.requested() is False
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() is True  # on every rank, after the same window
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    dp.close()


def test_export_writes_one_plain_file(comm: MPI.Comm, folder: Path) -> None:
    from safetensors.numpy import load_file

    dp, params = session(comm, 10)
    path = checkpoint.save(dp, folder, params)
    dp.close()
    if comm.rank == 0:
        out = folder / "model.safetensors"
        done = checkpoint_cli("export", str(folder), str(out))
        assert done.returncode == 0, done.stderr
        plain = load_file(str(out))
        assert sorted(plain) == sorted(params)
        assert all(plain[k].tobytes() == params[k].tobytes() and plain[k].dtype == params[k].dtype for k in params)
        info = checkpoint_cli("info", str(path))
        assert f"written by {comm.size} ranks" in info.stdout, info


KILLED = textwrap.dedent(
    """
    import os, sys
    from mpi4py import MPI
    import numpy as np
    import mpidp
    from mpidp import checkpoint
    from mpidp.checkpoint import files
    comm = MPI.COMM_WORLD
    params = {"w": np.full(1000, comm.rank + 1.0, np.float32)}
    dp = mpidp.DataParallel.initialize(params, comm)
    checkpoint.save(dp, sys.argv[1], params, tag="good")
    params["w"][...] = 7
    write = files.write_rank_file
    def dying(path, pieces, tensors):
        write(path, pieces, tensors)
        if comm.rank == 1:
            os._exit(9)  # killed after writing its file, before the others published
    files.write_rank_file = dying
    checkpoint.save(dp, sys.argv[1], params, tag="bad")
    """
)


@pytest.mark.mpi_skip()
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    folder = tmp_path / "ckpt"
    mpiexec = Path(sys.executable).parent / "mpiexec"
    done = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", str(script), str(folder)],
        check=False, capture_output=True, text=True, timeout=120, env=clean_env(MPIDP_TIMEOUT="60"),
    )
    assert done.returncode != 0, done.stdout
    assert checkpoint.latest(folder) == folder / "good"
    assert not (folder / "bad").exists()
    assert (checkpoint.consolidate(folder / "good")["w"] == 1.0).all()  # root's values, broadcast at initialize


# ------------------------------------------------------------- a sharded optimizer

SHARDED = {"a": (1,), "b": (7,), "c": (33, 3), "d": (10007,)}


def sharded_run(comm: MPI.Comm, windows: range, folder: Path | None = None, resume: Path | None = None) -> str:
    """Exact windows with the sharded AdamW (clipped); save after them or resume before them; the parameters' SHA-256."""
    from mpidp import optim

    rng = np.random.default_rng(1)
    p = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHARDED.items()}
    p["h"] = rng.standard_normal(65).astype(model(0)["brain"].dtype)  # bfloat16: a float32 master on its owner
    groups = [{"params": ["a", "c", "d", "h"]}, {"params": ["b"], "weight_decay": 0.0}]
    with mpidp.DataParallel.initialize(p, comm, exact=True) as dp:
        opt = optim.AdamW(dp, groups, lr=1e-2, weight_decay=0.1)
        if resume is not None:
            assert checkpoint.load(dp, resume, p, optimizer=opt)["next"] == windows.start
        for s in windows:
            weight = 0
            for i in mpidp.shard(5, dp.rank, dp.world_size):
                g = np.random.default_rng(1000 * s + i)
                dp.fold({k: (g.standard_normal(v.shape) * (i + 1)).astype(v.dtype) for k, v in p.items()})
                weight += i % 3 + 1
            opt.step({}, weight, step=s, max_norm=2.0)
        if folder is not None:
            path = checkpoint.save(dp, folder, p, optimizer=opt, extras={"next": windows.stop})
            mine = sum(a.nbytes for d in opt.state_pieces().values() for a in d.values())
            size = sum(f.stat().st_size for f in path.glob("rank-*.safetensors"))
            assert mine < size  # each rank wrote its own slices (and a share of the parameters)
    return digest(p)


@pytest.mark.mpi(min_size=2)
def test_a_sharded_optimizer_resumes_at_every_world_size_with_the_same_bits(comm: MPI.Comm, folder: Path) -> None:
    expected = sharded_run(MPI.COMM_SELF, range(4))
    assert sharded_run(comm, range(2), folder=folder) != expected  # stopped after 2 windows at N ranks
    for n in range(1, comm.size):
        with first_ranks(comm, n) as sub:
            if sub is not None:
                assert sharded_run(sub, range(2, 4), resume=folder) == expected, f"{comm.size} -> {n}"


@pytest.mark.mpi(min_size=2)
def test_a_save_in_one_session_while_the_others_reduce_another_is_one_error(comm: MPI.Comm, folder: Path) -> None:
    from replicas import ZERO, grads_for

    dp1, p1 = session(comm, 11)
    dp2, p2 = session(comm, 12)
    before = snapshot(p2)
    if comm.rank == 0:
        same_error_everywhere(comm, lambda: checkpoint.save(dp1, folder, p1), ContractError, "different mpidp sessions")
    else:
        g = grads_for(p2, np.random.default_rng(comm.rank))
        same_error_everywhere(comm, lambda: dp2.reduce(g, 1, ZERO), ContractError, "different mpidp sessions")
    assert snapshot(p2) == before and checkpoint.latest(folder) is None
    dp2.close()
    dp1.close()
