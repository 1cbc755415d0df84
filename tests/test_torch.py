"""mpidp.torch: a model trained over uneven shards equals one process over the whole batch.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import clean_env, first_ranks, same_error_everywhere, snapshot
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.nn.functional as F
from torch import nn

import mpidp.torch
from mpidp import ContractError, MissingGradientPolicy

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport

ZERO, ERROR = MissingGradientPolicy.ZERO, MissingGradientPolicy.ERROR
V, D, LATE = 17, 8, 6  # vocabulary, width, first position that uses TinyLM.late
IGNORE = -100
REL = 1e-5


class TinyLM(nn.Module):
    """A causal LM: embedding tied to the output head, a two-token mixer, a residual layer.

    With ``extras``, ``late`` is added at positions >= LATE only (a rank whose
    batch is short never uses it) and ``unused`` is never used at all.
    """

    def __init__(self, seed: int, *, extras: bool = True, frozen: bool = False, width: int = D, tie: bool = True) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(V, D)
            self.mix = nn.Linear(2 * D, width)
            self.proj = nn.Linear(width, D)  # (a width other than D only makes a mismatching replica)
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            self.late = nn.Parameter(torch.randn(D) * 0.1) if extras else None
            self.unused = nn.Linear(D, D) if extras else None
        if tie:
            self.head.weight = self.embed.weight
        if frozen:
            self.proj.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]  # the previous token (causal: pads come last)
        h = torch.tanh(self.mix(torch.cat([h, prev], -1)))
        if self.late is not None and h.shape[1] > LATE:
            h = torch.cat([h[:, :LATE], h[:, LATE:] + self.late], 1)
        h = h + torch.tanh(self.proj(h))
        return self.head(self.norm(h))


Seq = tuple[list[int], list[int]]


def sequence(rng: np.random.Generator, length: int, scored: bool = True) -> Seq:
    """Random tokens and next-token labels; a prompt of 0-2 tokens (or everything) is not scored."""
    tokens = rng.integers(0, V, size=length).tolist()
    labels = tokens[1:] + [IGNORE]
    for i in range(int(rng.integers(0, 3)) if scored else length):
        labels[i] = IGNORE
    return tokens, labels


def pad(seqs: list[Seq]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for t, _ in seqs)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, (t, lab) in enumerate(seqs):
        x[i, : len(t)] = torch.tensor(t)
        y[i, : len(lab)] = torch.tensor(lab)
    return x, y


def shards(step: int, size: int) -> list[list[Seq]]:
    """One global batch of ragged sequences, split unevenly over ``size`` ranks.

    Rank 0 holds short sequences only (it never uses ``late``); the middle
    ranks hold 2, 4, ... long ones; the last rank holds no scored token (on
    even steps sequences whose labels are all ignored, on odd steps nothing).
    """
    rng = np.random.default_rng([7, step])
    middle = max(size - 2, 0)
    short = [sequence(rng, int(rng.integers(3, LATE + 1))) for _ in range(2)]
    long = [sequence(rng, int(rng.integers(LATE + 2, 15))) for _ in range(max(middle * (middle + 1), 3))]
    idle = [sequence(rng, int(rng.integers(2, 12)), scored=False) for _ in range(2)] if step % 2 == 0 else []
    if size == 1:
        return [short + long + idle]
    out = [short + (long if middle == 0 else [])]
    start = 0
    for k in range(1, middle + 1):
        out.append(long[start : start + 2 * k])
        start += 2 * k
    return out + [idle]


def micro_batches(seqs: list[Seq], count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for part in np.array_split(np.arange(len(seqs)), count):
        if part.size:
            yield pad([seqs[i] for i in part])


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":  # momentum: a wrong gradient scale changes the result
        return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum")


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = REL) -> None:
    """Every tensor within ``rel`` of the reference, relative to the reference's largest entry."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        err = float((got[name].double() - w.double()).abs().max())
        scale = float(w.double().abs().max())
        assert err <= rel * scale, f"{name}: max error {err:.3g} vs max |value| {scale:.3g}"


def bitwise_equal_everywhere(comm: MPI.Comm, model: nn.Module) -> None:
    mine = snapshot(dict(model.state_dict()))
    every = comm.allgather(mine)
    differ = [r for r, s in enumerate(every) if s != every[0]]
    assert not differ, f"ranks {differ} differ from rank 0"


