"""mpidp.torch with overlap (hooks and thread modes): the same bits as the plain path, the same errors, no hang.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank. Every test trains a
plain session and an overlapped one side by side on copies of one model
and compares their ``.grad`` bytes on every rank. Small ``chunk_bytes``
cut the models into many buckets.
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
from conftest import same_error_everywhere
from mpi4py import MPI

torch = pytest.importorskip("torch")
from test_torch import IGNORE, REDUCE_ERRORS, TinyLM, grads, loss_sum, micro_batches, shards, window
from torch import nn

import mpidp.casts
import mpidp.comm
import mpidp.overlap.buckets
import mpidp.torch
from mpidp import ContractError, MissingGradientPolicy
from mpidp.overlap.buckets import layout

ZERO, ERROR = MissingGradientPolicy.ZERO, MissingGradientPolicy.ERROR
#: buckets of 64 float32 values: TinyLM's 12 slots fill about 10 buckets
SMALL = {"bucket_bytes": 256}
#: buckets in flight while ranks diverge, close or fail: run again off shared memory and across hosts (scripts/test)
TRANSPORT = pytest.mark.transport


class Mixed(nn.Module):
    """float32 and bfloat16 parameters side by side, the bfloat16 ones used in bfloat16."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(17, 8)
            self.low = nn.Linear(8, 8).to(torch.bfloat16)
            self.bias = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
            self.head = nn.Linear(8, 17)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + (self.low(h.to(torch.bfloat16)) + self.bias).float()
        return self.head(torch.tanh(h))


@pytest.fixture(params=["hooks", "thread"])
def mode(request: pytest.FixtureRequest) -> str:
    """The overlap progress mode under test: every overlap test runs in both."""
    return str(request.param)


def pair(make: Any, comm: MPI.Comm, mode: str, **options: Any) -> tuple[tuple[nn.Module, Any], tuple[nn.Module, Any]]:
    """(model, session) plain and overlapped in ``mode``, on copies of rank 0's ``make(seed)``."""
    plain, over = make(100 + comm.rank), make(100 + comm.rank)  # root's is broadcast in both
    return (plain, mpidp.torch.DataParallel(plain, comm, **options)), (over, mpidp.torch.DataParallel(over, comm, overlap=mode, **options))


def same_grads_everywhere(comm: MPI.Comm, a: nn.Module, b: nn.Module) -> None:
    """``.grad`` of ``a`` and ``b`` byte for byte equal (None alike), checked on every rank."""
    mine = grads(a) == grads(b)
    every = comm.allgather(mine)
    assert all(every), f"ranks whose overlapped gradients differ from the plain ones: {[r for r, ok in enumerate(every) if not ok]}"


def test_layout_puts_slots_in_order_and_splits_large_ones() -> None:
    offset, slots, calls = layout([3, 10, 2, 2], [3, 2, 0, 1], 4, 4, taper=1)
    assert offset == [4, 7, 2, 0]
    assert slots == [[3, 2], [0], [1]]
    assert calls == [[(0, 4)], [(4, 7)], [(7, 11), (11, 15), (15, 17)]]
    offset, slots, calls = layout([3, 10, 2, 2], [3, 2, 0, 1], 8, 3, taper=1)
    assert slots == [[3, 2, 0], [1]]
    assert calls == [[(0, 3), (3, 6), (6, 7)], [(7, 10), (10, 13), (13, 16), (16, 17)]]


def test_layout_keeps_the_last_buckets_small() -> None:
    """What backward finishes last is summed after it: the last bucket holds bucket // taper values, each before it twice as many."""
    offset, slots, calls = layout([1] * 20, list(range(20)), 8, 100, taper=8)
    assert offset == list(range(20))
    assert slots == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16], [17, 18], [19]]
    assert calls == [[(0, 5)], [(5, 13)], [(13, 17)], [(17, 19)], [(19, 20)]]
    sizes = [40, 7, 7, 7, 3, 1, 1]  # the default taper, 16: the last bucket holds at most 4 values
    offset, slots, calls = layout(sizes, list(range(7)), 64, 64)
    assert [sum(sizes[s] for s in b) for b in slots] == [40, 7, 14, 3, 2]
    assert slots[-1] == [5, 6] and offset[6] == sum(sizes) - 1


