"""A training state users can trust: schedules resume, tags never repeat, crashes, damage, mixes and escapes are refused.

Every refusal is one ContractError on every rank, and a refused load changes
nothing (digests before and after); ``python -m mpidp.checkpoint`` answers a
bad checkpoint with a message and exit 2, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import checkpoint_cli, clean_env, first_ranks, same_error_everywhere
from mpi4py import MPI

torch = pytest.importorskip("torch")

from test_torch_checkpoint import step as window_step
from test_torch_checkpoint import window

import mpidp.torch
from mpidp import ContractError, checkpoint
from mpidp.checkpoint import collective, files
from mpidp.examples.charlm import CharLM, Language
from mpidp.torch.optim import ShardedOptimizer

COUNT = 4  # micro-batches per window


def digest(model: Any, opt: Any = None) -> str:
    """The parameters' and buffers' bytes, and an optimizer's state and hyperparameters where given."""
    h = hashlib.sha256(b"".join(v.detach().numpy().tobytes() for _, v in sorted(model.state_dict().items())))
    if isinstance(opt, ShardedOptimizer):
        h.update(json.dumps(opt.describe(), sort_keys=True).encode())
        for name, pieces in sorted(opt.sharded.state_pieces().items()):
            h.update(name.encode() + b"".join(np.ascontiguousarray(v).tobytes() for _, v in sorted(pieces.items())))
    return h.hexdigest()


def lm() -> Any:
    torch.manual_seed(0)
    return CharLM(dim=16, layers=1, heads=2, context=24)


def scheduled(comm: MPI.Comm, steps: range, sharded: bool, save: Path | None = None, resume: Path | None = None) -> str:
    """An exact run with a LambdaLR in the usual order (step, sched.step, save); its parameters' hash."""
    model, lang = lm(), Language()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mpidp.torch.DataParallel(model, comm, exact=True) as dp:
            opt = mpidp.torch.ShardedAdamW(dp, lr=1e-2) if sharded else torch.optim.AdamW(model.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            if resume is not None:
                extras = dp.load_checkpoint(resume, opt)
                sched.load_state_dict(extras["scheduler"])
                assert extras["next"] == steps.start
            for s in steps:
                window_step(dp, opt, window(dp, s, model, lang, COUNT), sharded)
                sched.step()
                dp.zero_grad()
            if save is not None:
                path = dp.save_checkpoint(save, opt, extras={"next": steps.stop, "scheduler": sched.state_dict()})
                saved = json.loads((path / files.MANIFEST).read_text())["optimizer"]["description"]
                groups = saved["groups"] if sharded else saved["param_groups"]
                assert groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + steps.stop))  # the next step's rate
    finally:
        torch.set_num_threads(threads)
    return digest(model)


@pytest.mark.parametrize("sharded", [True, False])
def test_a_scheduled_lr_resumes_at_another_world_size_with_the_uninterrupted_hash(comm: MPI.Comm, folder: Path, sharded: bool) -> None:
    expected = scheduled(MPI.COMM_SELF, range(3), sharded)
    scheduled(comm, range(2), sharded, save=folder)
    with first_ranks(comm, max(1, comm.size - 1)) as sub:
        if sub is not None:
            assert scheduled(sub, range(2, 3), sharded, resume=folder) == expected


