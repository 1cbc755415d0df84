"""close() takes part in the agreement: a rank that closes while another reduces is one error everywhere, at once.

The core's cases are in test_core.py; these are the PyTorch adapter's (its
``close`` and ``__exit__``, plain and overlapped). The implicit close at
interpreter exit starts jobs of its own: test_faults.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import same_error_everywhere
from mpi4py import MPI

torch = pytest.importorskip("torch")
from test_torch import TinyLM, window

import mpidp.torch
from mpidp import ContractError

CLOSING = "every rank must make the same mpidp calls in the same order"

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.mark.parametrize("overlap", [False, "hooks"])
def test_a_reduce_on_one_rank_while_the_others_close_is_one_error_everywhere(comm: MPI.Comm, overlap: Any) -> None:
    """``if rank == 0: dp.reduce(...)``, then ``dp.close()`` everywhere: the adapter's close agrees too."""
    model = TinyLM(100 + comm.rank, extras=False)
    dp = mpidp.torch.DataParallel(model, comm, overlap=overlap, bucket_bytes=256)
    weight = window(comm, model)  # every rank ran a backward (overlapped: its buckets are in flight)
    before = [p.grad.clone() for p in model.parameters()]
    start = time.monotonic()
    call = (lambda: dp.reduce(local_weight=weight)) if comm.rank == 0 else dp.close
    every = "" if comm.size == 2 else f" (every rank: reduce on rank 0, close on ranks 1-{comm.size - 1})"
    message = same_error_everywhere(
        comm, call, ContractError, f"ranks are in different mpidp operations: rank 0 in reduce, rank 1 in close{every}", CLOSING
    )
    assert time.monotonic() - start < 5, message
    assert dp._core._closed  # closed on every rank, the reducing one included
    if not overlap:
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))  # nothing moved
    dp.close()  # idempotent
    same_error_everywhere(comm, lambda: dp.reduce(local_weight=weight), ContractError, "this DataParallel is closed")


def test_a_skipped_reduce_then_the_end_of_a_with_block_is_one_error_everywhere(comm: MPI.Comm) -> None:
    """The last rank skips a window's reduce; the others' next reduce meets its ``__exit__``."""
    model = TinyLM(100 + comm.rank, extras=False)
    last = comm.size - 1

    def run() -> None:
        with mpidp.torch.DataParallel(model, comm) as dp:
            for step in range(3):
                weight = window(comm, model)
                if not (comm.rank == last and step == 2):
                    dp.reduce(local_weight=weight)

    same_error_everywhere(comm, run, ContractError, f"rank 0 in reduce, rank {last} in close", "the session is now closed on every rank")


@pytest.mark.parametrize("overlap", ["hooks", "thread"])
def test_ranks_that_close_before_any_backward_meet_an_overlapped_reduce_at_once(comm: MPI.Comm, overlap: str) -> None:
    """Rank 0 runs a backward and reduces; the others close without a backward: the window's open exchange meets close."""
    model = TinyLM(100 + comm.rank, extras=False)
    dp = mpidp.torch.DataParallel(model, comm, overlap=overlap, bucket_bytes=256)
    start = time.monotonic()

    def rank0() -> None:
        dp.reduce(local_weight=window(comm, model, backward=True))

    message = same_error_everywhere(comm, rank0 if comm.rank == 0 else dp.close, ContractError, "rank 0 in reduce", "rank 1 in close")
    assert time.monotonic() - start < 5, message
    assert dp._core.closed
    dp.close()  # idempotent, on every rank


class _Boom(torch.autograd.Function):
    """Identity forward; its backward raises on the last rank (after the layers above it finished theirs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:
            raise RuntimeError("injected")
        return g


class _Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(_Boom.apply(self.a(x))))).sum()


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("overlap", ["hooks", "thread"])
def test_a_backward_that_raises_after_its_first_bucket_then_close_is_one_error_everywhere(
    comm: MPI.Comm, overlap: str, exact: bool
) -> None:
    """The last rank's backward raises once a bucket opened the window; its ``with`` block closes while the others
    reduce. Its unstarted buckets go before its close agreement: a thread summing the others' buckets waits for them."""
    model = _Three()
    start = time.monotonic()

    def run() -> None:
        with mpidp.torch.DataParallel(model, comm, overlap=overlap, exact=exact, bucket_bytes=8192, chunk_bytes=4096) as dp:
            model(torch.ones(4, 64)).backward()
            dp.reduce(local_weight=1)

    message = same_error_everywhere(comm, run, ContractError, "rank 0 in reduce", f"rank {comm.size - 1} in close")
    assert time.monotonic() - start < 10, message