@TRANSPORT
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("zero", ["dp", "none"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_overlap_equals_the_plain_path_bitwise(comm: MPI.Comm, accumulate: int, zero: str, mode: str, early: bool) -> None:
    """Tied and frozen parameters, one used by some ranks only, one by none, a rank without tokens; micro-batches.

    ``early``: the weight is given before backward too (the thread divides as it sums).
    """
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, frozen=True), comm, mode, **SMALL)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in (plain, over)]
    with dp, do:
        for step in range(4):
            batches = list(micro_batches(shards(step, comm.size)[comm.rank], accumulate))
            tokens = sum(int((y != IGNORE).sum()) for _, y in batches)
            if early:
                do.expect_weight(tokens)
            for model, session, opt in ((plain, dp, opts[0]), (over, do, opts[1])):
                for k, (x, y) in enumerate(batches):
                    with session.no_sync() if k < len(batches) - 1 else nullcontext():
                        loss_sum(model, x, y).backward()
                assert session.reduce(local_weight=tokens, policy=ZERO) == sum(comm.allgather(tokens))
            assert over.unused.weight.grad is None and over.proj.weight.grad is None  # unused everywhere; frozen
            same_grads_everywhere(comm, plain, over)
            for model, session, opt in ((plain, dp, opts[0]), (over, do, opts[1])):
                opt.step()
                session.zero_grad() if zero == "dp" else opt.zero_grad()
        assert all(comm.allgather(all(torch.equal(p, q) for p, q in zip(plain.parameters(), over.parameters()))))


@TRANSPORT
@pytest.mark.parametrize("early", [False, True])
def test_overlap_sums_bfloat16_gradients_in_float32_like_the_plain_path(comm: MPI.Comm, mode: str, early: bool) -> None:
    (plain, dp), (over, do) = pair(Mixed, comm, mode, **SMALL)
    with dp, do:
        for step in range(3):
            rng = np.random.default_rng([3, step, comm.rank])
            x = torch.tensor(rng.integers(0, 17, size=(2, 5 + comm.rank)))
            if early:
                do.expect_weight(x.numel())
            for model, session in ((plain, dp), (over, do)):
                nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten(), reduction="sum").backward()
                session.reduce(local_weight=x.numel())
            assert over.low.weight.grad.dtype == torch.bfloat16
            # given before backward, the weights let the thread divide as it summed
            assert do._overlap.owner.divided == (sum(comm.allgather(x.numel())) if early and mode == "thread" else None)
            same_grads_everywhere(comm, plain, over)
            for model in (plain, over):
                model.zero_grad()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("early", [None, "zero", "real"])
def test_a_rank_of_weight_zero_counts_as_zeros_although_its_gradients_left(comm: MPI.Comm, mode: str, early: str | None) -> None:
    """Rank 0 runs a real backward but says it has no tokens: its gradients, already on their way, must not count.

    ``early``: the weights were also given before backward, rank 0's as 0 or (wrongly) as its real count.
    """
    (plain, dp), (over, do) = pair(TinyLM, comm, mode, **SMALL)
    with dp, do:
        for model, session in ((plain, dp), (over, do)):
            weight = window(comm, model, backward=False)
            if early and session is do:
                do.expect_weight(0 if comm.rank == 0 and early == "zero" else weight)
            window(comm, model)
            session.reduce(local_weight=0 if comm.rank == 0 else weight, policy=ZERO)
        same_grads_everywhere(comm, plain, over)


def test_a_weight_given_before_backward_that_reduce_contradicts_is_taken_again(comm: MPI.Comm, mode: str) -> None:
    """The global weight agreed at reduce decides; a different one given before backward only costs time."""
    (plain, dp), (over, do) = pair(TinyLM, comm, mode, **SMALL)
    with dp, do:
        for step in range(2):
            for model, session in ((plain, dp), (over, do)):
                weight = window(comm, model, backward=False)
                if session is do:
                    do.expect_weight(weight + 1 if comm.rank == step % comm.size else weight)
                window(comm, model)
                session.reduce(local_weight=weight, policy=ZERO)
                model.zero_grad()
            same_grads_everywhere(comm, plain, over)