def small(comm: MPI.Comm, seed: int = 0) -> tuple[Any, Any, Any]:
    """A model with a BatchNorm, its session and a sharded AdamW after one window."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    dp = mpidp.torch.DataParallel(model, comm)
    opt = mpidp.torch.ShardedAdamW(dp, lr=1e-2)
    train(dp, opt, model, 0)
    return model, dp, opt


def train(dp: Any, opt: Any, model: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step * 100 + dp.rank)
    model(torch.randn(8, 4, generator=g)).square().sum().backward()
    opt.step(local_weight=8)
    dp.zero_grad()


def test_a_resumed_run_counts_its_windows_on_and_never_reuses_a_tag(comm: MPI.Comm, folder: Path) -> None:
    model, dp, opt = small(comm)
    for step in (1, 2):
        train(dp, opt, model, step)
    first = dp.save_checkpoint(folder, opt)
    assert first.name == "window-000000003"
    dp.close()
    model, dp, opt = small(comm, seed=1)  # a new job: its own first window, then the load
    dp.load_checkpoint(folder, opt)
    assert dp.session.window == 3
    train(dp, opt, model, 3)
    second = dp.save_checkpoint(folder, opt)
    assert second.name == "window-000000004" and first.is_dir() and checkpoint.latest(folder) == second
    same_error_everywhere(comm, lambda: dp.save_checkpoint(folder, opt), ContractError, "window-000000004 exists", "replace=True")
    train(dp, opt, model, 4)
    dp.broadcast_buffers()  # root's buffers are what a checkpoint holds
    want = digest(model, opt)
    assert dp.save_checkpoint(folder, opt, tag=second.name, replace=True) == second
    train(dp, opt, model, 5)
    dp.load_checkpoint(str(folder), opt)  # the replaced one, by a str path
    assert digest(model, opt) == want
    dp.close()


class Killed(BaseException):
    """The root dies here: nothing after this step of the publish runs."""


@pytest.mark.parametrize("step", collective.PUBLISH)
def test_a_root_killed_at_each_step_of_a_replacing_publish_leaves_latest_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """A world of one per rank (a publish is the root's alone): replace tag 'b' and die after ``step``."""
    params = {"w": np.zeros(16, np.float32)}
    with mpidp.DataParallel.initialize(params, MPI.COMM_SELF) as dp:
        checkpoint.save(dp, tmp_path, params, tag="a")
        params["w"][:] = 1
        checkpoint.save(dp, tmp_path, params, tag="b")
        params["w"][:] = 2

        def die(at: str) -> None:
            if at == step:
                raise Killed

        monkeypatch.setattr(collective, "published", die)
        with pytest.raises(Killed):
            checkpoint.save(dp, tmp_path, params, tag="b", replace=True)
        monkeypatch.undo()
    found = checkpoint.latest(tmp_path)
    assert found is not None and (found / files.MANIFEST).is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert checkpoint.consolidate(tmp_path)["w"][0] in (1, 2)  # the old 'b' or the new one, whole
    params = {"w": np.zeros(16, np.float32)}
    with mpidp.DataParallel.initialize(params, MPI.COMM_SELF) as dp:
        checkpoint.load(dp, tmp_path, params)
        assert params["w"][0] in (1, 2)
        checkpoint.save(dp, tmp_path, params, tag="c")  # the next save finishes the interrupted publish
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "latest"]
    assert checkpoint.consolidate(tmp_path / "b")["w"][0] == 2  # complete before the root died: the new one


def damage(path: Path, how: str, other: Path) -> str:
    """Damage one rank file of the checkpoint at ``path`` (the root's part); the file's name."""
    name = files.rank_file(0, len(list(path.glob("rank-*"))))
    f = path / name
    if how == "flip":
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x10  # tensor data, not the header
        f.write_bytes(bytes(data))
    elif how == "nan":  # a NaN over the first value of exp_avg_sq the file holds
        manifest = json.loads((path / files.MANIFEST).read_text())
        key = next(k for k in manifest["tensors"] if k.startswith("state/exp_avg_sq/"))
        header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        entry = json.loads(f.read_bytes()[8:header])
        start = header + next(v["data_offsets"][0] for k, v in entry.items() if k.startswith(key + "@"))
        data = bytearray(f.read_bytes())
        data[start : start + 4] = np.float32(np.nan).tobytes()
        f.write_bytes(bytes(data))
    else:  # the same-named file of another checkpoint of the same shapes
        f.write_bytes((other / name).read_bytes())
    return name


