"""Checkpoints of the PyTorch adapter: model, buffers, a torch optimizer, extras; resumed at another world size."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import first_ranks, same_error_everywhere
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.nn.functional as F

import mpidp.torch
from mpidp import ContractError, checkpoint
from mpidp.exact import shard
from mpidp.examples.charlm import IGNORE, VOCAB, CharLM, Language, batch

COUNT = 6  # micro-batches per window


def digest(model: Any) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for _, p in sorted(model.named_parameters()))).hexdigest()


def window(dp: Any, step: int, model: Any, lang: Language, count: int = COUNT) -> int:
    """One exact window of ``count`` micro-batches spread over the ranks, each folded; the tokens behind this rank's sums."""
    tokens = 0
    mine = list(shard(count, dp.rank, dp.world_size))
    for j, i in enumerate(mine):
        x, y = batch(np.random.default_rng([step, i]), lang, 2, 24)
        F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1), ignore_index=IGNORE, reduction="sum").backward()
        if j < len(mine) - 1:
            dp.fold()
        tokens += int((y != IGNORE).sum())
    return tokens


def step(dp: Any, opt: Any, tokens: int, sharded: bool) -> None:
    """The window's step: a sharded optimizer's step is the reduction; a torch one follows dp.reduce."""
    if sharded:
        opt.step(local_weight=tokens)
    else:
        dp.reduce(local_weight=tokens)
        opt.step()


def run(comm: MPI.Comm, steps: range, save: Path | None = None, resume: Path | None = None, seed: int = 0, sharded: bool = False) -> str:
    """Train a small transformer exactly (AdamW, or mpidp's sharded one) over ``steps`` windows; save after or resume before; its hash."""
    torch.manual_seed(seed)
    lang = Language()
    model = CharLM(dim=16, layers=1, heads=2, context=24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mpidp.torch.DataParallel(model, comm, exact=True) as dp:
            opt = mpidp.torch.ShardedAdamW(dp, lr=3e-3) if sharded else torch.optim.AdamW(model.parameters(), lr=3e-3)
            if resume is not None:
                extras = dp.load_checkpoint(resume, opt)
                assert extras["next"] == steps.start
            for s in steps:
                step(dp, opt, window(dp, s, model, lang), sharded)
                dp.zero_grad()
            if save is not None:
                dp.save_checkpoint(save, opt, extras={"next": steps.stop, "rng": torch.get_rng_state()})
    finally:
        torch.set_num_threads(threads)
    return digest(model)


@pytest.mark.mpi(min_size=2)
def test_an_exact_run_resumed_at_another_world_size_has_the_uninterrupted_hash(comm: MPI.Comm, folder: Path) -> None:
    expected = run(MPI.COMM_SELF, range(4))
    run(comm, range(2), save=folder)  # stopped after 2 windows at N ranks
    for n in sorted({1, comm.size - 1}):  # resumed at fewer ranks
        with first_ranks(comm, n) as sub:
            if sub is not None:
                assert run(sub, range(2, 4), resume=folder) == expected, f"{comm.size} -> {n}"
    with first_ranks(comm, 1) as one:  # and the other way round: 1 -> N
        if one is not None:
            run(one, range(1), save=folder / "from-one")
    comm.Barrier()
    assert run(comm, range(1, 4), resume=folder / "from-one") == expected


@pytest.mark.mpi(min_size=2)
def test_a_sharded_torch_optimizer_resumes_at_another_world_size(comm: MPI.Comm, folder: Path) -> None:
    expected = run(MPI.COMM_SELF, range(3), sharded=True)
    run(comm, range(2), save=folder, sharded=True)
    with first_ranks(comm, comm.size - 1) as sub:
        if sub is not None:
            assert run(sub, range(2, 3), resume=folder, sharded=True) == expected


def test_model_buffers_and_optimizer_state_come_back(comm: MPI.Comm, folder: Path) -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    model[2].weight = torch.nn.Parameter(torch.randn(3, 5))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1}, {"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 0.01, "weight_decay": 0.0}], momentum=0.9)
    dp = mpidp.torch.DataParallel(model, comm)
    model(torch.randn(8, 6)).sum().backward()  # BatchNorm's running statistics move, momentum buffers appear
    dp.reduce(local_weight=8)
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()
    dp.broadcast_buffers()  # root's buffers are what is saved
    want = {k: v.clone() for k, v in model.state_dict().items()}
    dp.save_checkpoint(folder, opt, tag="one")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model[1].running_mean.fill_(5)
    opt2 = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.5}, {"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 0.5}], momentum=0.9)
    dp.load_checkpoint(folder, opt2)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    sd = opt2.state_dict()
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.01]
    assert all(torch.equal(sd["state"][i]["momentum_buffer"], want_opt["state"][i]["momentum_buffer"]) for i in want_opt["state"])
    dp.close()


def test_another_optimizer_or_buffer_is_one_error(comm: MPI.Comm, folder: Path) -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    dp = mpidp.torch.DataParallel(model, comm)
    dp.save_checkpoint(folder, torch.optim.AdamW(model.parameters()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    same_error_everywhere(comm, lambda: dp.load_checkpoint(folder, torch.optim.SGD(model.parameters(), lr=0.1)), ContractError, "another optimizer", "AdamW", "SGD")
    dp.close()
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, track_running_stats=False))
    other.load_state_dict(model.state_dict(), strict=False)
    dp2 = mpidp.torch.DataParallel(other, comm)
    same_error_everywhere(comm, lambda: dp2.load_checkpoint(folder), ContractError, "buffer '1.num_batches_tracked'", "absent here")
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    dp2.close()


def test_export_loads_into_plain_torch(comm: MPI.Comm, folder: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(3)
    model = CharLM(dim=16, layers=1, heads=2, context=24)
    dp = mpidp.torch.DataParallel(model, comm)
    path = dp.save_checkpoint(folder)
    dp.close()
    if comm.rank == 0:
        params = checkpoint.consolidate(path)
        out = folder / "plain.safetensors"
        from safetensors.numpy import save_file

        save_file(params, str(out))
        fresh = CharLM(dim=16, layers=1, heads=2, context=24)
        missing, unexpected = fresh.load_state_dict(load_file(str(out)), strict=False)
        assert not unexpected and all("." in m for m in missing)  # buffers only: every parameter came back
        assert digest(fresh) == digest(model)