@pytest.mark.parametrize("weight", [-1, 2.0, True])
def test_a_bad_weight_before_backward_is_an_error_everywhere_at_reduce(comm: MPI.Comm, where: tuple[bool, int], mode: str, weight: Any) -> None:
    mine, bad = where
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm, overlap=mode, **SMALL) as do:
        tokens = window(comm, model, backward=False)
        do.expect_weight(weight if mine else tokens)
        window(comm, model)
        before = grads(model)
        same_error_everywhere(
            comm, lambda: do.reduce(local_weight=tokens), ContractError,
            f"rank {bad}: expect_weight takes the local weight as a non-negative int, got {weight!r}",
        )
        assert grads(model) == before


@pytest.mark.parametrize("case", sorted(REDUCE_ERRORS))
def test_overlap_refuses_bad_input_on_every_rank_touches_nothing_and_recovers(comm: MPI.Comm, where: tuple[bool, int], case: str, mode: str) -> None:
    mine, bad = where
    spoil, policy, message = REDUCE_ERRORS[case]
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False, frozen=True), comm, mode, **SMALL)
    with dp, do:
        if mine:
            spoil(over)
        weight: Any = window(comm, over, backward=not (mine and case == "missing gradient"))
        if mine and case == "float weight":
            weight = torch.tensor(float(weight))
        before = grads(over)
        same_error_everywhere(comm, lambda: do.reduce(local_weight=weight, policy=policy), ContractError, f"rank {bad}: {message}")
        assert grads(over) == before
    if case in ("missing gradient", "float weight"):  # the session is fine: the next window matches the plain path
        (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False, frozen=True), comm, mode, **SMALL)
        with dp, do:
            for model, session in ((plain, dp), (over, do)):
                session.reduce(local_weight=window(comm, model))
            same_grads_everywhere(comm, plain, over)


def test_a_sparse_embedding_gradient_is_reduced_dense_like_the_plain_path(comm: MPI.Comm, mode: str) -> None:
    (plain, dp), (over, do) = pair(lambda seed: nn.Embedding(10, 3, sparse=True), comm, mode, **SMALL)
    with dp, do:
        for model, session in ((plain, dp), (over, do)):
            model(torch.tensor([comm.rank % 10, 9])).sum().backward()
            assert model.weight.grad.is_sparse
            session.reduce(local_weight=2)
        assert not over.weight.grad.is_sparse
        same_grads_everywhere(comm, plain, over)


def test_a_parameter_unused_everywhere_is_refused_under_error_then_absent_under_zero(comm: MPI.Comm, mode: str) -> None:
    (plain, dp), (over, do) = pair(TinyLM, comm, mode, **SMALL)
    with dp, do:
        weight = window(comm, over)
        before = grads(over)
        same_error_everywhere(comm, lambda: do.reduce(local_weight=weight), ContractError, "rank 0: parameter 'unused.bias' has no gradient")
        assert grads(over) == before
        do.reduce(local_weight=weight, policy=ZERO)
        dp.reduce(local_weight=window(comm, plain), policy=ZERO)
        assert over.unused.weight.grad is None
        same_grads_everywhere(comm, plain, over)


def test_a_second_backward_outside_no_sync_is_summed_again_like_the_plain_path(comm: MPI.Comm, mode: str) -> None:
    """Every slot is finished twice on the last rank: every rank sums every bucket again after backward (issue 32)."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    with dp, do:
        for step in range(2):
            for model, session in ((plain, dp), (over, do)):
                weight = window(comm, model)
                if comm.rank == comm.size - 1 and step == 0:
                    weight += window(comm, model)
                assert session.reduce(local_weight=weight) == sum(comm.allgather(weight))
            same_grads_everywhere(comm, plain, over)
            for model, session in ((plain, dp), (over, do)):
                session.zero_grad()


class Twice(nn.Module):
    """One block used twice in a forward, under reentrant activation checkpointing: its parameters finish twice."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(17, 8)
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 17)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(tokens)
        for _ in range(2):
            h = h + checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_module_used_twice_under_reentrant_checkpointing_equals_the_plain_path(comm: MPI.Comm, mode: str) -> None:
    (plain, dp), (over, do) = pair(Twice, comm, mode, **SMALL)
    with dp, do:
        for step in range(3):
            rng = np.random.default_rng([7, step, comm.rank])
            x = torch.tensor(rng.integers(0, 17, size=(2, 4 + comm.rank)))
            for model, session in ((plain, dp), (over, do)):
                nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten(), reduction="sum").backward()
                session.reduce(local_weight=x.numel())
            same_grads_everywhere(comm, plain, over)
            for model, session in ((plain, dp), (over, do)):
                session.zero_grad()


