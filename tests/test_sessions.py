"""Several sessions in one job (issue 44): used in the same order they work, in different orders they are one error at once.

Every session over the same ranks agrees on one communicator of the job
(:class:`mpidp.comm.Job`), so a rank in one session's call meets a rank in
another's and every rank raises the same ContractError, naming each rank's
session and call, within a millisecond instead of at the watchdog.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from conftest import first_ranks, same_error_everywhere, snapshot
from mpi4py import MPI

import mpidp
from mpidp import ContractError
from mpidp import comm as _mpi

pytestmark = pytest.mark.mpi(min_size=2)

#: what every rank must do, in every message that names sessions
ORDER = "every rank must call the sessions made on one communicator in the same order"


def model(sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(n).astype(np.float32) for name, n in sizes.items()}


def grads(sizes: dict[str, int], rank: int, step: int) -> dict[str, np.ndarray]:
    """This rank's gradients of a window: exactly representable, so that every path sums them exactly."""
    return {name: np.full(n, (rank + 1) * (step + 1) / 8, np.float32) for name, n in sizes.items()}


def expected(size: int, step: int, weights: list[int]) -> float:
    return sum((r + 1) * (step + 1) / 8 for r in range(size)) / sum(weights)


def label(dp: Any) -> str:
    """How every rank names ``dp`` in a message (its number depends on the sessions the job made before this test)."""
    return str(dp._comm.label)


A = {"w": 6, "b": 2}
B = {"w": 40, "v": 3, "u": 70}  # more slots than A: a wider frame, so the job's frames widen when B is made
C = {f"p{i}": 2 for i in range(130)}  # 130 slots: three presence words; made after A and B have reduced


@pytest.mark.parametrize("exact", [False, True])
def test_sessions_called_in_different_orders_are_one_error_everywhere_at_once(comm: MPI.Comm, exact: bool) -> None:
    """The issue's repro: rank 0 reduces session 1 then 2, the others 2 then 1; nothing moves, both keep working."""
    dp1 = mpidp.DataParallel.initialize(model(A, 1), comm, exact=exact, name="generator")
    dp2 = mpidp.DataParallel.initialize(model(B, 2), comm, exact=exact)
    try:
        assert label(dp1).endswith(" ('generator')") and label(dp2) == f"session {dp2._comm.session}"
        g1, g2 = grads(A, comm.rank, 0), grads(B, comm.rank, 0)
        before = snapshot(g1) | {f"2{k}": v for k, v in snapshot(g2).items()}
        first, second = (dp1, dp2) if comm.rank == 0 else (dp2, dp1)
        every = "" if comm.size == 2 else (
            f" (every rank: reduce of {label(dp1)} on rank 0, reduce of {label(dp2)} on ranks 1-{comm.size - 1})"
        )
        start = time.monotonic()
        message = same_error_everywhere(
            comm, lambda: first.reduce(g1 if first is dp1 else g2, 1), ContractError,
            f"ranks are in different mpidp sessions: rank 0 in reduce of {label(dp1)}, rank 1 in reduce of {label(dp2)}{every}",
            ORDER,
        )
        assert time.monotonic() - start < 5, message
        assert "closed" not in message and not dp1.closed and not dp2.closed
        assert snapshot(g1) | {f"2{k}": v for k, v in snapshot(g2).items()} == before  # the caller's arrays untouched
        for dp, g, sizes in ((dp1, g1, A), (dp2, g2, B)):  # the same order on every rank: both work on
            out = dp.reduce(g, comm.rank + 1)
            for name in sizes:
                np.testing.assert_array_equal(out.gradients[name], np.float32(expected(comm.size, 0, [r + 1 for r in range(comm.size)])))
        assert second is not first
    finally:
        dp2.close()
        dp1.close()


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("pattern", ["ab", "aab", "abbab"])
def test_sessions_interleaved_alike_on_every_rank_keep_working(comm: MPI.Comm, exact: bool, pattern: str) -> None:
    """Two models trained alternately for several windows, a third made between windows; every result checked on every rank."""
    sizes = {"a": A, "b": B, "c": C}
    params = {k: model(s, 10 + i) for i, (k, s) in enumerate(sizes.items())}
    root = {k: {n: v.copy() for n, v in p.items()} for k, p in params.items()}  # every rank seeds alike: root's values
    sessions = {k: mpidp.DataParallel.initialize(params[k], comm, exact=exact, name=k) for k in "ab"}
    steps = dict.fromkeys(sizes, 0)
    try:
        for window in range(3 * len(pattern)):
            if window == len(pattern):  # a wider session made after the others reduced: their frames widen alike
                sessions["c"] = mpidp.DataParallel.initialize(params["c"], comm, exact=exact, name="c")
            for k in pattern[window % len(pattern)] + ("c" if "c" in sessions else ""):
                g = grads(sizes[k], comm.rank, steps[k])
                if exact:
                    sessions[k].fold(grads(sizes[k], comm.rank, steps[k]))
                out = sessions[k].reduce(g, 2, step=steps[k])
                assert out.global_weight == 2 * comm.size
                want = 2 * expected(comm.size, steps[k], [2] * comm.size)  # two micro-batches with exact, one without
                want = want if exact else want / 2
                for name, value in out.gradients.items():
                    np.testing.assert_array_equal(value, np.full(sizes[k][name], want, np.float32))
                for name in params[k]:
                    params[k][name] -= out.gradients[name]
                    root[k][name] -= np.float32(want)
                steps[k] += 1
        for k, dp in sessions.items():
            dp.verify_replicas()
            every = comm.allgather({n: v.tobytes() for n, v in params[k].items()})
            assert all(e == every[0] for e in every)
            for name in params[k]:
                np.testing.assert_array_equal(params[k][name], root[k][name])
    finally:
        for dp in reversed(list(sessions.values())):
            dp.close()


