"""DataParallel.join: uneven shards, every rank in step until no rank has data (collective).

Run on COMM_WORLD (a world of one serially, four ranks under mpiexec) and on
a three-rank communicator split from it; every rank asserts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import first_ranks, same_error_everywhere, snapshot
from mpi4py import MPI

import mpidp
from mpidp import ContractError

D = 5  # features
LR = 0.05


def shard_sizes(size: int) -> list[int]:
    """Batches per rank: uneven, and the second rank has none at all (when there is one)."""
    sizes = [4, 0, 7, 2, 5, 1][:size]
    return sizes if size > 1 else [6]


def batches(rank: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's batches: 1 to 3 samples each, integers, so every rank knows every rank's data."""
    rng = np.random.default_rng([11, rank])
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 4))
        out.append((rng.integers(-3, 4, size=(n, D)).astype(np.float32), rng.integers(-5, 6, size=n).astype(np.float32)))
    return out


def gradient(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of the squared-error SUM 0.5 * sum((x @ w + b - y)^2)."""
    r = x @ w + b - y
    return (x.T @ r).astype(np.float32), np.array([r.sum()], np.float32)


def train(comm: MPI.Comm) -> tuple[dict[str, np.ndarray], list[Any], list[int]]:
    """Train over this rank's shard with join; returns the parameters, what join yielded, the global weights."""
    sizes = shard_sizes(comm.size)
    rng = np.random.default_rng(comm.rank)
    params = {"w": rng.standard_normal(D).astype(np.float32), "b": rng.standard_normal(1).astype(np.float32)}
    yielded: list[Any] = []
    weights: list[int] = []
    mine = batches(comm.rank, sizes[comm.rank])
    with mpidp.DataParallel.initialize(params, comm) as dp:
        for step, batch in enumerate(dp.join(iter(mine))):
            yielded.append(None if batch is None else id(batch))
            if batch is None:
                out = dp.reduce({}, 0, step=step)  # no data left: weight 0, no gradients
            else:
                gw, gb = gradient(params["w"], params["b"], *batch)
                out = dp.reduce({"w": gw, "b": gb}, len(batch[1]), step=step)
            params["w"] -= LR * out.gradients["w"]
            params["b"] -= LR * out.gradients["b"]
            weights.append(out.global_weight)
        dp.verify_replicas()
    assert yielded[: len(mine)] == [id(m) for m in mine] and all(y is None for y in yielded[len(mine) :])
    return params, yielded, weights


def one_process(size: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """The same steps on one process: step i sees the i-th batch of every shard that has one."""
    sizes = shard_sizes(size)
    rng = np.random.default_rng(0)  # the root's parameters are broadcast
    w, b = rng.standard_normal(D).astype(np.float32), rng.standard_normal(1).astype(np.float32)
    shards = [batches(r, sizes[r]) for r in range(size)]
    weights = []
    for step in range(max(sizes)):
        here = [s[step] for s in shards if step < len(s)]
        x = np.concatenate([h[0] for h in here])
        y = np.concatenate([h[1] for h in here])
        gw, gb = gradient(w, b, x, y)
        w = w - LR * (gw / np.float32(len(y)))
        b = b - LR * (gb / np.float32(len(y)))
        weights.append(len(y))
    return {"w": w, "b": b}, weights


def check_training(comm: MPI.Comm) -> None:
    params, yielded, weights = train(comm)
    assert len(yielded) == max(shard_sizes(comm.size))  # every rank the same number of steps
    every = comm.allgather(snapshot(params))
    assert all(e == every[0] for e in every), "replicas differ"
    expected, expected_weights = one_process(comm.size)
    assert weights == expected_weights
    for k in params:
        np.testing.assert_allclose(params[k], expected[k], rtol=1e-5, atol=1e-6)


def test_uneven_shards_train_as_one_process_over_all_data(comm: MPI.Comm) -> None:
    """Shards of 4, 0, 7 and 2 batches at 4 ranks: one rank never has data, the others run out at different steps."""
    check_training(comm)


@pytest.mark.mpi(min_size=4)
def test_uneven_shards_at_three_ranks(comm: MPI.Comm) -> None:
    with first_ranks(comm, 3) as three:
        if three is not None:
            check_training(three)


def test_no_data_anywhere_yields_nothing(comm: MPI.Comm) -> None:
    with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, comm) as dp:
        assert list(dp.join([])) == []
        got = list(dp.join(range(2) if comm.rank == 0 else []))
        assert got == ([0, 1] if comm.rank == 0 else [None, None])


def test_batches_are_not_read_past_their_end(comm: MPI.Comm) -> None:
    reads: list[int] = []

    def counted() -> Iterator[int]:
        for i in range(comm.rank):
            reads.append(i)
            yield i

    with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, comm) as dp:
        out = list(dp.join(counted()))
    assert out == list(range(comm.rank)) + [None] * (comm.size - 1 - comm.rank)
    assert reads == list(range(comm.rank))


def test_a_rank_whose_batches_raise_is_one_error_everywhere(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where

    def broken() -> Iterator[int]:
        yield 1
        if mine:
            raise OSError("disk gone")
        yield 2

    with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, comm) as dp:
        seen: list[Any] = []

        def run() -> None:
            seen.extend(dp.join(broken()))

        same_error_everywhere(comm, run, ContractError, f"rank {bad}: the batches raised OSError: disk gone")
        assert seen == [1]
        try:
            run()
        except ContractError as e:
            assert isinstance(e.__cause__, OSError) == mine
        dp.verify_replicas()  # the session goes on


@pytest.mark.mpi(min_size=2)
def test_join_on_one_rank_and_reduce_on_the_others_raise_everywhere(comm: MPI.Comm) -> None:
    last = comm.size - 1
    with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, comm) as dp:
        def run() -> None:
            if comm.rank == last:
                next(iter(dp.join([1])))
            else:
                dp.reduce({"w": np.ones(3, np.float32)}, 1)

        same_error_everywhere(comm, run, ContractError, f"ranks are in different mpidp operations: rank 0 in reduce, rank {last} in join")
