"""Loss scaling with the sharded optimizers: one agreed inf/NaN answer, the same skip and scale on every rank (collective).

A loop with ``torch.amp.GradScaler`` where one rank's gradient holds an inf
in one step: every rank skips that step, the scale halves on every rank,
the replicas stay bitwise equal, later steps proceed, and the run stays
near the replicated one (``dp.reduce``, ``scaler.unscale_``,
``clip_grad_norm_``, ``torch.optim.AdamW``), float32 on the CPU.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from conftest import same_error_everywhere, snapshot
from mpi4py import MPI

import mpidp
import mpidp.optim as mo
import mpidp.torch
from mpidp import ContractError

#: GradScaler warns (once per place) that it will stop passing itself to step; the sharded optimizer needs it to
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")

BAD_STEP = 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rank + 2, 13, generator=g), torch.randint(0, 5, (rank + 2,), generator=g)


def digest(m: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()


def train(comm: MPI.Comm, sharded: bool, max_norm: float | None) -> tuple[torch.nn.Module, list[float], list[bool]]:
    """Five scaled steps; the last rank's gradient holds an inf at BAD_STEP. The model, the scales, which steps changed it."""
    m = model()
    dp = mpidp.torch.DataParallel(m, comm)
    opt: torch.optim.Optimizer = mpidp.torch.ShardedAdamW(dp, lr=1e-2) if sharded else torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    scales, changed = [], []
    for s in range(5):
        x, y = batch(s, comm.rank)
        bad = s == BAD_STEP and comm.rank == comm.size - 1  # an overflow in backward (.grad itself is not edited afterwards)
        hook = next(m.parameters()).register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(torch.inf))) if bad else None
        scaler.scale(torch.nn.functional.cross_entropy(m(x), y, reduction="sum")).backward()
        if hook is not None:
            hook.remove()
        before = digest(m)
        if sharded:
            scaler.step(opt, local_weight=len(y), max_norm=max_norm)
            assert opt.last.found_inf == (s == BAD_STEP)
        else:
            dp.reduce(local_weight=len(y))
            scaler.unscale_(opt)
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        changed.append(digest(m) != before)
    dp.close()
    return m, scales, changed


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_grad_scaler_skips_and_backs_off_on_every_rank(comm: MPI.Comm, max_norm: float | None) -> None:
    mine, scales, changed = train(comm, True, max_norm)
    ref, ref_scales, ref_changed = train(comm, False, max_norm)
    every = comm.allgather((digest(mine), scales, changed))
    assert all(e == every[0] for e in every), every  # bitwise equal replicas, the same scales and skips everywhere
    assert changed == [s != BAD_STEP for s in range(5)]  # the bad step skipped, the later ones proceed
    assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2  # halved
    assert (scales, changed) == (ref_scales, ref_changed)
    for a, b in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unscale_and_a_scaler_that_does_not_pass_itself_raise_everywhere(comm: MPI.Comm) -> None:
    m = model()
    dp = mpidp.torch.DataParallel(m, comm)
    opt = mpidp.torch.ShardedAdamW(dp, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(0, comm.rank)
    scaler.scale(torch.nn.functional.cross_entropy(m(x), y, reduction="sum")).backward()
    before = snapshot(dict(m.named_parameters()))
    if comm.rank == comm.size - 1:  # one rank is enough: the error is every rank's
        scaler.unscale_(opt)
    same_error_everywhere(comm, lambda: scaler.step(opt, local_weight=len(y)), ContractError, "scaler.unscale_(opt) is not supported", "max_norm")
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)  # what a GradScaler that stops passing itself sets
    same_error_everywhere(comm, lambda: opt.step(local_weight=len(y)), ContractError, "did not pass itself to step")
    del opt.grad_scale, opt.found_inf
    assert snapshot(dict(m.named_parameters())) == before and not opt.sharded._states["exp_avg"].any()
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.nn.functional.cross_entropy(m(x), y, reduction="sum")).backward()
    scaler.step(opt, local_weight=len(y))  # the session and the optimizer still work
    scaler.update()
    assert snapshot(dict(m.named_parameters())) != before
    dp.close()


@pytest.mark.parametrize("exact", [False, True])
def test_core_scale_skips_alike_and_must_agree(comm: MPI.Comm, exact: bool) -> None:
    rng = np.random.default_rng(0)
    p = {"a": rng.standard_normal(7).astype(np.float32), "b": rng.standard_normal(1000).astype(np.float32)}
    with mpidp.DataParallel.initialize(p, comm, exact=exact) as dp:
        opt = mo.AdamW(dp, [{"params": ["b"]}])  # "a" is in no group: its inf is not the optimizer's
        g = {k: rng.standard_normal(v.size).astype(np.float32) * 1024 for k, v in p.items()}
        nan = {**g, "a": np.full(7, np.nan, np.float32)}
        kept = snapshot(p)
        assert not opt.step(nan, 1, scale=1024.0).found_inf and snapshot(p) != kept
        bad = {**g, "b": g["b"].copy()}
        bad["b"][comm.size * 7 % 1000] = np.inf if comm.rank == comm.size - 1 else 0.0
        kept, state = snapshot(p), opt._states["exp_avg"].copy()
        result = opt.step(bad, 1, scale=1024.0, max_norm=1.0)
        assert result.found_inf and result.norm == np.inf and snapshot(p) == kept
        assert np.array_equal(opt._states["exp_avg"], state) and opt.hyperparameters()["groups"][0]["step"] == 1
        if comm.size > 1:
            same_error_everywhere(comm, lambda: opt.step(g, 1, scale=1024.0 if comm.rank else 512.0), ContractError, "scale")
        same_error_everywhere(comm, lambda: opt.step(g, 1, scale=0.0), ContractError, "scale must be")
        assert snapshot(p) == kept
        every: Any = comm.allgather(snapshot(p))
        assert all(e == every[0] for e in every)
        dp.close()