@pytest.mark.parametrize("how", ["flip", "nan", "mixed"])
def test_damaged_or_mixed_files_are_one_error_and_load_nothing(comm: MPI.Comm, folder: Path, how: str) -> None:
    model, dp, opt = small(comm)
    path = dp.save_checkpoint(folder, opt, tag="one")
    train(dp, opt, model, 1)
    other = dp.save_checkpoint(folder, opt, tag="two")
    name = damage(path, how, other) if comm.rank == 0 else ""
    name = comm.bcast(name)
    before = digest(model, opt)
    same_error_everywhere(comm, lambda: dp.load_checkpoint(path, opt), ContractError, name)
    assert digest(model, opt) == before
    dp.close()


def test_names_that_leave_the_folder_are_refused_before_anything_is_opened(comm: MPI.Comm, folder: Path) -> None:
    model, dp, opt = small(comm)
    path = dp.save_checkpoint(folder, opt, tag="one")
    secret = folder / "secret.bin"
    if comm.rank == 0:
        secret.write_bytes(b"x" * 12345)
        manifest = json.loads((path / files.MANIFEST).read_text())
        manifest["files"][0] = "../secret.bin"
        (path / files.MANIFEST).write_text(json.dumps(manifest))
        (folder / "latest").write_text("../one\n")
    comm.Barrier()
    before = digest(model, opt)
    message = same_error_everywhere(comm, lambda: dp.load_checkpoint(path, opt), ContractError, "field 'files'")
    assert "12345" not in message
    same_error_everywhere(comm, lambda: dp.load_checkpoint(folder, opt), ContractError, "not a plain name")
    assert digest(model, opt) == before
    if comm.rank == 0:
        for args in (["info", str(path)], ["export", str(path), str(folder / "out.safetensors")], ["export", str(folder), str(folder / "o")]):
            done = checkpoint_cli(*args)
            assert done.returncode == 2 and "Traceback" not in done.stderr and "12345" not in done.stderr, done.stderr
        with pytest.raises(ValueError, match="field 'files'"):
            checkpoint.consolidate(str(path))
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_resolve_different_checkpoints_raise_everywhere(comm: MPI.Comm, folder: Path) -> None:
    model, dp, opt = small(comm)
    dp.save_checkpoint(folder, opt, tag="one")
    train(dp, opt, model, 1)
    dp.save_checkpoint(folder, opt, tag="two")
    before = digest(model, opt)
    mine = folder / ("one" if comm.rank == 0 else "two")
    same_error_everywhere(comm, lambda: dp.load_checkpoint(mine, opt), ContractError, "resolved another checkpoint")
    assert digest(model, opt) == before
    dp.close()


def test_a_refused_load_changes_nothing(comm: MPI.Comm, folder: Path) -> None:
    model, dp, opt = small(comm)
    path = dp.save_checkpoint(folder, opt, tag="one")
    train(dp, opt, model, 1)
    with torch.no_grad():
        model[1].running_mean.fill_(7.0)  # a buffer a refused load must not overwrite
    opt.param_groups[0]["lr"] = 0.5
    before = digest(model, opt)
    other = mpidp.torch.ShardedAdamW(dp, [{"params": [model[0].weight]}, {"params": [p for n, p in model.named_parameters() if n != "0.weight"]}])
    same_error_everywhere(comm, lambda: dp.load_checkpoint(path, other), ContractError, "optimizer differs")
    assert digest(model, opt) == before
    manifest = json.loads((path / files.MANIFEST).read_text())
    comm.Barrier()
    for edit, field in ((lambda m: m["optimizer"]["description"]["groups"][0].update(step="3"), "step counts"),
                        (lambda m: m.pop("tensors"), "field 'tensors' is missing"),
                        (lambda m: m["tensors"]["param/0.weight"].update(shape=[1 << 40, 1 << 20]), "param/0.weight")):
        if comm.rank == 0:
            broken = json.loads(json.dumps(manifest))
            edit(broken)
            (path / files.MANIFEST).write_text(json.dumps(broken))
        comm.Barrier()
        same_error_everywhere(comm, lambda: dp.load_checkpoint(path, opt), ContractError, field)
        assert digest(model, opt) == before
        if comm.rank == 0:
            done = checkpoint_cli("export", str(path), str(folder / "o"))
            assert done.returncode == (0 if field == "step counts" else 2) and "Traceback" not in done.stderr, done.stderr  # export reads no optimizer
        comm.Barrier()
    dp.close()