# ------------------------------------------------- the property that sells it


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("flat", [False, True], ids=["", "flat_parameters"])
def test_uneven_shards_equal_one_process_over_the_whole_batch(comm: MPI.Comm, kind: str, accumulate: int, flat: bool) -> None:
    size, rank, root = comm.size, comm.rank, comm.size - 1
    steps = 4
    model = TinyLM(100 + rank, frozen=True)  # every rank its own init: root's is broadcast
    opt = optimizer(kind, model)  # created before the wrapper: the broadcast is in place
    frozen_before = snapshot(dict(TinyLM(100 + root, frozen=True).proj.state_dict()))
    with mpidp.torch.DataParallel(model, comm, root=root, flat_parameters=flat) as dp:
        assert model.head.weight is model.embed.weight
        for step in range(steps):
            tokens = 0
            for x, y in micro_batches(shards(step, size)[rank], accumulate):
                loss_sum(model, x, y).backward()  # .grad accumulates over the micro-batches
                tokens += int((y != IGNORE).sum())
            weight: Any = torch.tensor(tokens) if rank % 2 else tokens  # an int or an integer tensor
            global_weight = dp.reduce(local_weight=weight, policy=ZERO)
            assert global_weight == sum(comm.allgather(tokens))
            assert model.late.grad is not None  # unused on rank 0, used elsewhere: a zero contribution
            assert model.unused.weight.grad is None and model.unused.bias.grad is None  # unused everywhere
            assert model.proj.weight.grad is None  # frozen
            opt.step()
            opt.zero_grad()
        dp.verify_replicas()
    bitwise_equal_everywhere(comm, model)

    reference = TinyLM(100 + root, frozen=True)
    ref_opt = optimizer(kind, reference)
    for step in range(steps):
        x, y = pad([s for shard in shards(step, size) for s in shard])
        F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()  # the token mean
        ref_opt.step()
        ref_opt.zero_grad()
    assert_close(state(model), state(reference))
    assert snapshot(dict(model.proj.state_dict())) == frozen_before
    assert snapshot(dict(model.unused.state_dict())) == snapshot(dict(reference.unused.state_dict()))


def join_shards(size: int) -> list[list[list[Seq]]]:
    """Per rank, its batches of 1-3 sequences: 3, 0, 5 and 2 of them (the second rank has no data at all)."""
    counts = [3, 0, 5, 2][:size] if size > 1 else [4]
    rng = np.random.default_rng(17)
    return [[[sequence(rng, int(rng.integers(3, 12))) for _ in range(int(rng.integers(1, 4)))] for _ in range(n)] for n in counts]


def train_with_join(comm: MPI.Comm) -> None:
    """AdamW over uneven shards with dp.join: replicas bitwise equal, and equal to one process over the same batches."""
    size, rank = comm.size, comm.rank
    shards = join_shards(size)
    model = TinyLM(100 + rank, extras=False)
    opt = optimizer("adamw", model)
    steps = 0
    with mpidp.torch.DataParallel(model, comm) as dp:
        for step, batch in enumerate(dp.join(shards[rank])):
            tokens = 0
            if batch is not None:
                x, y = pad(batch)
                loss_sum(model, x, y).backward()
                tokens = int((y != IGNORE).sum())
            dp.reduce(local_weight=tokens, step=step)  # weight 0 and no .grad where batch is None
            opt.step()
            dp.zero_grad()
            steps += 1
        dp.verify_replicas()
    assert steps == max(len(s) for s in shards)
    bitwise_equal_everywhere(comm, model)
    reference = TinyLM(100, extras=False)
    ref_opt = optimizer("adamw", reference)
    for step in range(steps):
        x, y = pad([seq for shard in shards if step < len(shard) for seq in shard[step]])
        F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_close(state(model), state(reference))


def test_join_trains_uneven_shards_as_one_process(comm: MPI.Comm) -> None:
    train_with_join(comm)


@pytest.mark.mpi(min_size=4)
def test_join_trains_uneven_shards_at_three_ranks(comm: MPI.Comm) -> None:
    with first_ranks(comm, 3) as three:
        if three is not None:
            train_with_join(three)