def halve_in_place(model: nn.Module) -> None:
    model.mix.weight.grad.mul_(0.5)


def halve_by_replacing(model: nn.Module) -> None:
    model.mix.weight.grad = model.mix.weight.grad * 0.5


def drop_one(model: nn.Module) -> None:
    model.norm.bias.grad = None


CHANGES = {"in place": halve_in_place, "replaced": halve_by_replacing, "set to None": drop_one}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("who", ["one", "every"])
def test_a_gradient_changed_between_backward_and_reduce_is_included_like_the_plain_path(comm: MPI.Comm, mode: str, change: str, who: str) -> None:
    """``.grad`` changed after its hook (its tensor or its version differ): the window is summed again (issue 32)."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    with dp, do:
        for step in range(2):
            for model, session in ((plain, dp), (over, do)):
                weight = window(comm, model)
                if step == 0 and (who == "every" or comm.rank == comm.size - 1):
                    CHANGES[change](model)
                session.reduce(local_weight=weight, policy=ZERO)
            same_grads_everywhere(comm, plain, over)
            for model, session in ((plain, dp), (over, do)):
                session.zero_grad()


def test_a_hook_added_after_wrapping_that_changes_the_gradient_is_included(comm: MPI.Comm, mode: str) -> None:
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    with dp, do:
        def quarter(p: torch.Tensor) -> None:
            p.grad.mul_(0.25)

        for model in (plain, over):
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(quarter)
        for model, session in ((plain, dp), (over, do)):
            session.reduce(local_weight=window(comm, model))
        same_grads_everywhere(comm, plain, over)


class Fails(torch.autograd.Function):
    """Identity forward; its backward raises (on the ranks that ask for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


class Breaks(TinyLM):
    """TinyLM whose backward raises halfway (after the head's gradient, before the embedding's) when ``broken``."""

    broken = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.broken:
            h = Fails.apply(h)
        h = h + torch.tanh(self.proj(h))
        return self.head(self.norm(h))


@TRANSPORT
def test_a_backward_that_raises_midway_on_one_rank_ends_in_an_error_everywhere_not_a_hang(comm: MPI.Comm, mode: str) -> None:
    model = Breaks(100, extras=False, tie=False)
    model.mix.requires_grad_(False)  # not in this forward
    with mpidp.torch.DataParallel(model, comm, overlap=mode, **SMALL) as do:
        model.broken = comm.rank == comm.size - 1
        try:
            weight = window(comm, model)
        except RuntimeError as e:
            assert "on purpose" in str(e)
            weight = 1
        assert model.head.weight.grad is not None  # the last layer's gradient was finished, its bucket started
        same_error_everywhere(comm, lambda: do.reduce(local_weight=weight), ContractError, f"rank {comm.size - 1}: a backward pass did not finish")
        model.broken = False
        model.zero_grad()
        do.reduce(local_weight=window(comm, model))  # the next window goes ahead


@TRANSPORT
def test_close_after_a_partial_window_on_some_ranks_does_not_hang(comm: MPI.Comm, mode: str) -> None:
    model = TinyLM(100, extras=False)
    do = mpidp.torch.DataParallel(model, comm, overlap=mode, **SMALL)
    if comm.rank % 2:
        window(comm, model)  # its buckets are in flight; the others started none
    do.close()
    do.close()
    with pytest.raises(ContractError, match="closed"):
        do.reduce(local_weight=1)


def test_no_sync_is_a_no_op_on_the_plain_path(comm: MPI.Comm) -> None:
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm) as dp:
        with dp.no_sync():
            weight = window(comm, model)
        weight += window(comm, model)
        dp.reduce(local_weight=weight)
        assert model.embed.weight.grad is not None


