"""The PyTorch face of the sharded optimizers: the README's loop, param groups, schedulers, 16-bit masters (collective)."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from conftest import same_error_everywhere
from mpi4py import MPI

import mpidp.torch
from mpidp import ContractError


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5)).to(dtype)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rank + 2, 13, generator=g), torch.randint(0, 5, (rank + 2,), generator=g)


def groups(m: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def train(comm: MPI.Comm, sharded: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    m = model(dtype)
    dp = mpidp.torch.DataParallel(m, comm)
    if sharded:
        opt: torch.optim.Optimizer = mpidp.torch.ShardedAdamW(dp, groups(m), lr=1e-2)
    else:
        opt = torch.optim.AdamW(groups(m), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for s in range(5):
        x, y = batch(s, comm.rank)
        torch.nn.functional.cross_entropy(m(x.to(dtype)).float(), y, reduction="sum").backward()
        if sharded:
            opt.step(local_weight=len(y), max_norm=1.0)
        else:
            dp.reduce(local_weight=len(y))
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        opt.zero_grad()
        sched.step()
    dp.close()
    return m


def digest(m: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in m.parameters())).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sharded_loop_matches_reduce_then_torch_adamw(comm: MPI.Comm, dtype: torch.dtype) -> None:
    mine, ref = train(comm, True, dtype), train(comm, False, dtype)
    assert len(set(comm.allgather(digest(mine)))) == 1  # replicas bitwise equal
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: float32 masters here, bf16 updates in torch's
    for a, b in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_bad_groups_and_overlap_raise_everywhere(comm: MPI.Comm) -> None:
    m = model()
    dp = mpidp.torch.DataParallel(m, comm)
    stranger = [torch.nn.Parameter(torch.zeros(3))] if comm.rank == comm.size - 1 else list(m.parameters())
    same_error_everywhere(comm, lambda: mpidp.torch.ShardedSGD(dp, stranger), ContractError, "not a trainable parameter")
    same_error_everywhere(comm, lambda: mpidp.torch.ShardedAdam(dp, copy.deepcopy(list(m.parameters()))), ContractError, "tensor 0")
    opt = mpidp.torch.ShardedAdamW(dp)
    assert opt.sharded.kind == "adamw"
    with pytest.raises(NotImplementedError):
        opt.state_dict()
    dp.close()