def test_equal_shards_match_distributed_data_parallel(comm: MPI.Comm) -> None:
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    folder = comm.bcast(tempfile.mkdtemp(prefix="mpidp-ddp-") if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=comm.rank, world_size=comm.size)
    try:
        steps, rank = 3, comm.rank
        ddp = nn.parallel.DistributedDataParallel(TinyLM(100 + rank, extras=False))  # rank 0's init
        model = TinyLM(100 + rank, extras=False)
        dp = mpidp.torch.DataParallel(model, comm)  # rank 0's init
        opts = optimizer("sgd", ddp), optimizer("sgd", model)  # created after the wrapper
        for step in range(steps):
            lengths = np.random.default_rng([8, step]).integers(3, 14, size=3)  # equal on every rank
            rng = np.random.default_rng([9, step, rank])
            x, y = pad([(rng.integers(0, V, size=n).tolist(), rng.integers(0, V, size=n).tolist()) for n in lengths])
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()  # DDP: local mean, averaged over ranks
            loss_sum(model, x, y).backward()  # mpidp: local sum, divided by the global token count
            dp.reduce(local_weight=int((y != IGNORE).sum()))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        dp.close()
        assert_close(state(model), state(ddp.module))
        bitwise_equal_everywhere(comm, model)
    finally:
        dist.destroy_process_group()
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------- what the window does


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gradients_are_summed_in_float32_and_written_in_place(comm: MPI.Comm, dtype: torch.dtype) -> None:
    model = TinyLM(100 + comm.rank, extras=False).to(dtype)
    with mpidp.torch.DataParallel(model, comm) as dp:
        rng = np.random.default_rng([3, comm.rank])
        x, y = pad([sequence(rng, int(rng.integers(3, 12))) for _ in range(2 + comm.rank)])
        loss_sum(model, x, y).backward()
        params = dict(model.named_parameters())  # one name per tie group
        held = {n: p.grad for n, p in params.items()}
        local = {n: g.float().numpy() for n, g in held.items()}
        tokens = int((y != IGNORE).sum())
        weight = dp.reduce(local_weight=tokens)
        every = comm.allgather(local)
        eps = torch.finfo(dtype).eps
        for name, p in params.items():
            assert p.grad is held[name] and p.grad.dtype == dtype  # in place, dtype kept
            total = np.sum([e[name] for e in every], axis=0, dtype=np.float32) / np.float32(weight)
            expected = torch.from_numpy(total).to(dtype).float()
            # within one 16-bit rounding of the float32 mean (MPI may add in another order)
            torch.testing.assert_close(p.grad.float(), expected, rtol=eps, atol=1e-7)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        dp.verify_replicas()

        for p in model.parameters():  # a sum that overflows float16 if summed in 16 bits
            p.grad = torch.full_like(p, 40000.0)
        dp.reduce(local_weight=1)
        for p in model.parameters():
            assert p.grad is not None and torch.equal(p.grad, torch.full_like(p, 40000.0))


class BatchNormNet(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def buffers(model: nn.Module) -> dict[str, bytes]:
    return snapshot(dict(model.named_buffers()))


def test_batchnorm_buffers_are_broadcast_at_construction_then_local(comm: MPI.Comm) -> None:
    rank, root = comm.rank, comm.size - 1
    model = BatchNormNet(rank)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(rank + 1):  # every rank its own running statistics and num_batches_tracked
        model(torch.randn(5, 4, generator=gen))
    expected = comm.allgather((snapshot(dict(model.named_parameters())), buffers(model)))[root]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with mpidp.torch.DataParallel(model, comm, root=root) as dp:
        assert (snapshot(dict(model.named_parameters())), buffers(model)) == expected
        assert int(model.body[1].num_batches_tracked) == root + 1  # the integer buffer, too
        for _ in range(2):
            x = torch.randn(3 + rank, 4, generator=gen)
            model(x).sum().backward()
            dp.reduce(local_weight=x.shape[0])
            opt.step()
            opt.zero_grad()
        dp.verify_replicas()  # parameters stay bitwise equal; buffers are not compared
        assert int(model.body[1].num_batches_tracked) == root + 3
        local = comm.allgather(buffers(model))
        if comm.size > 1:
            assert local[0] != local[root]  # running statistics follow each rank's own data
        dp.broadcast_buffers()
        assert buffers(model) == local[root]


@pytest.mark.mpi(min_size=2)
def test_a_gradient_only_a_rank_without_tokens_has_becomes_none(comm: MPI.Comm) -> None:
    model = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 1)})
    idle = comm.rank == comm.size - 1
    with mpidp.torch.DataParallel(model, comm) as dp:
        x = torch.ones(2, 3)
        model["a"](x).sum().backward()
        if idle:
            model["b"](x).sum().backward()  # a gradient, but of a rank whose weight is 0: ignored
        assert dp.reduce(local_weight=0 if idle else 2, policy=ZERO) == 2 * (comm.size - 1)
        assert model["b"].weight.grad is None and model["b"].bias.grad is None  # globally absent, on every rank
        # 2 per weighted rank over a global weight of 2 per weighted rank; the idle rank's 2 counts as zero
        torch.testing.assert_close(model["a"].bias.grad, torch.ones(1))


