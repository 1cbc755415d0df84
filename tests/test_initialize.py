"""DataParallel.initialize on named NumPy arrays: the broadcast, its plan, and consensus errors.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import same_error_everywhere, snapshot
from mpi4py import MPI
from replicas import model

import mpidp
from mpidp import ContractError

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport


def test_initialize_broadcasts_from_nonzero_root_in_place(comm: MPI.Comm) -> None:
    root = comm.size - 1
    params = model(comm.rank)
    before = {k: id(v) for k, v in params.items()}
    expected = snapshot(model(root))
    with mpidp.DataParallel.initialize(params, comm, root=root, frozen=["frozen"]) as dp:
        assert (dp.rank, dp.world_size) == (comm.rank, comm.size)
        assert {k: id(v) for k, v in params.items()} == before  # identities kept
        assert params["embed"] is params["head"]  # still tied
        assert snapshot(params) == expected  # root's values, frozen included
        assert dp.names == tuple(sorted(params))
        assert dp.trainable == ("bias", "big", "brain", "embed", "half")


def test_initialize_accepts_any_insertion_order(comm: MPI.Comm) -> None:
    params = model(0)
    if comm.rank % 2:
        params = dict(reversed(list(params.items())))
    with mpidp.DataParallel.initialize(params, comm) as dp:
        assert dp.names == tuple(sorted(params))


def test_initialize_noncontiguous_parameter(comm: MPI.Comm) -> None:
    base = np.random.default_rng(comm.rank).standard_normal((40, 30)).astype(np.float32)
    params = {"t": base.T, "s": base[::2, 1]}  # views that are not C-contiguous
    expected = np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32)
    with mpidp.DataParallel.initialize(params, comm):
        assert np.array_equal(params["t"], expected.T)
        assert np.array_equal(params["s"], expected[::2, 1])


def count_bcasts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the byte count of every Bcast mpidp issues."""
    from mpidp.comm import Communicator

    sizes: list[int] = []
    original = Communicator.Bcast

    def bcast(self: Any, buf: Any, root: int, label: str) -> Any:
        sizes.append(int(np.asarray(buf).nbytes))
        return original(self, buf, root, label)

    monkeypatch.setattr(Communicator, "Bcast", bcast)
    return sizes


