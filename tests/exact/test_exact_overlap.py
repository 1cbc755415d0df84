"""The exact reduction with overlap: buckets summed as integers while backward runs, the bits of one process.

Serially a world of one; under ``mpiexec -n 4`` four ranks, and three, two
and one split from them; on two simulated hosts in the multi-host step.
Every result is compared with a session on ``COMM_SELF`` that reduced
without overlap, and every test checks which way the overlapped window
went: its buckets' sums (:mod:`mpidp.overlap.exact_jobs`) or, where they cannot
hold, the plain exact path again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import first_ranks, same_error_everywhere
from mpi4py import MPI

import mpidp.core
import mpidp.exact
import mpidp.overlap.exact_jobs
import mpidp.torch
from mpidp import ContractError
from mpidp.exact import shard
from mpidp.examples.charlm import IGNORE, VOCAB, CharLM, Language, batch

COUNT = 12  # micro-batches per window
SMALL = {"bucket_bytes": 8192, "chunk_bytes": 4096}  # several buckets, several int64 calls per bucket


@pytest.fixture(params=["hooks", "thread"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Ways:
    """How many windows took the buckets' sums and how many the plain exact path again (this rank)."""

    def __init__(self) -> None:
        self.buckets = 0  # bucket jobs that summed their integers
        self.again = 0  # windows reduced again on the plain exact path


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ways]:
    ways = Ways()
    run, again = mpidp.overlap.exact_jobs.BucketJob.run, mpidp.core.DataParallel.reduce_exact

    def job(self: Any, comm: Any, operation: str) -> None:
        run(self, comm, operation)
        ways.buckets += bool(self.calls)

    def plain(self: Any, *args: Any) -> None:
        ways.again += 1
        again(self, *args)

    monkeypatch.setattr(mpidp.overlap.exact_jobs.BucketJob, "run", job)
    monkeypatch.setattr(mpidp.core.DataParallel, "reduce_exact", plain)
    yield ways


def spread_evenly(rank: int, size: int) -> list[int]:
    return list(shard(COUNT, rank, size))


def train(
    comm: MPI.Comm, overlap: Any = False, steps: int = 2, spread: Callable[[int, int], list[int]] = spread_evenly, sync_each: bool = False,
    options: dict[str, int] = SMALL, windows: Callable[[Any], Iterable[tuple[int | None, list[int]]]] | None = None,
) -> str:
    """A small transformer, AdamW, ``steps`` windows of the same 12 micro-batches over ``comm``; its parameters' hash.

    With overlap, every backward but the last of a window runs under
    ``no_sync`` and is folded; the last one's hooks start the buckets
    (``sync_each``: no ``no_sync``, every micro-batch folded, as a careless loop).
    ``windows(dp)``, if given, yields each window's number and this rank's micro-batches instead.
    """
    torch.manual_seed(0)
    lang = Language()
    model = CharLM(dim=16, layers=1, heads=2, context=24)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mpidp.torch.DataParallel(model, comm, exact=True, overlap=overlap, **options) as dp:
            plan = windows(dp) if windows is not None else ((s, spread(dp.rank, dp.world_size)) for s in range(steps))
            for step, mine in plan:
                tokens = 0
                for j, i in enumerate(mine):
                    last = j == len(mine) - 1 and not sync_each
                    x, y = batch(np.random.default_rng([step, i]), lang, 2, 24)
                    with nullcontext() if last or not overlap or sync_each else dp.no_sync():
                        F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1), ignore_index=IGNORE, reduction="sum").backward()
                    if not last:
                        dp.fold()
                    tokens += int((y != IGNORE).sum())
                dp.reduce(local_weight=tokens)
                opt.step()
                dp.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for _, p in sorted(model.named_parameters()))).hexdigest()