def test_a_sparse_embedding_gradient_is_reduced_dense(comm: MPI.Comm) -> None:
    model = nn.Embedding(10, 3, sparse=True)
    with mpidp.torch.DataParallel(model, comm) as dp:
        model(torch.tensor([comm.rank % 10, 9])).sum().backward()
        assert model.weight.grad is not None and model.weight.grad.is_sparse
        dp.reduce(local_weight=2)
        expected = torch.zeros(10, 3)
        for r in range(comm.size):
            expected[r % 10] += 1
        expected[9] += comm.size
        assert not model.weight.grad.is_sparse
        torch.testing.assert_close(model.weight.grad, expected / (2 * comm.size))


def test_reduce_allocates_no_model_sized_memory_after_the_first_window(comm: MPI.Comm) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 8))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    idle = comm.size > 1 and comm.rank == comm.size - 1  # no tokens, no backward: lent persistent zeros
    x = torch.randn(4, 256)
    with mpidp.torch.DataParallel(model, comm) as dp:
        for window in range(2):
            if not idle:
                model(x).sum().backward()
            held = [p.grad for p in model.parameters()]
            tracemalloc.start()
            try:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    dp.reduce(local_weight=0 if idle else 4)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            torch_bytes = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
            if not idle:
                assert all(p.grad is g for p, g in zip(model.parameters(), held))  # reduced in place
            model.zero_grad(set_to_none=True)
        assert peak < model_bytes / 8, (peak, model_bytes)
        assert torch_bytes < model_bytes / 8, (torch_bytes, model_bytes)