def test_initialize_broadcasts_flat_parameters_buffer_by_buffer(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    root = comm.size - 1
    many = {f"w{k:03d}": np.full(50_000 + k, comm.rank + k, dtype=np.float32) for k in range(40)}  # 8 MB of separate arrays
    params = mpidp.flat_parameters({**model(comm.rank), **many})
    expected = snapshot(mpidp.flat_parameters({**model(root), **{k: np.full(v.size, root + int(k[1:]), np.float32) for k, v in many.items()}}))
    sizes = count_bcasts(monkeypatch)
    with mpidp.DataParallel.initialize(params, comm, root=root, frozen=["frozen"]):
        assert snapshot(params) == expected
    # the fp32 buffer (8.5 MB) as one region in chunk-sized calls, the fp16 and bf16 ones in one staged call:
    # not one or more calls per array
    fp32 = sum(v.nbytes for k, v in params.items() if v.dtype == np.float32 and k != "head")
    chunk = mpidp.packing.BCAST_SPLIT_BYTES
    calls = -(-fp32 // chunk)
    assert sizes[:calls] == [chunk] * (calls - 1) + [fp32 - chunk * (calls - 1)], sizes
    assert len(sizes) == calls + 1, sizes


def test_initialize_matches_runs_whatever_order_the_buffers_lie_in(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of adjacent arrays, the first below the second in memory on even ranks, above it on odd ones."""
    memory = np.zeros(4 << 20, dtype=np.uint8)
    low, high = memory[: 2 << 20], memory[2 << 20 :]
    first, second = (low, high) if comm.rank % 2 == 0 else (high, low)
    a = first.view(np.float32)  # a run of two arrays: "a0" and "a1", 1.6 MB (over chunk_bytes / 4: calls of its own)
    b = second.view(np.float32)  # a run of two arrays: "b0" and "b1"
    params = {"a0": a[:200_000], "a1": a[200_000:400_000], "b0": b[:300_000], "b1": b[300_000:400_000]}
    for k, (name, v) in enumerate(sorted(params.items())):
        v[...] = 10 * comm.rank + k
    sizes = count_bcasts(monkeypatch)
    with mpidp.DataParallel.initialize(params, comm):
        assert all((v == k).all() for k, (_, v) in enumerate(sorted(params.items())))  # root 0's values
    assert sizes == [1_600_000, 1_600_000]  # one call per run, in the same order on every rank


@pytest.mark.parametrize("device_rank", [None, 0])
def test_initialize_plans_its_bcasts_from_agreed_facts_only(
    comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, device_rank: int | None
) -> None:
    """A rank that stages device memory makes every rank plan as it does, so the Bcasts match.

    Host arrays of 64 KiB and more get calls of their own only when every rank
    is on the host; rank 0's initialize record emulates a GPU rank here.
    """
    if comm.rank == device_rank:
        monkeypatch.setattr(mpidp.checks, "on_host", lambda local: False)
    params = {"big": np.full(30_000, comm.rank, np.float32), "small": np.full(100, comm.rank, np.float32)}
    sizes = count_bcasts(monkeypatch)
    with mpidp.DataParallel.initialize(params, comm):
        assert all((v == 0).all() for v in params.values())  # root 0's values
    assert comm.allgather(sizes) == [sizes] * comm.size
    assert sizes == ([120_000, 400] if device_rank is None else [120_400]), sizes  # own call / packed together


@pytest.mark.mpi(min_size=2)
def test_initialize_falls_back_when_ranks_lay_parameters_out_differently(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    params = model(comm.rank)
    if comm.rank == 0:
        params = mpidp.flat_parameters(params)
    expected = snapshot(model(0))
    sizes = count_bcasts(monkeypatch)
    with mpidp.DataParallel.initialize(params, comm, frozen=["frozen"]):
        assert snapshot(params) == expected
    assert len(sizes) == 2, sizes  # array by array: "big" alone, the small ones packed: the same calls on every rank
    assert comm.allgather(sizes) == [sizes] * comm.size


LOCAL_INIT_ERRORS = {
    "int64": (lambda p: p.__setitem__("steps", np.zeros(3, np.int64)), "'steps'", "int64 arrays need explicit synchronization"),
    "bool": (lambda p: p.__setitem__("mask", np.zeros(3, bool)), "'mask'", "bool arrays need explicit synchronization"),
    "float64": (lambda p: p.__setitem__("big", np.zeros(3)), "'big'", "dtype float64 is not supported"),
    "not an array": (lambda p: p.__setitem__("bias", [1.0, 2.0]), "'bias'", "list is not a NumPy, CuPy or PyTorch array"),
}


@pytest.mark.parametrize("case", sorted(LOCAL_INIT_ERRORS))
def test_initialize_refuses_bad_arrays_on_every_rank(comm: MPI.Comm, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    params = model(comm.rank)
    spoil, *fragments = LOCAL_INIT_ERRORS[case]
    if mine:
        spoil(params)
    before = snapshot({k: v for k, v in params.items() if isinstance(v, np.ndarray)})
    same_error_everywhere(comm, lambda: mpidp.DataParallel.initialize(params, comm), ContractError, f"rank {bad}: ", *fragments)
    assert snapshot({k: v for k, v in params.items() if isinstance(v, np.ndarray)}) == before


def test_initialize_refuses_root_outside_world(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where
    params = model(comm.rank)
    before = snapshot(params)
    root = comm.size if mine else 0
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, root=root), ContractError, f"rank {bad}: root {comm.size} is outside"
    )
    assert snapshot(params) == before


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:0", "parameter 'bias' is on cpu, but this rank's device is cuda:0"),
        ("gpu", "device must be 'cpu' or 'cuda:N', got 'gpu'"),
    ],
)
def test_initialize_refuses_wrong_or_malformed_device(comm: MPI.Comm, where: tuple[bool, int], device: str, message: str) -> None:
    mine, bad = where
    params = model(comm.rank)
    before = snapshot(params)
    same_error_everywhere(
        comm,
        lambda: mpidp.DataParallel.initialize(params, comm, device=device if mine else None),
        ContractError,
        f"rank {bad}: {message}",
    )
    assert snapshot(params) == before


def test_initialize_refuses_half_frozen_tie_and_unknown_frozen(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where
    params = model(comm.rank)
    frozen = ["head"] if mine else []
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, frozen=frozen), ContractError,
        f"rank {bad}: tied parameters 'embed' and 'head' disagree on the trainable flag",
    )
    frozen = ["nope"] if mine else []
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, frozen=frozen), ContractError,
        f"rank {bad}: frozen names unknown parameter 'nope'",
    )


def test_initialize_refuses_non_mapping(comm: MPI.Comm) -> None:
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize([np.zeros(3, np.float32)], comm), ContractError,
        "rank 0: params must be a mapping",
    )


def _rename(p: dict[str, Any]) -> None:
    p["bias_renamed"] = p.pop("bias")


def _extra(p: dict[str, Any]) -> None:
    p["zzz"] = np.zeros(2, np.float32)


def _reshape(p: dict[str, Any]) -> None:
    p["bias"] = np.zeros(8, np.float32)


def _retype(p: dict[str, Any]) -> None:
    p["bias"] = p["bias"].astype(np.float16)


def _untie(p: dict[str, Any]) -> None:
    p["head"] = p["head"].copy()


MISMATCHES = {
    "name": (_rename, {}, "entry 0 is 'bias_renamed', expected 'bias'"),
    "count": (_extra, {}, "8 parameters, expected 7 (extra 'zzz')"),
    "shape": (_reshape, {}, "parameter 'bias': shape (8,) differs from (7,)"),
    "dtype": (_retype, {}, "parameter 'bias': dtype float16 differs from float32"),
    "trainable": (lambda p: None, {"frozen": ["frozen", "bias"]}, "parameter 'bias': trainable False differs from True"),
    "tie": (_untie, {}, "parameter 'head': untied, expected tied to 'embed'"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_initialize_names_the_first_difference_between_ranks(comm: MPI.Comm, case: str) -> None:
    spoil, kwargs, fragment = MISMATCHES[case]
    bad = comm.size - 1
    params = model(comm.rank)
    options: dict[str, Any] = {"frozen": ["frozen"]}
    if comm.rank == bad:
        spoil(params)
        options.update(kwargs)
    before = snapshot(params)
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, **options), ContractError,
        f"rank {bad} differs from rank 0: {fragment}",
    )
    assert snapshot(params) == before


@pytest.mark.mpi(min_size=2)
def test_initialize_refuses_ranks_disagreeing_on_chunk_bytes(comm: MPI.Comm) -> None:
    chunk = 1 << 20 if comm.rank == comm.size - 1 else 4 << 20
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm, chunk_bytes=chunk), ContractError,
        f"rank {comm.size - 1} uses chunk_bytes=1048576, rank 0 chunk_bytes=4194304",
    )


def test_initialize_agrees_on_a_rank_that_cannot_allocate_its_chunk_buffers(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation that fails on one rank (memory is a local fact) is an error on every rank, not a raise on one."""
    chunk = 1 << 20
    if comm.rank == comm.size - 1:
        real = np.empty

        def empty(shape: Any, *args: Any, **kwargs: Any) -> Any:
            if shape == chunk // 4:
                raise MemoryError(f"Unable to allocate {chunk} bytes for an array with shape ({shape},)")
            return real(shape, *args, **kwargs)

        monkeypatch.setattr(np, "empty", empty)
    params = model(comm.rank)
    before = snapshot(params)
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, chunk_bytes=chunk), ContractError,
        f"rank {comm.size - 1}: could not allocate the chunk buffers (chunk_bytes={chunk}, cpu): MemoryError: Unable to allocate",
    )
    monkeypatch.undo()
    assert snapshot(params) == before
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=chunk):  # nothing was left half made
        pass


@pytest.mark.mpi(min_size=2)
def test_initialize_refuses_ranks_disagreeing_on_root(comm: MPI.Comm) -> None:
    root = 1 if comm.rank == comm.size - 1 else 0
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm, root=root), ContractError,
        f"rank {comm.size - 1} broadcasts from root 1, rank 0 from root 0",
    )


def test_read_only_and_foreign_byte_order_are_refused(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where
    params = model(comm.rank)
    if mine:
        params["bias"] = params["bias"].copy()
        params["bias"].flags.writeable = False
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm), ContractError, f"rank {bad}: parameter 'bias': it is read-only"
    )
    params = model(comm.rank)
    if mine:
        params["bias"] = params["bias"].astype(">f4")
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm), ContractError, f"rank {bad}: parameter 'bias': dtype >f4 is not supported"
    )