def test_reduce_before_a_sharded_step_and_edits_of_grad_are_one_error(comm: MPI.Comm) -> None:
    model, dp, opt = small(comm)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(dp.rank))
    model(x).square().sum().backward()
    dp.reduce(local_weight=8)
    before = digest(model, opt)
    same_error_everywhere(comm, lambda: opt.step(local_weight=8), ContractError, "dp.reduce and a sharded step in one window")
    assert digest(model, opt) == before
    opt.zero_grad()  # torch's: set_to_none
    model(x).square().sum().backward()
    if comm.rank == comm.size - 1:  # nanoGPT's order, its GradScaler disabled (float32, bfloat16): unscale_ does nothing
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = digest(model, opt)
    same_error_everywhere(comm, lambda: opt.step(local_weight=8), ContractError, "changed between backward and the sharded step", "max_norm=")
    assert digest(model, opt) == before
    dp.zero_grad()
    model(x).square().sum().backward()
    before = digest(model, opt)
    opt.step(local_weight=8, max_norm=1.0)  # the way to clip: no error
    assert digest(model, opt) != before
    dp.close()


def test_an_exact_checkpoint_loaded_without_exact_warns_on_the_root(comm: MPI.Comm, folder: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with mpidp.torch.DataParallel(model, comm, exact=True) as dp:
        dp.save_checkpoint(os.fspath(folder))
    with mpidp.torch.DataParallel(model, comm) as dp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp.load_checkpoint(folder)
    assert [str(w.message) for w in caught if "exact=True" in str(w.message)] != [] if comm.rank == 0 else not caught


SAVER = """
import sys, numpy as np, mpidp
from mpi4py import MPI
from mpidp import checkpoint
params = {"w": np.zeros(4096, np.float32), "v": np.zeros(333, np.float32)}
with mpidp.DataParallel.initialize(params, MPI.COMM_SELF) as dp:
    for k in range(1, 41):
        for a in params.values():
            a[:] = k
        checkpoint.save(dp, sys.argv[1], params, tag=f"k{k:03d}", replace=True)
        checkpoint.save(dp, sys.argv[1], params, tag="same", replace=True)
"""


def test_loads_that_race_another_jobs_saves_load_one_whole_checkpoint_or_fail_everywhere(comm: MPI.Comm, folder: Path) -> None:
    """Another job saves into the folder (new tags, and one tag replaced) while every rank loads ``latest`` or that tag."""
    params = {"w": np.zeros(4096, np.float32), "v": np.zeros(333, np.float32)}
    saver = None
    if comm.rank == 0:
        params["w"][:] = params["v"][:] = 0
        with mpidp.DataParallel.initialize(params, MPI.COMM_SELF) as first:
            checkpoint.save(first, folder, params, tag="k000")
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(folder)], env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (folder / "k001").exists() and saver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the other job is saving now
    comm.Barrier()
    outcomes = []
    with mpidp.DataParallel.initialize(params, comm) as dp:
        for where in [folder] * 12 + [folder / "same"] * 12:
            try:
                checkpoint.load(dp, where, params)
                values = {float(v) for a in params.values() for v in np.unique(a)}
                assert len(values) == 1, values  # one checkpoint, whole: every value of one save
                outcomes.append(("loaded", values.pop()))
            except ContractError as e:
                outcomes.append(("refused", str(e)))
    every = comm.allgather(outcomes)
    assert all(o == every[0] for o in every), every  # the same checkpoint or the same error on every rank
    if saver is not None:
        failed = saver.poll()  # still saving, or done without an error
        saver.kill()
        _, err = saver.communicate(timeout=60)
        assert failed in (None, 0), err
    assert any(kind == "loaded" for kind, _ in outcomes), outcomes