def test_import_mpidp_imports_neither_torch_nor_ml_dtypes_nor_the_examples() -> None:
    """Nor ml_dtypes (about a second of CPU per rank in 0.7), until a bfloat16 array or checkpoint needs it; then the
    dtype is ml_dtypes' own."""
    code = (
        "import sys, mpidp, mpidp.checkpoint, mpidp.optim, mpidp.torch\n"
        "loaded = [m for m in ('torch', 'mpidp.examples', 'ml_dtypes') if m in sys.modules]\n"
        "assert loaded == ['torch'], loaded\n"
        "import ml_dtypes, numpy as np\n"
        "assert mpidp.arrays.bfloat16() == np.dtype(ml_dtypes.bfloat16) == mpidp.arrays.BFLOAT16\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())
    code = (
        "import sys, mpidp\n"
        "loaded = [m for m in ('torch', 'mpidp.torch', 'mpidp.examples', 'ml_dtypes') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())


# ---------------------------------------------------------------- consensus errors


class Counter(nn.Module):
    """A module with an integer buffer."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros((), dtype=dtype))


BAD_MODELS: dict[str, tuple[Callable[[int], Any], str]] = {
    "not a module": (lambda seed: {"w": torch.zeros(3)}, "model must be a torch.nn.Module, got dict"),
    "float64": (lambda seed: TinyLM(seed).double(), "parameter 'embed.weight': dtype float64 is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_construction_refuses_a_bad_model_on_every_rank(comm: MPI.Comm, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    make, message = BAD_MODELS[case]
    model = make(comm.rank) if mine else TinyLM(comm.rank)
    before = snapshot(dict(model.state_dict())) if isinstance(model, nn.Module) else None
    same_error_everywhere(comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError, f"rank {bad}: {message}")
    if before is not None:
        assert snapshot(dict(model.state_dict())) == before


MISMATCHES: dict[str, tuple[Callable[[int], nn.Module], Callable[[int], nn.Module], str]] = {
    "shape": (TinyLM, lambda s: TinyLM(s, width=D + 1), "parameter 'mix.bias': shape (9,) differs from (8,)"),
    "extra parameter": (lambda s: TinyLM(s, extras=False), TinyLM, "entry 2 is 'late', expected 'mix.bias'"),
    "untied": (TinyLM, lambda s: TinyLM(s, tie=False), "parameter 'head.weight': untied, expected tied to 'embed.weight'"),
    "frozen": (TinyLM, lambda s: TinyLM(s, frozen=True), "parameter 'proj.bias': trainable False differs from True"),
    "buffer dtype": (
        lambda s: Counter(torch.int64), lambda s: Counter(torch.int32),
        "buffer 'count' is int32 of shape (), on rank 0 int64 of shape ()",
    ),
    "missing buffer": (
        lambda s: Counter(torch.int64), lambda s: TinyLM(s),
        "0 buffers, rank 0 has 1 (missing 'count')",
    ),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_construction_names_the_first_difference_and_moves_nothing(comm: MPI.Comm, case: str) -> None:
    good, bad, message = MISMATCHES[case]
    last = comm.size - 1
    model = bad(comm.rank) if comm.rank == last else good(comm.rank)
    before = snapshot(dict(model.state_dict()))
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError, f"rank {last} differs from rank 0: {message}"
    )
    assert snapshot(dict(model.state_dict())) == before  # parameters and buffers untouched


def test_flat_parameters_move_the_data_into_one_buffer_and_keep_the_parameters(comm: MPI.Comm) -> None:
    model = TinyLM(3 + comm.rank, frozen=True)
    model.norm.to(torch.bfloat16)  # a second dtype: a second buffer
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = snapshot({n: p for n, p in TinyLM(3, frozen=True).named_parameters(remove_duplicate=False)})
    with mpidp.torch.DataParallel(model, comm, flat_parameters=True):
        assert dict(model.named_parameters(remove_duplicate=False)) == params  # the same Parameter objects
        assert model.head.weight is model.embed.weight
        storages = {p.dtype: set() for p in params.values()}
        for p in params.values():
            storages[p.dtype].add(p.untyped_storage().data_ptr())
        assert {d: len(s) for d, s in storages.items()} == {torch.float32: 1, torch.bfloat16: 1}
        got = snapshot({n: p for n, p in params.items() if p.dtype == torch.float32})
        assert got == {n: v for n, v in expected.items() if n in got}  # root's values


@pytest.mark.mpi(min_size=2)
def test_flat_parameters_are_put_back_when_construction_fails(comm: MPI.Comm) -> None:
    last = comm.size - 1
    model = TinyLM(comm.rank, width=D + (comm.rank == last))
    before = {n: (p.data_ptr(), p.data) for n, p in model.named_parameters()}
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm, flat_parameters=True), ContractError, f"rank {last} differs from rank 0"
    )
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == {n: ptr for n, (ptr, _) in before.items()}


def grads(model: nn.Module) -> dict[str, Any]:
    """Every parameter's .grad bytes, or None."""
    return {n: None if p.grad is None else snapshot({n: p.grad})[n] for n, p in model.named_parameters()}


def window(comm: MPI.Comm, model: nn.Module, backward: bool = True) -> int:
    """Run one backward pass on a batch long enough to use every parameter but ``unused``."""
    rng = np.random.default_rng([5, comm.rank])
    x, y = pad([sequence(rng, 12) for _ in range(2)])
    if backward:
        loss_sum(model, x, y).backward()
    return int((y != IGNORE).sum())


REDUCE_ERRORS: dict[str, tuple[Callable[[nn.Module], None], Any, str]] = {
    "missing gradient": (lambda m: None, ERROR, "parameter 'embed.weight' has no gradient (policy ERROR, local weight"),
    "replaced parameter": (
        lambda m: setattr(m.mix, "weight", nn.Parameter(m.mix.weight.detach().clone())), ERROR,
        "parameter 'mix.weight' was replaced or removed after initialize",
    ),
    "gradient of a frozen parameter": (lambda m: m.proj.requires_grad_(True), ERROR, "gradient for frozen parameter 'proj.bias'"),
    "float weight": (lambda m: None, ERROR, "local_weight must be a non-negative int, got Tensor"),
}


@pytest.mark.parametrize("case", sorted(REDUCE_ERRORS))
def test_reduce_refuses_bad_input_on_every_rank_and_touches_nothing(comm: MPI.Comm, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    spoil, policy, message = REDUCE_ERRORS[case]
    model = TinyLM(100, extras=False, frozen=True)
    with mpidp.torch.DataParallel(model, comm) as dp:
        if mine:
            spoil(model)
        weight: Any = window(comm, model, backward=not (mine and case == "missing gradient"))
        if mine and case == "float weight":
            weight = torch.tensor(float(weight))
        before = snapshot(dict(model.state_dict())), grads(model)
        same_error_everywhere(comm, lambda: dp.reduce(local_weight=weight, policy=policy), ContractError, f"rank {bad}: {message}")
        assert (snapshot(dict(model.state_dict())), grads(model)) == before


def test_reduce_refuses_a_parameter_unused_everywhere_under_error(comm: MPI.Comm) -> None:
    model = TinyLM(100)
    with mpidp.torch.DataParallel(model, comm) as dp:
        weight = window(comm, model)
        before = grads(model)
        same_error_everywhere(
            comm, lambda: dp.reduce(local_weight=weight), ContractError,
            "rank 0: parameter 'unused.bias' has no gradient", "pass policy=MissingGradientPolicy.ZERO",
        )
        assert grads(model) == before
        dp.reduce(local_weight=weight, policy=ZERO)  # the next window, legitimately unused
        assert model.unused.weight.grad is None and model.embed.weight.grad is not None


def _resize_embedding(model: nn.Module) -> None:
    """What Hugging Face's ``resize_token_embeddings`` does: new rows, the same Parameter, ``.data`` swapped."""
    w = model.embed.weight
    w.data = torch.cat([w.data, torch.zeros(3, D)])


MODEL_CHANGES: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "cast": (lambda m: m.to(torch.bfloat16), "(dtype bfloat16 was float32)"),
    "resize": (_resize_embedding, f"parameter 'embed.weight' changed after initialize (shape ({V + 3}, {D}) was ({V}, {D}))"),
}


@pytest.mark.parametrize("flat", [False, True], ids=["", "flat_parameters"])
@pytest.mark.parametrize("case", sorted(MODEL_CHANGES))
def test_a_model_changed_after_wrapping_is_refused_by_reduce_not_backward(
    comm: MPI.Comm, where: tuple[bool, int], case: str, flat: bool
) -> None:
    """The gradient hook never raises inside backward(); reduce names the parameter on every rank."""
    mine, bad = where
    change, message = MODEL_CHANGES[case]
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm, flat_parameters=flat) as dp:
        window(comm, model)
        dp.reduce(local_weight=1)  # the gradients live in mpidp's flat storage now
        model.zero_grad()  # set_to_none, as optimizer.zero_grad() does (a stale .grad of the old shape: torch's own error)
        if mine:
            change(model)
        weight = window(comm, model)  # backward() runs, whatever the model became
        before = snapshot(dict(model.state_dict())), grads(model)
        same_error_everywhere(
            comm, lambda: dp.reduce(local_weight=weight), ContractError, f"rank {bad}: parameter ", message,
            "; build a new DataParallel after changing the model",
        )
        assert (snapshot(dict(model.state_dict())), grads(model)) == before


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True])
def test_reduce_passes_the_step_to_the_exchange(comm: MPI.Comm, overlap: bool) -> None:
    """The optimizer's step count (an int or an integer tensor) catches a rank that skipped a reduce."""
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm, overlap=overlap, bucket_bytes=256 if overlap else None) as dp:
        weight = window(comm, model)
        dp.reduce(local_weight=weight, step=torch.tensor(0) if comm.rank % 2 else 0)
        last = comm.size - 1
        before = grads(model)
        same_error_everywhere(
            comm, lambda: dp.reduce(local_weight=weight, step=2 if comm.rank == last else 1), ContractError,
            f"rank {last} is at step 2, rank 0 at step 1: a rank skipped or repeated a reduce",
        )
        assert grads(model) == before