@pytest.mark.parametrize("bucket_bytes", [0, 2.5, True])
def test_a_bad_bucket_size_is_refused_on_every_rank(comm: MPI.Comm, where: tuple[bool, int], bucket_bytes: Any, mode: str) -> None:
    mine, bad = where
    model = TinyLM(100, extras=False)
    options = {"bucket_bytes": bucket_bytes} if mine else {}
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm, overlap=mode, **options), ContractError,
        f"rank {bad}: bucket_bytes must be an integer of at least 4, got {bucket_bytes!r}",
    )


# ------------------------------------------------------------- progress modes


def communication_threads() -> list[Any]:
    return [t for t in threading.enumerate() if t.name == "mpidp-communication"]


def test_thread_mode_runs_a_communication_thread_that_close_joins(comm: MPI.Comm) -> None:
    model = TinyLM(100, extras=False)
    do = mpidp.torch.DataParallel(model, comm, overlap="thread", **SMALL)
    assert do.overlap == "thread"
    do.reduce(local_weight=window(comm, model))
    assert len(communication_threads()) == 1  # started by the first bucket; asleep between windows
    do.close()
    assert communication_threads() == []


@TRANSPORT
@pytest.mark.parametrize("early", [False, True])
def test_the_last_bucket_is_summed_after_the_agreement_where_it_lies(comm: MPI.Comm, mode: str, early: bool) -> None:
    """The tail (what backward finishes last) is not summed during backward: in place in ``.grad``, once the window is agreed."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    owner = do._overlap.owner  # type: ignore[union-attr]
    state = owner._state
    tail = [i for i, fixed in enumerate(state.fixed) if fixed]
    assert tail and tail == sorted(state._slots[-1]) and len(state) > 1
    sizes = [v.size for v in owner.views(0)]
    by_thread: list[int] = []  # what the buckets' own communicator sums (the thread's calls, or the hooks' non-blocking ones)
    name = "Allreduce_into" if mode == "thread" else "Iallreduce"
    real = getattr(owner._engine.comm, name)
    setattr(owner._engine.comm, name, lambda send, recv, op: (by_thread.append(send.size), real(send, recv, op))[1])
    with dp, do:
        for step in range(3):
            by_thread.clear()
            for model, session in ((plain, dp), (over, do)):
                model.zero_grad()
                weight = window(comm, model)
                if early and session is do:
                    do.expect_weight(weight)
                session.reduce(local_weight=weight)
            same_grads_everywhere(comm, plain, over)
            if mode == "thread":  # the hooks leave to blocking calls what no rank started during backward
                assert sum(by_thread) == sum(sizes) - sum(sizes[i] for i in tail), step  # every bucket but the tail
            else:
                assert sum(by_thread) <= sum(sizes) - sum(sizes[i] for i in tail), step
            for i in tail:  # the tail's .grad is its send slot: summed and divided where it lies, no copy
                assert do._overlap.params[i].grad.data_ptr() == owner.views(0)[i].ctypes.data, (step, i)  # type: ignore[union-attr]


@TRANSPORT
@pytest.mark.parametrize("after", [False, True])
def test_an_exception_in_the_communication_thread_is_one_error_everywhere_then_it_recovers(
    comm: MPI.Comm, after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an MPI failure (the calls can still finish): the caller sums what the thread left; reduce raises everywhere.

    ``after``: the exception comes after MPI finished the call, in the thread's division (the call must not be
    made again).
    """
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, "thread", **SMALL)
    bad = comm.size - 1
    with dp, do:
        calls = iter(range(1000))
        if comm.rank == bad and not after:
            real = do._overlap.owner._engine.comm.Allreduce_into

            def failing(*args: Any) -> None:
                if next(calls) == 2:  # the third call, in backward
                    raise MemoryError("injected")
                real(*args)

            do._overlap.owner._engine.comm.Allreduce_into = failing
        if comm.rank == bad and after:

            class Casts:  # the one division by the global weight (mpidp.casts), failing in the thread's third
                def divide(self, *args: Any, **kwargs: Any) -> Any:
                    if next(calls) == 2:
                        raise MemoryError("injected")
                    return mpidp.casts.divide(*args, **kwargs)

            monkeypatch.setattr(mpidp.overlap.buckets, "casts", Casts())
        weight = window(comm, over, backward=False)
        if after:
            do.expect_weight(weight)  # the thread divides after each call
        window(comm, over)
        before = grads(over)
        same_error_everywhere(
            comm, lambda: do.reduce(local_weight=weight), ContractError, f"rank {bad}: the communication thread failed: MemoryError: injected"
        )
        assert grads(over) == before
        for model, session in ((plain, dp), (over, do)):  # a new thread sums the next window
            model.zero_grad()
            session.reduce(local_weight=window(comm, model))
        same_grads_everywhere(comm, plain, over)