def test_a_rank_that_initializes_while_the_others_reduce_is_one_error_everywhere(comm: MPI.Comm) -> None:
    """Rank 0 makes a new session while the others reduce an old one: initialize announces it on the job first."""
    dp1 = mpidp.DataParallel.initialize(model(A, 1), comm)
    try:
        g = grads(A, comm.rank, 0)
        new = f"session {dp1._comm.job.made + 1}"

        def run() -> None:
            if comm.rank == 0:
                mpidp.DataParallel.initialize(model(B, 2), comm, name="late")
            else:
                dp1.reduce(g, 1)

        start = time.monotonic()
        message = same_error_everywhere(
            comm, run, ContractError, f"rank 0 in initialize of {new}, rank 1 in reduce of {label(dp1)}", ORDER
        )
        assert time.monotonic() - start < 5, message
        with mpidp.DataParallel.initialize(model(B, 2), comm) as dp2:  # numbered alike on every rank still
            assert comm.allgather(label(dp2)) == [new] * comm.size
            dp1.reduce(g, 1)
            dp2.reduce(grads(B, comm.rank, 0), 1)
    finally:
        dp1.close()


def test_a_rank_that_closes_one_session_while_the_others_reduce_another_closes_it_everywhere(comm: MPI.Comm) -> None:
    dp1 = mpidp.DataParallel.initialize(model(A, 1), comm, name="student")
    dp2 = mpidp.DataParallel.initialize(model(B, 2), comm, name="teacher")
    try:
        g = grads(A, comm.rank, 0)
        start = time.monotonic()
        message = same_error_everywhere(
            comm, dp2.close if comm.rank == 0 else lambda: dp1.reduce(g, 1), ContractError,
            f"rank 0 in close of {label(dp2)}, rank 1 in reduce of {label(dp1)}", f"{label(dp2)} is now closed on every rank",
        )
        assert time.monotonic() - start < 5, message
        assert comm.allgather((dp1.closed, dp2.closed)) == [(False, True)] * comm.size
        out = dp1.reduce(g, 1)  # the other session goes on
        np.testing.assert_array_equal(out.gradients["w"], np.float32(expected(comm.size, 0, [1] * comm.size)))
    finally:
        dp2.close()
        dp1.close()