def test_reduce_refuses_a_zero_global_weight(comm: MPI.Comm) -> None:
    model = TinyLM(100, extras=False)
    with mpidp.torch.DataParallel(model, comm) as dp:
        same_error_everywhere(comm, lambda: dp.reduce(local_weight=0), ContractError, "the global weight is 0")
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.mpi(min_size=2)
def test_broadcast_buffers_refuses_buffers_that_changed_on_one_rank(comm: MPI.Comm) -> None:
    model = BatchNormNet(0)
    with mpidp.torch.DataParallel(model, comm) as dp:
        if comm.rank == comm.size - 1:
            model.body[1].running_mean = torch.zeros(9)
        before = buffers(model)
        same_error_everywhere(
            comm, dp.broadcast_buffers, ContractError,
            f"rank {comm.size - 1} differs from rank 0: buffer 'body.1.running_mean' is float32 of shape (9,)",
        )
        assert buffers(model) == before


@pytest.mark.mpi(min_size=2)
def test_broadcast_buffers_on_one_rank_and_reduce_on_the_others_raise_everywhere(comm: MPI.Comm) -> None:
    """One session, one communicator: ranks out of step between the two are told so, not left waiting."""
    model = BatchNormNet(0)
    with mpidp.torch.DataParallel(model, comm) as dp:
        last = comm.size - 1
        call = dp.broadcast_buffers if comm.rank == last else (lambda: dp.reduce(local_weight=1, policy=ZERO))
        same_error_everywhere(
            comm, call, ContractError, f"ranks are in different mpidp operations: rank 0 in reduce, rank {last} in broadcast_buffers"
        )
        dp.broadcast_buffers()  # in step again: the session is still usable
        assert dp._core._comm.comm.Compare(comm) == MPI.CONGRUENT  # the one duplicate the adapter uses
        assert not hasattr(dp, "_comm") and not hasattr(dp, "_watchdog")  # and none of its own