def test_thread_mode_a_gradient_that_cannot_be_copied_at_reduce_is_one_error_everywhere(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    """With a thread, ``reduce`` fills and sends what backward left before the agreement: a fill that raises is agreed."""
    mine, bad = where
    (plain, dp), (over, do) = pair(TinyLM, comm, "thread", **SMALL)
    with dp, do:
        weight = window(comm, over)  # 'unused' gets no gradient: reduce fills its slot with zeros
        before = grads(over)
        if mine:

            def refuse(slot: int) -> None:
                raise RuntimeError("injected")

            do._overlap.fill = refuse  # type: ignore[union-attr]
        same_error_everywhere(
            comm, lambda: do.reduce(local_weight=weight, policy=ZERO), ContractError,
            f"rank {bad}: could not copy a gradient into its reduction bucket: RuntimeError: injected",
        )
        assert grads(over) == before
        if mine:
            del do._overlap.fill  # type: ignore[union-attr]
        for model, session in ((plain, dp), (over, do)):  # the buckets are clean: the next window is the plain path's
            model.zero_grad()
            session.reduce(local_weight=window(comm, model), policy=ZERO)
        same_grads_everywhere(comm, plain, over)


@pytest.mark.parametrize("ask", ["thread", True])
def test_without_thread_multiple_thread_mode_is_refused_everywhere_and_auto_uses_hooks(
    comm: MPI.Comm, where: tuple[bool, int], ask: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, bad = where
    if mine:
        monkeypatch.setattr(mpidp.comm, "thread_multiple", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(1024)), raising=False)  # cores to spare
    model = TinyLM(100, extras=False)
    if ask == "thread":
        same_error_everywhere(
            comm, lambda: mpidp.torch.DataParallel(model, comm, overlap=ask, **SMALL), ContractError,
            f"overlap='thread' needs MPI_THREAD_MULTIPLE, which MPI did not provide on rank(s) {bad}",
        )
        return
    with mpidp.torch.DataParallel(model, comm, overlap=ask, **SMALL) as do:
        assert do.overlap == "hooks"
        do.reduce(local_weight=window(comm, model))


@pytest.mark.parametrize("cores", [1, 1024])
def test_auto_takes_the_thread_only_where_every_node_has_a_core_to_spare(comm: MPI.Comm, cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34 item 3: where every core computes, ``overlap=True`` is the plain path (no hooks), with the plain path's results."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    model, plain = TinyLM(100, extras=False), TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm, overlap=True, **SMALL) as do, mpidp.torch.DataParallel(plain, comm, **SMALL) as dp:
        assert do.overlap == ("thread" if cores == 1024 else None)
        hooks = [len(p._post_accumulate_grad_hooks or {}) for p in dict.fromkeys(model.parameters())]
        assert hooks == [1] * len(hooks)  # each hooked once: overlap's hook or the plain path's
        for m, session in ((model, do), (plain, dp)):
            session.reduce(local_weight=window(comm, m))
        same_grads_everywhere(comm, plain, model)


@pytest.mark.mpi(min_size=2)
def test_ranks_asking_for_different_modes_are_refused_everywhere(comm: MPI.Comm) -> None:
    model = TinyLM(100, extras=False)
    mode = "thread" if comm.rank == 0 else "hooks"
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm, overlap=mode, **SMALL), ContractError,
        "ranks ask for different overlap progress modes: hooks, thread",
    )


@pytest.mark.parametrize("overlap", ["yes", 1, None])
def test_a_bad_overlap_value_is_refused_on_every_rank(comm: MPI.Comm, where: tuple[bool, int], overlap: Any) -> None:
    mine, bad = where
    model = TinyLM(100, extras=False)
    options = {"overlap": overlap} if mine else {}
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm, **options), ContractError,
        f"rank {bad}: overlap must be False, True, 'hooks' or 'thread', got {overlap!r}",
    )


# ------------------------------------------------- a rank in another operation