def test_overlapped_buckets_give_one_process_bits_at_every_world_size(comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = train(MPI.COMM_SELF)
    with counted(monkeypatch) as ways:
        for ranks in sorted({comm.size, 3, 2, 1} & set(range(1, comm.size + 1))):
            with first_ranks(comm, ranks) as sub:
                if sub is not None:
                    assert train(sub, overlap=mode) == expected, f"rank {sub.rank} of {ranks}"
    assert ways.again == 0 and ways.buckets > 0  # the buckets' integer sums, not the plain path again


def test_a_gradient_changed_after_its_bucket_left_is_reduced_again(comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backward outside no_sync, then folded: the buckets left with the wrong gradients; the window still holds."""
    expected = train(MPI.COMM_SELF)
    with counted(monkeypatch) as ways:
        assert train(comm, overlap=mode, sync_each=True) == expected
    assert ways.again == 2  # each window, on every rank


def test_a_rank_without_tokens_reduces_again_with_the_same_bits(comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if comm.size == 1:
        pytest.skip("needs two ranks")

    def all_but_the_last(rank: int, size: int) -> list[int]:
        return [] if rank == size - 1 else [i for i in range(COUNT) if i % (size - 1) == rank]

    expected = train(MPI.COMM_SELF)
    with counted(monkeypatch) as ways:
        assert train(comm, overlap=mode, spread=all_but_the_last) == expected
    assert ways.again == 2


class Scaled(torch.nn.Module):
    """One parameter whose gradient is the given values: ``loss = (p * values).sum()``."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(3000))
        self.q = torch.nn.Parameter(torch.zeros(5))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return (self.p * values).sum() + self.q.sum()


def test_inf_and_nan_from_one_rank_give_the_plain_exact_bits(comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(overlap: Any) -> bytes:
        model = Scaled()
        with mpidp.torch.DataParallel(model, comm, exact=True, overlap=overlap, **SMALL) as dp:
            values = torch.from_numpy(np.random.default_rng(comm.rank).standard_normal(3000).astype(np.float32))
            if comm.rank == comm.size - 1:
                values[7], values[8] = float("inf"), float("nan")
            model(values).backward()
            dp.reduce(local_weight=1)
            return model.p.grad.numpy().tobytes() + model.q.grad.numpy().tobytes()

    plain = run(False)
    with counted(monkeypatch) as ways:
        assert run(mode) == plain
    assert ways.again == 1
    got = np.frombuffer(plain[: 3000 * 4], np.float32)
    assert np.isinf(got[7]) and np.isnan(got[8]) and np.isfinite(np.delete(got, [7, 8])).all()


def test_a_slot_too_wide_for_int64_is_one_error_everywhere_then_the_next_window_works(comm: MPI.Comm, mode: str) -> None:
    model = Scaled()
    with mpidp.torch.DataParallel(model, comm, exact=True, overlap=mode, **SMALL) as dp:
        big = 2.0**30 if comm.rank == 0 else 2.0**-30
        if comm.size == 1:
            with dp.no_sync():
                model(torch.full((3000,), 2.0**-30)).backward()
            dp.fold()
        model(torch.full((3000,), big)).backward()
        same_error_everywhere(comm, lambda: dp.reduce(local_weight=1), ContractError, "exact reduction", "'p'", "int64")
        dp.zero_grad()
        model(torch.full((3000,), float(comm.rank + 1))).backward()
        dp.reduce(local_weight=1)
        mean = np.float32(sum(range(1, comm.size + 1)) / comm.size)  # the global weight is the world size
        assert (model.p.grad.numpy() == mean).all() and (model.q.grad == 1).all()


def test_join_with_uneven_shards_gives_one_process_bits(comm: MPI.Comm, mode: str) -> None:
    """Rank r has windows 0 .. W-1-r; window w's 12 micro-batches are spread over the ranks that still have data."""
    windows = comm.size + 1

    def mine(rank: int, size: int, w: int) -> list[int]:
        active = [r for r in range(size) if w < windows - r]
        return [i for i in range(COUNT) if i % len(active) == active.index(rank)] if rank in active else []

    def joined(c: MPI.Comm) -> Callable[[Any], Iterable[tuple[int | None, list[int]]]]:
        def plan(dp: Any) -> Iterator[tuple[int | None, list[int]]]:
            for w in dp.join(range(windows - c.rank) if c.size > 1 else range(windows)):
                yield w, [] if w is None else (mine(c.rank, comm.size, w) if c.size > 1 else list(range(COUNT)))

        return plan

    def run(c: MPI.Comm, overlap: Any) -> str:
        return train(c, overlap=overlap, windows=joined(c))

    assert run(comm, mode) == run(MPI.COMM_SELF, False)


def test_another_operation_between_backward_and_reduce_keeps_the_bits(comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify_replicas() after the last backward ends the window's buckets; reduce sums them again, the same bits."""
    verify = mpidp.torch.DataParallel.reduce

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> int:
        self.verify_replicas()
        return verify(self, *args, **kwargs)

    expected = train(MPI.COMM_SELF)
    monkeypatch.setattr(mpidp.torch.DataParallel, "reduce", interrupted)
    with counted(monkeypatch) as ways:
        assert train(comm, overlap=mode) == expected
    assert ways.again == 0 and ways.buckets > 0


def test_close_after_backward_without_reduce_finishes_the_buckets(comm: MPI.Comm, mode: str) -> None:
    model = Scaled()
    dp = mpidp.torch.DataParallel(model, comm, exact=True, overlap=mode, **SMALL)
    with dp.no_sync():
        model(torch.ones(3000)).backward()
    dp.fold()
    model(torch.full((3000,), 2.0)).backward()  # its hooks start the buckets
    dp.close()  # every rank: the buckets finish, nothing waits
    comm.Barrier()
    with pytest.raises(ContractError, match="closed"):
        dp.reduce(local_weight=1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bucket_bytes", [8192, 1 << 30])  # several buckets; one alone, which starts before the agreement too
def test_a_reduce_on_one_rank_while_the_others_close_is_one_error_everywhere(comm: MPI.Comm, mode: str, bucket_bytes: int) -> None:
    import time

    model = Scaled()
    dp = mpidp.torch.DataParallel(model, comm, exact=True, overlap=mode, bucket_bytes=bucket_bytes, chunk_bytes=4096)
    model(torch.full((3000,), 2.0)).backward()  # every rank: its buckets' jobs are queued
    start = time.monotonic()
    call = (lambda: dp.reduce(local_weight=1)) if comm.rank == 0 else dp.close
    message = same_error_everywhere(comm, call, ContractError, "ranks are in different mpidp operations: rank 0 in reduce, rank 1 in close")
    assert time.monotonic() - start < 5, message
    dp.close()  # idempotent


def test_one_micro_batch_per_rank_folded_after_a_synced_backward_keeps_the_bits(
    comm: MPI.Comm, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's only micro-batch runs outside no_sync and is folded at once, while the thread may still sum its one
    bucket. Held up here (the bucket packs late; the fold starts a little late and zeroes .grad late), the bucket would
    read the micro-batch twice, in the folds and in .grad, on facts that still agree: fold waits for the bucket first."""
    import time

    expected = train(MPI.COMM_SELF, spread=lambda rank, size: list(range(comm.size)))
    span, fold = mpidp.overlap.exact_jobs.ExactBuckets.span, mpidp.core.DataParallel.fold

    def late_pack(self: Any, k: int) -> tuple[int, int]:
        time.sleep(0.1)  # between the bucket's exchange and its pack
        return span(self, k)

    def late_fold(self: Any, grads: Any) -> None:
        time.sleep(0.03)
        fold(self, grads)
        time.sleep(0.3)  # before .grad is zeroed

    monkeypatch.setattr(mpidp.overlap.exact_jobs.ExactBuckets, "span", late_pack)
    monkeypatch.setattr(mpidp.core.DataParallel, "fold", late_fold)
    one_bucket = {"bucket_bytes": 1 << 30, "chunk_bytes": 4096}
    assert train(comm, overlap=mode, spread=lambda rank, size: [rank], sync_each=True, options=one_bucket) == expected


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bucket_bytes", [8192, 1 << 30])
def test_ranks_that_close_before_any_backward_meet_an_exact_overlapped_reduce(comm: MPI.Comm, mode: str, bucket_bytes: int) -> None:
    import time

    model = Scaled()
    dp = mpidp.torch.DataParallel(model, comm, exact=True, overlap=mode, bucket_bytes=bucket_bytes, chunk_bytes=4096)
    start = time.monotonic()

    def rank0() -> None:
        model(torch.full((3000,), 2.0)).backward()  # its hooks open the window
        dp.reduce(local_weight=1)

    message = same_error_everywhere(comm, rank0 if comm.rank == 0 else dp.close, ContractError, "rank 0 in reduce", "rank 1 in close")
    assert time.monotonic() - start < 5, message
    dp.close()