class SharedBuffers(nn.Module):
    """Two buffer names, one tensor (``shared``) or two."""

    def __init__(self, shared: bool, fill: float) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        a = torch.full((4,), fill)
        self.register_buffer("a", a)
        self.register_buffer("b", a if shared else torch.full((4,), fill))


def test_shared_buffers_are_broadcast_once_and_stay_shared(comm: MPI.Comm) -> None:
    model = SharedBuffers(shared=True, fill=float(comm.rank))
    with mpidp.torch.DataParallel(model, comm) as dp:
        assert bool((model.a == 0).all())
        model.a.fill_(comm.rank + 5.0)  # both names
        dp.broadcast_buffers()
        assert bool((model.b == 5.0).all())


@pytest.mark.mpi(min_size=2)
def test_buffers_shared_on_one_rank_only_are_refused_on_every_rank(comm: MPI.Comm) -> None:
    """Which names share a tensor is agreed like shapes and dtypes: the bytes broadcast depend on it."""
    model = SharedBuffers(shared=comm.rank == 0, fill=float(comm.rank))
    before = buffers(model)
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError,
        "rank 1 differs from rank 0: buffer 'b' is a tensor of its own, on rank 0 the same tensor as 'a'",
    )
    assert buffers(model) == before


def test_a_buffer_one_rank_cannot_read_is_refused_on_every_rank(comm: MPI.Comm) -> None:
    """A sparse buffer on one rank: the same ContractError everywhere, at construction and in broadcast_buffers."""
    last = comm.size - 1
    message = f"rank {last}: buffer 'odd': it is a torch.sparse_coo tensor; pass a dense one (.to_dense())"
    model = BatchNormNet(0)
    model.register_buffer("odd", torch.eye(3).to_sparse() if comm.rank == last else torch.eye(3))
    same_error_everywhere(comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError, message)
    model.odd = torch.eye(3)
    with mpidp.torch.DataParallel(model, comm) as dp:
        if comm.rank == last:
            model.odd = torch.eye(3).to_sparse()
        same_error_everywhere(comm, dp.broadcast_buffers, ContractError, message)


def test_a_buffer_one_rank_cannot_write_in_place_is_refused_on_every_rank(comm: MPI.Comm) -> None:
    """An expanded buffer (its elements share memory) on one rank: refused before any byte moves, on every rank."""
    last = comm.size - 1
    model = BatchNormNet(0)
    model.register_buffer("z", torch.full((1,), 7.0).expand(4) if comm.rank == last else torch.full((4,), 7.0))
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError,
        f"rank {last}: buffer 'z': its elements overlap in memory (shape (4,), strides (0,)",
    )
    model.z = torch.full((4,), float(comm.rank))
    with mpidp.torch.DataParallel(model, comm) as dp:
        if comm.rank == last:
            model.z = torch.full((1,), float(comm.rank)).expand(4)
        before = {n: b.clone() for n, b in model.named_buffers()}
        same_error_everywhere(comm, dp.broadcast_buffers, ContractError, f"rank {last}: buffer 'z': its elements overlap in memory")
        assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())  # nothing modified, on any rank


def test_broadcast_buffers_after_close_says_so_on_every_rank(comm: MPI.Comm) -> None:
    dp = mpidp.torch.DataParallel(BatchNormNet(0), comm)
    dp.close()
    same_error_everywhere(comm, dp.broadcast_buffers, ContractError, "this DataParallel is closed")


def _lazy(module: type[nn.Module], *args: Any) -> nn.Module:
    import warnings

    with warnings.catch_warnings():  # "Lazy modules are a new feature under heavy development"
        warnings.simplefilter("ignore")
        return module(*args)