def clean_window(comm: MPI.Comm, plain: tuple[nn.Module, Any], over: tuple[nn.Module, Any]) -> None:
    """Zero both models' gradients, run one window on every rank, and compare: the session still works."""
    for model, session in (plain, over):
        session.zero_grad()
    for model, session in (plain, over):
        session.reduce(local_weight=window(comm, model))
    same_grads_everywhere(comm, plain[0], over[0])


@TRANSPORT
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backward", [False, True])
def test_a_rank_in_verify_replicas_while_the_others_reduce_is_one_error_everywhere_then_it_goes_on(
    comm: MPI.Comm, mode: str, backward: bool
) -> None:
    """Issue 32 item 1b: no rank waits for another's part of a bucket; the rank in verify_replicas catches and goes on.

    ``backward``: the last rank runs its backward too before it calls verify_replicas (a window it began).
    """
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    last = comm.rank == comm.size - 1
    with dp, do:
        if last and backward:
            window(comm, over)

        def step() -> None:
            if last:
                do.verify_replicas()
                return
            do.reduce(local_weight=window(comm, over))

        message = same_error_everywhere(comm, step, ContractError, "ranks are in different mpidp operations")
        assert f"rank {comm.size - 1} in verify_replicas" in message, message
        if last and backward:  # its window goes on: reduce what it began; the others join in with a window of their own
            do.zero_grad()
        clean_window(comm, (plain, dp), (over, do))
        clean_window(comm, (plain, dp), (over, do))


def test_verify_replicas_between_backward_and_reduce_on_every_rank_still_equals_the_plain_path(comm: MPI.Comm, mode: str) -> None:
    """Legal, if slow: the window's buckets end with the other operation, and reduce sends the gradients again."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    with dp, do:
        for model, session in ((plain, dp), (over, do)):
            weight = window(comm, model)
            session.verify_replicas()
            session.broadcast_buffers()
            session.reduce(local_weight=weight)
        same_grads_everywhere(comm, plain, over)
        clean_window(comm, (plain, dp), (over, do))


@TRANSPORT
@pytest.mark.mpi(min_size=2)
def test_a_rank_that_skips_reduce_in_a_join_loop_is_one_error_everywhere_then_it_goes_on(comm: MPI.Comm, mode: str) -> None:
    """The rank whose batches ran out forgets ``reduce(local_weight=0)``: it asks join while the others reduce."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, mode, **SMALL)
    last = comm.rank == comm.size - 1
    batches = [1] if last else [1, 2]
    with dp, do:

        def loop() -> None:
            for batch in do.join(batches):
                if batch is None:
                    continue  # the mistake: no reduce for this step
                do.reduce(local_weight=window(comm, over))
                do.zero_grad()

        message = same_error_everywhere(comm, loop, ContractError, "ranks are in different mpidp operations")
        assert f"rank {comm.size - 1} in join" in message, message
        clean_window(comm, (plain, dp), (over, do))


# ------------------------------------------------------------- small promises


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_expect_weight_takes_what_reduce_takes(comm: MPI.Comm, kind: str) -> None:
    """Issue 32 item 4: an integer tensor of one element or a NumPy integer, as ``reduce(local_weight=...)``."""
    (plain, dp), (over, do) = pair(lambda s: TinyLM(s, extras=False), comm, "thread", **SMALL)
    with dp, do:
        weight = window(comm, over, backward=False)
        do.expect_weight(torch.tensor(weight) if kind == "tensor" else np.int64(weight))
        for model, session in ((plain, dp), (over, do)):
            session.reduce(local_weight=window(comm, model))
        assert do._overlap.owner.divided == sum(comm.allgather(weight))  # taken: the thread divided as it summed
        same_grads_everywhere(comm, plain, over)


@pytest.mark.parametrize("ask", [False, "hooks", "thread"])
def test_the_mode_overlap_chose_is_a_public_attribute(comm: MPI.Comm, ask: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32 item 5: ``dp.overlap`` is "thread", "hooks" or None; ``overlap=True`` says what it picked."""
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm, overlap=ask, **SMALL) as do:
        assert do.overlap == (ask or None)
    for cores, picked in ((1, None), (1024, "thread")):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        with mpidp.torch.DataParallel(model, comm, overlap=True, **SMALL) as do:
            assert do.overlap == picked