def test_communicators_of_one_group_share_a_job_freed_with_its_last_session(comm: MPI.Comm) -> None:
    """A Dup of the communicator is the same ranks in the same order: its sessions are in the same job; a subgroup's are not."""
    other = comm.Dup()
    try:
        with mpidp.DataParallel.initialize(model(A, 1), comm) as dp1, mpidp.DataParallel.initialize(model(B, 1), other) as dp2:
            job = dp1._comm.job
            assert dp2._comm.job is job and dp2._comm.session == dp1._comm.session + 1
            left = set(job.members) - {dp1._comm.session, dp2._comm.session}  # sessions other tests left open, if any
            with first_ranks(comm, 1) as sub:
                if sub is not None:
                    with mpidp.DataParallel.initialize(model(A, 1), sub) as dp3:
                        assert dp3._comm.job is not job and dp3._comm.session == 1
        if not left:
            assert job.comm == MPI.COMM_NULL and job not in _mpi._jobs
    finally:
        other.Free()


def test_a_name_every_rank_does_not_pass_alike_is_refused_everywhere(comm: MPI.Comm) -> None:
    last = comm.size - 1
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(A, 1), comm, name="a" if comm.rank != last else "b"), ContractError,
        f"rank {last} passes name='b', rank 0 name='a': every rank must pass the same",
    )
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(A, 1), comm, name=3 if comm.rank == last else None), ContractError,  # type: ignore[arg-type]
        f"rank {last}: name must be a str or None, got int 3",
    )


# ------------------------------------------------------------------ the PyTorch adapter


def _torch_pair(comm: MPI.Comm, overlap: Any, exact: bool = False) -> tuple[Any, Any, Any, Any]:
    torch = pytest.importorskip("torch")
    from test_torch import TinyLM

    import mpidp.torch

    torch.manual_seed(7)
    critic = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    lm = TinyLM(100 + comm.rank, extras=False)
    kw = {"overlap": overlap, "bucket_bytes": 4096, "exact": exact}
    return lm, critic, mpidp.torch.DataParallel(lm, comm, name="lm", **kw), mpidp.torch.DataParallel(critic, comm, name="critic", **kw)


def _critic_window(comm: MPI.Comm, critic: Any, step: int) -> int:
    import torch

    x = torch.full((3, 16), float(comm.rank + step + 1) / 16)
    critic(x).sum().backward()
    return 3


@pytest.mark.parametrize(("overlap", "exact"), [(False, False), ("hooks", False), ("thread", False), ("hooks", True)])
def test_two_torch_models_trained_alternately_keep_working(comm: MPI.Comm, overlap: Any, exact: bool) -> None:
    torch = pytest.importorskip("torch")
    from test_torch import window

    lm, critic, dp_lm, dp_critic = _torch_pair(comm, overlap, exact)
    try:
        for step in range(3):
            for model, dp in ((lm, dp_lm), (critic, dp_critic)):
                model.zero_grad(set_to_none=True)
                dp.reduce(local_weight=window(comm, lm) if model is lm else _critic_window(comm, critic, step))
                every = comm.allgather([p.grad.numpy().tobytes() for p in model.parameters()])
                assert all(e == every[0] for e in every)
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
        dp_lm.verify_replicas()
        dp_critic.verify_replicas()
    finally:
        dp_critic.close()
        dp_lm.close()


@pytest.mark.parametrize("overlap", [False, "hooks"])
def test_two_torch_models_reduced_in_different_orders_are_one_error_everywhere(comm: MPI.Comm, overlap: Any) -> None:
    """With overlap the open exchange of the first bucket meets the other session's: raised by each rank's reduce."""
    from test_torch import window

    lm, critic, dp_lm, dp_critic = _torch_pair(comm, overlap)
    try:
        def run() -> None:
            if comm.rank == 0:
                dp_lm.reduce(local_weight=window(comm, lm))
            else:
                dp_critic.reduce(local_weight=_critic_window(comm, critic, 0))

        start = time.monotonic()
        message = same_error_everywhere(comm, run, ContractError, "ranks are in different mpidp sessions: rank 0 in ", ORDER)
        assert label(dp_lm._core) in message and label(dp_critic._core) in message, message
        assert time.monotonic() - start < 5, message
        for model, dp in ((lm, dp_lm), (critic, dp_critic)):  # both usable again, in one order
            model.zero_grad(set_to_none=True)
            dp.reduce(local_weight=window(comm, lm) if model is lm else _critic_window(comm, critic, 1))
            every = comm.allgather([p.grad.numpy().tobytes() for p in model.parameters()])
            assert all(e == every[0] for e in every)
    finally:
        dp_critic.close()
        dp_lm.close()