def test_flat_parameters_failing_on_one_rank_is_an_error_on_every_rank(comm: MPI.Comm) -> None:
    """Laying parameters out flat fails on one rank (an uninitialized lazy layer): every rank raises, the rest are put back."""
    last = comm.size - 1
    model = nn.Sequential(nn.Linear(3, 4), _lazy(nn.LazyLinear, 2) if comm.rank == last else nn.Linear(4, 2))
    before = {n: p.data_ptr() for n, p in model.named_parameters()} if comm.rank != last else None
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm, flat_parameters=True), ContractError,
        f"rank {last}: could not lay the parameters out flat (flat_parameters=True): ValueError",
    )
    if before is not None:
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # p.data put back


def test_an_uninitialized_buffer_on_one_rank_is_an_error_on_every_rank(comm: MPI.Comm) -> None:
    last = comm.size - 1
    model = nn.Sequential(nn.Linear(3, 3), _lazy(nn.LazyBatchNorm1d) if comm.rank == last else nn.BatchNorm1d(3))
    same_error_everywhere(
        comm, lambda: mpidp.torch.DataParallel(model, comm), ContractError, f"rank {last}: could not read buffer '1.running_mean': RuntimeError: Can't access the shape"
    )


def test_load_state_dict_after_the_wrapper_keeps_working(comm: MPI.Comm) -> None:
    """Restoring a checkpoint after construction copies in place: the wrapper still sees the module's tensors."""
    model = TinyLM(100 + comm.rank, extras=False)
    saved = {k: v.clone() for k, v in TinyLM(7, extras=False).state_dict().items()}
    with mpidp.torch.DataParallel(model, comm) as dp:
        model.load_state_dict(saved)  # in place: the wrapper's tensors are the module's
        dp.verify_replicas()
        tokens = window(comm, model)
        dp.reduce(local_weight=tokens)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        dp.verify_replicas()



def test_a_flat_storage_gradient_whose_storage_was_swapped_is_reduced_where_it_is_now(comm: MPI.Comm) -> None:
    """``grad.data = other`` moves a tensor's memory under the same object: the new memory is reduced."""
    params = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        bufs = dp.gradient_buffers()
        bufs["w"].fill_(1.0)
        bufs["b"].fill_(1.0)
        dp.reduce(bufs, 1)  # prepares and accepts the flat-storage views
        swapped = torch.full((1000,), float(comm.rank + 1))
        bufs["w"].data = swapped
        bufs["b"].fill_(float(comm.rank))
        out = dp.reduce(bufs, 2).gradients  # weight 2: even one rank's result differs from its input
        total = torch.tensor(sum(range(1, comm.size + 1)), dtype=torch.float32) / (2 * comm.size)
        assert out["w"] is bufs["w"]
        assert torch.equal(bufs["w"], total.expand(1000)), bufs["w"][:4]
        assert torch.equal(out["b"], (torch.tensor(sum(range(comm.size)), dtype=torch.float32) / (2 * comm.size)).expand(10))


def _flat_storage_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].to(torch.bfloat16)  # two dtypes: two flat buffers
    return model


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g)
    h = model[1](model[0](x)).to(torch.bfloat16)
    model[2](h).float().sum().backward()


def _grads_in(dp: Any) -> dict[str, bool]:
    """Which trainable .grad tensors are mpidp's flat-storage views."""
    return {n: p.grad is dp._grads[n] for n, p in dp.module.named_parameters()}


def test_grads_live_in_flat_storage_through_accumulation_and_zero_grad(comm: MPI.Comm) -> None:
    model = _flat_storage_model()
    with mpidp.torch.DataParallel(model, comm) as dp:
        reference = _flat_storage_model()
        _backward(model, 1)
        _backward(reference, 1)
        assert all(_grads_in(dp).values()), _grads_in(dp)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
        _backward(model, 2)  # a second micro-batch accumulates in place
        _backward(reference, 2)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
        dp.reduce(10)
        assert all(_grads_in(dp).values())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()  # set_to_none: the next backward allocates, the hook moves it back
        assert all(p.grad is None for p in model.parameters())
        reference.zero_grad()
        _backward(model, 3)
        _backward(reference, 3)
        assert all(_grads_in(dp).values())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
        dp.zero_grad()
        assert all(_grads_in(dp).values())
        assert all(not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    _backward(model, 4)  # closed: .grad is autograd's own again
    assert not any(_grads_in(dp).values())
