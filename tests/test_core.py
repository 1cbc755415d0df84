"""DataParallel on named NumPy arrays: broadcast, exact token-weighted reduction, consensus errors.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from functools import partial
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import clean_env, same_error_everywhere, snapshot
from mpi4py import MPI

import mpidp
from mpidp import ContractError, MissingGradientPolicy

BF16 = np.dtype(ml_dtypes.bfloat16)
ZERO, ERROR = MissingGradientPolicy.ZERO, MissingGradientPolicy.ERROR


def model(seed: int) -> dict[str, Any]:
    """A replica with every kind of entry: fp32 large and small, fp16, bf16, a tie, a frozen one."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((64, 16)).astype(np.float32)
    return {
        "embed": emb,
        "head": emb,  # tied to embed
        "big": rng.standard_normal(300_000).astype(np.float32),
        "bias": rng.standard_normal(7).astype(np.float32),
        "half": rng.standard_normal((5, 9)).astype(np.float16),
        "brain": rng.standard_normal((3, 11)).astype(BF16),
        "frozen": rng.standard_normal(4).astype(np.float32),
    }


TRAINABLE = ("big", "bias", "brain", "embed", "half")


def grads_for(params: dict[str, Any], rng: np.random.Generator, names: Any = TRAINABLE) -> dict[str, Any]:
    return {n: (rng.standard_normal(params[n].shape) * 10).astype(params[n].dtype) for n in names}


@pytest.fixture
def dp(comm: MPI.Comm) -> Any:
    params = model(100 + comm.rank)
    d = mpidp.DataParallel.initialize(params, comm, frozen=["frozen"])
    d.params = params  # type: ignore[attr-defined]
    yield d
    d.close()


# ---------------------------------------------------------------- initialize


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


def test_flat_parameters_copies_into_one_buffer_per_dtype() -> None:
    params = model(3)
    before = snapshot(params)
    flat = mpidp.flat_parameters(params)
    assert list(flat) == list(params)  # same names, same order
    assert snapshot(flat) == before  # same values
    assert snapshot(params) == before  # the originals are untouched
    assert flat["embed"] is flat["head"]  # the tie survives
    assert all(not np.shares_memory(flat[k], params[k]) for k in params)
    for dtype in (np.float32, np.float16, BF16):
        views = [v for k, v in flat.items() if v.dtype == dtype and k != "head"]
        bases = {id(v.base) for v in views}
        assert len(bases) == 1, dtype  # one flat buffer per dtype
        base = views[0].base
        assert sum(v.size for v in views) == base.size  # nothing else in it


def test_flat_parameters_refuses_non_arrays() -> None:
    with pytest.raises(TypeError, match="parameter 'b': list is not a NumPy"):
        mpidp.flat_parameters({"a": np.zeros(2, np.float32), "b": [1.0]})
    with pytest.raises(TypeError, match="mapping"):
        mpidp.flat_parameters([np.zeros(2)])  # type: ignore[arg-type]


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


# -------------------------------------------------------------------- reduce


def gathered_expectation(comm: MPI.Comm, grads: dict[str, Any], weight: int) -> tuple[dict[str, np.ndarray], int]:
    """The formula, from every rank's data: sum of weighted ranks' grads / sum of weights, in float64."""
    every = comm.allgather((weight, {k: v.astype(np.float64) for k, v in grads.items()}))
    total = sum(w for w, _ in every)
    out: dict[str, np.ndarray] = {}
    for w, g in every:
        if w == 0:
            continue
        for k, v in g.items():
            out[k] = out.get(k, 0) + v
    return {k: v / total for k, v in out.items()}, total


TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(got.astype(np.float64) - expected).max())
    assert err <= TOL[dtype] * scale, (dtype, err, scale)


def assert_same_on_every_rank(comm: MPI.Comm, gradients: dict[str, Any]) -> None:
    mine = {k: (v.dtype.name, np.ascontiguousarray(v).tobytes()) for k, v in gradients.items()}
    assert all(o == mine for o in comm.allgather(mine)), "results differ between ranks"


def test_reduce_is_the_exact_global_token_mean(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(7 + comm.rank)
    for window in range(4):
        grads = grads_for(dp.params, rng)
        # uneven weights; the last rank has no tokens in even windows
        weight = 0 if (comm.rank == comm.size - 1 and window % 2 == 0 and comm.size > 1) else int(rng.integers(1, 1000))
        expected, total = gathered_expectation(comm, grads, weight)
        originals = {k: id(v) for k, v in grads.items()}
        out = dp.reduce(grads, weight)
        assert out.global_weight == total
        assert sorted(out.gradients) == sorted(TRAINABLE)
        for k, v in out.gradients.items():
            assert v.dtype == dp.params[k].dtype and v.shape == dp.params[k].shape
            assert id(v) == originals[k]  # written in place into the caller's arrays
            assert_close(v, expected[k], v.dtype.name)
        assert_same_on_every_rank(comm, out.gradients)


def test_zero_weight_rank_gradients_are_ignored(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    weight = 3
    if comm.rank == comm.size - 1 and comm.size > 1:
        weight = 0
        for g in grads.values():
            g[...] = 1000  # would show if counted
    expected, total = gathered_expectation(comm, grads, weight)
    out = dp.reduce(grads, weight)
    assert out.global_weight == total == 3 * max(1, comm.size - 1)
    for k, v in out.gradients.items():
        assert_close(v, expected[k], v.dtype.name)


def test_zero_policy_and_globally_absent_entries(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    # "bias" is present only on rank 0, "half" on no rank at all
    names = [n for n in TRAINABLE if n != "half" and (n != "bias" or comm.rank == 0)]
    grads = grads_for(dp.params, rng, names)
    expected, _ = gathered_expectation(comm, grads, 5)
    out = dp.reduce(grads, 5, policy=ZERO)
    assert "half" not in out.gradients  # absent everywhere: stays absent, like .grad None
    assert sorted(out.gradients) == ["bias", "big", "brain", "embed"]
    for k, v in out.gradients.items():
        assert type(v) is np.ndarray and v.dtype == dp.params[k].dtype
        assert_close(v, expected[k], v.dtype.name)
    assert_same_on_every_rank(comm, out.gradients)


def test_absent_on_every_weighted_rank_is_absent(comm: MPI.Comm, dp: Any) -> None:
    """A gradient held only by a zero-weight rank does not make an entry present."""
    rng = np.random.default_rng(comm.rank)
    zero_rank = comm.size - 1
    names = list(TRAINABLE) if comm.rank == zero_rank else [n for n in TRAINABLE if n != "bias"]
    weight = 0 if comm.rank == zero_rank and comm.size > 1 else 2
    grads = grads_for(dp.params, rng, names)
    out = dp.reduce(grads, weight, policy=ZERO)
    assert ("bias" in out.gradients) == (comm.size == 1)


def test_tied_gradient_under_either_name(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng, [n for n in TRAINABLE if n != "embed"])
    grads["head"] = (rng.standard_normal((64, 16))).astype(np.float32)
    expected, _ = gathered_expectation(comm, {("embed" if k == "head" else k): v for k, v in grads.items()}, 1)
    out = dp.reduce(grads, 1)
    assert "head" in out.gradients and "embed" not in out.gradients
    assert_close(out.gradients["head"], expected["embed"], "float32")


def test_gradient_buffers_reduce_in_place(comm: MPI.Comm, dp: Any) -> None:
    g = dp.gradient_buffers()
    assert sorted(g) == sorted(TRAINABLE)
    assert dp.gradient_buffers()["big"] is g["big"]  # persistent
    assert all(float(np.abs(v.astype(np.float32)).max()) == 0 for v in g.values())
    rng = np.random.default_rng(comm.rank)
    for k, v in grads_for(dp.params, rng).items():
        g[k][...] = v
    expected, _ = gathered_expectation(comm, g, comm.rank + 1)
    out = dp.reduce(g, comm.rank + 1)
    for k, v in out.gradients.items():
        assert v is g[k]
        assert_close(v, expected[k], v.dtype.name)
    dp.zero_gradients()
    assert all(float(np.abs(v.astype(np.float32)).max()) == 0 for v in g.values())


def test_noncontiguous_gradient(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    grads["embed"] = np.asfortranarray(grads["embed"])
    expected, _ = gathered_expectation(comm, grads, 2)
    out = dp.reduce(grads, 2)
    assert out.gradients["embed"] is grads["embed"]
    assert_close(out.gradients["embed"], expected["embed"], "float32")


def test_weight_is_exact_python_int(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    weight = (1 << 62) // comm.size + comm.rank
    out = dp.reduce(grads_for(dp.params, rng), np.uint64(weight))
    assert out.global_weight == sum(comm.allgather(weight))
    assert type(out.global_weight) is int


def test_reduce_allocates_no_model_sized_memory_after_the_first_window(comm: MPI.Comm) -> None:
    rng = np.random.default_rng(comm.rank)
    params = {f"w{i}": rng.standard_normal(400_000).astype(np.float32) for i in range(5)}
    params.update({f"b{i}": rng.standard_normal(200_000).astype(BF16) for i in range(3)})
    params.update({f"s{i}": rng.standard_normal(100).astype(np.float32) for i in range(20)})
    model_bytes = sum(v.nbytes for v in params.values())
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=1 << 20) as dp:
        grads = {k: np.ones_like(v) for k, v in params.items()}
        dp.reduce(grads, 1)
        tracemalloc.start()
        try:
            dp.reduce(grads, 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < model_bytes / 8, (peak, model_bytes)


# -------------------------------------------------------------- errors


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


def _grads_unknown(dp: Any, g: dict[str, Any]) -> None:
    g["nope"] = np.zeros(3, np.float32)


def _grads_frozen(dp: Any, g: dict[str, Any]) -> None:
    g["frozen"] = np.zeros(4, np.float32)


def _grads_shape(dp: Any, g: dict[str, Any]) -> None:
    g["bias"] = np.zeros(6, np.float32)


def _grads_dtype(dp: Any, g: dict[str, Any]) -> None:
    g["half"] = g["half"].astype(np.float32)


def _grads_missing(dp: Any, g: dict[str, Any]) -> None:
    del g["brain"]


def _grads_two_for_a_tie(dp: Any, g: dict[str, Any]) -> None:
    g["head"] = g["embed"].copy()


def _grads_not_array(dp: Any, g: dict[str, Any]) -> None:
    g["bias"] = 3.0


def _params_replaced(dp: Any, g: dict[str, Any]) -> None:
    dp.params["bias"] = dp.params["bias"].copy()


def _params_added(dp: Any, g: dict[str, Any]) -> None:
    dp.params["extra"] = np.zeros(1, np.float32)


REDUCE_ERRORS: dict[str, tuple[Any, Any, str]] = {
    "unknown": (_grads_unknown, 1, "gradient for unknown parameter 'nope'"),
    "frozen": (_grads_frozen, 1, "gradient for frozen parameter 'frozen'"),
    "shape": (_grads_shape, 1, "gradient 'bias': shape (6,) differs from its parameter's (7,)"),
    "dtype": (_grads_dtype, 1, "gradient 'half': dtype float32 differs from its parameter's float16"),
    "missing": (_grads_missing, 1, "parameter 'brain' has no gradient (policy ERROR, local weight 1)"),
    "tie": (_grads_two_for_a_tie, 1, "two gradients for one tied array: 'embed' and 'head'"),
    "not an array": (_grads_not_array, 1, "gradient 'bias' is a float, not an array"),
    "replaced": (_params_replaced, 1, "parameter 'bias' was replaced or removed after initialize"),
    "added": (_params_added, 1, "the parameter mapping changed after initialize: 8 names, expected 7"),
    "negative": (None, -1, "local_weight -1 is outside [0, 2**64 - 1]"),
    "too big": (None, 1 << 64, f"local_weight {1 << 64} is outside"),
    "float": (None, 2.0, "local_weight must be a non-negative int, got float 2.0"),
    "bool": (None, True, "local_weight must be a non-negative int, got bool True"),
}


@pytest.mark.parametrize("case", sorted(REDUCE_ERRORS))
def test_reduce_refuses_bad_input_on_every_rank(comm: MPI.Comm, dp: Any, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    spoil, bad_weight, fragment = REDUCE_ERRORS[case]
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    weight: Any = 1
    saved_params = dict(dp.params)
    if mine:
        if spoil is not None:
            spoil(dp, grads)
        weight = bad_weight
    before = snapshot({k: v for k, v in grads.items() if isinstance(v, np.ndarray)})
    before_params = snapshot({k: v for k, v in dp.params.items()})
    same_error_everywhere(comm, lambda: dp.reduce(grads, weight), ContractError, f"rank {bad}: {fragment}")
    assert snapshot({k: v for k, v in grads.items() if isinstance(v, np.ndarray)}) == before
    assert snapshot({k: v for k, v in dp.params.items()}) == before_params
    # every rank stopped at the same point: the next good window works everywhere
    dp.params.clear()
    dp.params.update(saved_params)
    out = dp.reduce(grads_for(dp.params, rng), 1)
    assert out.global_weight == comm.size


def test_reduce_refuses_a_zero_global_weight(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 0), ContractError, "the global weight is 0")
    assert snapshot(grads) == before


def test_reduce_refuses_a_bad_policy(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(0))
    policy: Any = "ZERO" if mine else ERROR
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, policy), ContractError, f"rank {bad}: policy must be a MissingGradientPolicy, got 'ZERO'"
    )


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_ranks_disagreeing_on_policy(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    policy = ZERO if comm.rank == comm.size - 1 else ERROR
    before = snapshot(grads)
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, policy), ContractError,
        f"ranks disagree on the missing-gradient policy: rank 0 uses ERROR, rank {comm.size - 1} uses ZERO",
    )
    assert snapshot(grads) == before


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_ranks_in_different_windows(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    if comm.rank == comm.size - 1:
        dp._window += 1  # as if this rank had run one reduce more than the others
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1), ContractError,
        f"ranks are in different windows: rank 0 in window 1, rank {comm.size - 1} in window 2",
    )


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_a_global_weight_beyond_64_bits(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1 << 63), ContractError, "does not fit in 64 bits")


def test_reduce_refuses_a_gradient_on_another_device(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    torch = pytest.importorskip("torch")
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(0))
    if mine:
        grads["bias"] = torch.empty(7, dtype=torch.float32, device="meta")
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradient 'bias': device meta:0 differs from its parameter's cpu"
    )


# -------------------------------------------------------------- utilities


def test_verify_replicas(comm: MPI.Comm, dp: Any) -> None:
    dp.verify_replicas()
    if comm.size > 1:
        if comm.rank == comm.size - 1:
            dp.params["bias"][0] += 1
        same_error_everywhere(
            comm, dp.verify_replicas, ContractError, f"replicas differ from root 0 on rank(s) {comm.size - 1}: parameter(s) 'bias'"
        )


def test_verify_replicas_reports_a_parameter_it_cannot_read_on_every_rank(
    comm: MPI.Comm, dp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the parameters fails on one rank only: every rank raises the same error, none waits forever."""
    last = comm.size - 1
    if comm.rank == last:

        def unreadable(v: Any) -> memoryview:
            raise RuntimeError("unreadable storage")

        monkeypatch.setattr(mpidp.layout, "crc_bytes", unreadable)
    same_error_everywhere(
        comm, dp.verify_replicas, ContractError, f"rank {last}: could not read the parameters: RuntimeError: unreadable storage"
    )
    monkeypatch.undo()
    dp.verify_replicas()  # the session is still usable


def test_closed_instance_refuses_reduce(comm: MPI.Comm) -> None:
    params = model(0)
    dp = mpidp.DataParallel.initialize(params, comm)
    dp.close()
    dp.close()  # idempotent
    with pytest.raises(ContractError, match="closed"):
        dp.reduce({}, 1)


def test_library_traffic_does_not_match_user_traffic(comm: MPI.Comm) -> None:
    """A pending user message on the same communicator is not consumed by mpidp."""
    if comm.size > 1:
        req = comm.isend(comm.rank, dest=(comm.rank + 1) % comm.size, tag=0)
    with mpidp.DataParallel.initialize(model(0), comm, frozen=["frozen"]) as dp:
        dp.reduce(grads_for(model(0), np.random.default_rng(0)), 1)
    if comm.size > 1:
        assert comm.recv(source=(comm.rank - 1) % comm.size, tag=0) == (comm.rank - 1) % comm.size
        req.wait()


def test_import_mpidp_imports_no_framework() -> None:
    code = "import sys, mpidp; bad = [m for m in ('torch', 'cupy', 'mpidp.examples') if m in sys.modules]; print(bad); assert not bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())


def test_a_failed_collective_poisons_the_session(comm: MPI.Comm, dp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(buf: Any, operation: str = "Allreduce") -> None:
        raise mpidp.CollectiveError(f"{operation} failed on rank {comm.rank}: simulated")

    import weakref

    grads = grads_for(dp.params, np.random.default_rng(0))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # views kept: the broken session must not hold the arrays
    monkeypatch.setattr(dp._comm, "Allreduce", broken)
    with pytest.raises(mpidp.CollectiveError, match="simulated"):
        dp.reduce(grads, 1)
    monkeypatch.undo()
    with pytest.raises(mpidp.CollectiveError, match="an earlier collective failed"):
        dp.reduce(grads, 1)
    ref = weakref.ref(grads["big"])
    del grads
    assert ref() is None


def test_strided_bounds_match_numpy_byte_bounds() -> None:
    # the overlap check's bounds for device (CuPy) gradients, checked against NumPy's on host views
    from mpidp.layout import byte_bounds, strided_bounds

    base = np.zeros((6, 10, 4), dtype=np.float32)
    views = [base, base[1:4, ::3], base[::-1], base[:, ::-2, 1:3], base.transpose(2, 0, 1), base[5:6, 9:, 3:], base.reshape(-1)[7:8]]
    for v in views:
        address = v.__array_interface__["data"][0]
        assert strided_bounds(address, v.shape, v.strides, v.itemsize) == tuple(byte_bounds(v)), v.strides


def test_reduce_refuses_gradients_that_share_memory(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    if mine:
        grads["bias"] = grads["big"][:7]  # a view into another gradient
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradients 'bias' and 'big' share memory")
    assert snapshot(grads) == before


def test_reduce_refuses_the_same_array_twice(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where
    with mpidp.DataParallel.initialize({"a": np.zeros(5, np.float32), "b": np.zeros(5, np.float32)}, comm) as two:
        z = np.zeros(5, np.float32)
        g = {"a": z, "b": z} if mine else {"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)}
        same_error_everywhere(comm, lambda: two.reduce(g, 1), ContractError, f"rank {bad}: gradients 'a' and 'b' are the same array")


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


def test_read_only_gradient_is_refused(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    if mine:
        grads["big"].flags.writeable = False
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradient 'big': it is read-only")


@pytest.mark.mpi(min_size=2)
def test_ranks_in_different_operations_raise_everywhere(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    last = comm.size - 1
    call = dp.verify_replicas if comm.rank == last else (lambda: dp.reduce(grads, 1))
    same_error_everywhere(
        comm, call, ContractError, f"ranks are in different mpidp operations: rank 0 in reduce, rank {last} in verify_replicas"
    )


def test_verify_replicas_compares_with_the_root(comm: MPI.Comm) -> None:
    root = comm.size - 1
    params = model(comm.rank)
    with mpidp.DataParallel.initialize(params, comm, root=root, frozen=["frozen"]) as dp:
        if comm.size > 1:
            if comm.rank == 0:
                params["bias"][0] += 1
            same_error_everywhere(comm, dp.verify_replicas, ContractError, f"replicas differ from root {root} on rank(s) 0: parameter(s) 'bias'")


def test_plan_cache_stays_small(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(1)  # the same presence pattern on every rank
    for _ in range(40):
        names = [n for n in TRAINABLE if rng.random() < 0.6] or ["big"]
        dp.reduce(grads_for(dp.params, np.random.default_rng(comm.rank), names), 1, ZERO)
    assert len(dp._cache.plans) <= 8


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_bad_timeout_is_refused_everywhere(comm: MPI.Comm, where: tuple[bool, int], timeout: float) -> None:
    mine, bad = where
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm, timeout=timeout if mine else None), ContractError,
        f"rank {bad}: timeout must be a non-negative number of seconds, got {timeout!r}",
    )


def test_a_timeout_beyond_any_float_means_no_limit(comm: MPI.Comm) -> None:
    import time

    with mpidp.DataParallel.initialize(model(0), comm, timeout=10**400) as dp:
        time.sleep(0.1)
        assert dp._watchdog is not None and dp._watchdog._thread.is_alive()  # watching, never firing
        dp.verify_replicas()


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_bad_timeout_in_the_environment_is_refused_everywhere(
    comm: MPI.Comm, where: tuple[bool, int], value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, bad = where
    if mine:
        monkeypatch.setenv("MPIDP_TIMEOUT", value)
    else:
        monkeypatch.delenv("MPIDP_TIMEOUT", raising=False)
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm), ContractError,
        f"rank {bad}: MPIDP_TIMEOUT must be a non-negative number of seconds, got {value!r}",
    )


# ------------------------------------------ the same gradients, window after window

def _freeze_big(g: dict[str, Any]) -> None:
    g["big"].flags.writeable = False


def _reshape_in_place(g: dict[str, Any]) -> None:
    g["big"].shape = (1000, 300)


def _restride_in_place(g: dict[str, Any]) -> None:
    import warnings

    with warnings.catch_warnings():  # deprecated in NumPy 2.4, still possible
        warnings.simplefilter("ignore", DeprecationWarning)
        g["embed"].strides = (4, 64 * 4)  # the transpose's layout, under the same object


CHANGED_IN_PLACE = {
    "read-only": (_freeze_big, "gradient 'big': it is read-only"),
    "reshaped": (_reshape_in_place, "gradient 'big': shape (1000, 300) differs from its parameter's (300000,)"),
    "restrided": (_restride_in_place, "gradient 'embed'"),
}


@pytest.mark.parametrize("case", sorted(CHANGED_IN_PLACE))
def test_gradients_accepted_before_are_checked_again_when_changed_in_place(
    comm: MPI.Comm, dp: Any, where: tuple[bool, int], case: str
) -> None:
    """Passing the same arrays every window is the fast path; changing one of them in place is still caught."""
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # the same objects, unchanged: accepted again
    change, fragment = CHANGED_IN_PLACE[case]
    if mine:
        change(grads)
    if case == "restrided":  # a legal but different layout: reduced correctly, not refused
        expected, _ = gathered_expectation(comm, grads, 1)
        out = dp.reduce(grads, 1)
        assert_close(out.gradients["embed"], expected["embed"], "float32")
        assert_same_on_every_rank(comm, out.gradients)
        return
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: {fragment}")
    assert snapshot(grads) == before


def test_gradients_accepted_before_and_now_sharing_memory_are_refused(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    if mine:
        grads["bias"] = grads["big"][:7]
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradients 'bias' and 'big' share memory")


def test_accepted_gradients_are_not_kept_alive(comm: MPI.Comm, dp: Any) -> None:
    """A caller who allocates new gradients every window does not pay for the last window's."""
    import weakref

    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    ref = weakref.ref(grads["big"])
    del grads
    assert ref() is None


def _same_arrays(dp: Any, layout: str) -> dict[str, Any]:
    """Gradient arrays a caller keeps and refills every window."""
    if layout == "buffers":
        return dp.gradient_buffers()
    grads = {n: np.zeros(dp.params[n].shape, dp.params[n].dtype) for n in TRAINABLE}
    if layout == "one strided":
        grads["embed"] = np.zeros((16, 64), np.float32).T  # not C-contiguous: staged through a copy
    return grads


#: (weight of rank 0, weight of the last rank, names rank 0 leaves out) per window
WINDOWS = [(3, 4, ()), (5, 1, ()), (2, 9, ()), (6, 0, ()), (7, 2, ()), (1, 1, ("bias",)), (4, 3, ()), (8, 5, ()), (2, 2, ())]


@pytest.mark.parametrize("layout", ["separate", "one strided", "buffers"])
def test_the_same_gradients_reduce_like_new_ones_window_after_window(comm: MPI.Comm, dp: Any, layout: str) -> None:
    """The second window in a row on the same arrays keeps its cut views; later windows reuse them.

    Every window, the arrays are refilled in place and reduced, and a second
    session reduces fresh copies of the same values: the results must be
    bitwise equal, through weight-0 windows, a missing gradient and back.
    """
    fresh = mpidp.DataParallel.initialize(model(100 + comm.rank), comm, frozen=["frozen"])
    grads = _same_arrays(dp, layout)
    rng = np.random.default_rng(comm.rank)
    try:
        for first, last, absent in WINDOWS:
            weight = first if comm.rank == 0 else last if comm.rank == comm.size - 1 else 3
            values = grads_for(dp.params, rng)
            for name in TRAINABLE:
                grads[name][...] = values[name]
            mine = {n: g for n, g in grads.items() if not (comm.rank == 0 and n in absent)}
            out = dp.reduce(mine, weight, ZERO)
            want = fresh.reduce({n: v for n, v in values.items() if n in mine}, weight, ZERO)
            assert out.global_weight == want.global_weight
            assert sorted(out.gradients) == sorted(want.gradients)
            assert len(out.gradients) == len(TRAINABLE) - (len(absent) if comm.size == 1 else 0)  # absent everywhere alone
            for name in out.gradients:
                if name in mine:
                    assert out.gradients[name] is grads[name]  # written in place, as always
                assert snapshot({name: out.gradients[name]}) == snapshot({name: want.gradients[name]}), (name, weight)
            out.gradients.clear()  # the caller's dict to keep: clearing it changes no later window
    finally:
        fresh.close()


def test_the_same_gradients_are_released_when_the_caller_moves_on(comm: MPI.Comm, dp: Any) -> None:
    """Reused arrays are referenced until the next window on other arrays, not longer."""
    import weakref

    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # the second window in a row: its views are kept
    ref = weakref.ref(grads["big"])
    del grads
    dp.reduce(grads_for(dp.params, np.random.default_rng(comm.rank)), 1)
    assert ref() is None
    bad = comm.size - 1
    for weights, message in [((1, -1), f"rank {bad}: local_weight"), ((0, 0), "the global weight is 0")]:
        kept = grads_for(dp.params, np.random.default_rng(comm.rank))
        dp.reduce(kept, 1)
        dp.reduce(kept, 1)
        ref = weakref.ref(kept["big"])
        weight = weights[comm.rank == bad]
        same_error_everywhere(comm, partial(dp.reduce, kept, weight), ContractError, message)  # or a window that fails
        del kept
        assert ref() is None, message
    kept = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(kept, 1)
    dp.reduce(kept, 1)
    ref = weakref.ref(kept["big"])
    del kept
    dp.close()  # or close the session
    assert ref() is None


def test_a_kept_result_is_not_changed_by_later_windows(comm: MPI.Comm, dp: Any) -> None:
    """The result of each window is the caller's: later windows on the same arrays leave its dict alone."""
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    results = [dp.reduce(grads, 1) for _ in range(4)]  # the third and fourth rerun kept views
    for r in results:
        assert sorted(r.gradients) == sorted(TRAINABLE)  # the same names, nothing added
        assert all(v is grads[n] for n, v in r.gradients.items())
    results[2].gradients.pop("big")
    results[2].gradients["extra"] = None
    again = dp.reduce(grads, 1)
    assert sorted(again.gradients) == sorted(TRAINABLE)
    assert sorted(results[3].gradients) == sorted(TRAINABLE)


def test_gradient_buffers_restrided_in_place_reduce_correctly(comm: MPI.Comm, dp: Any) -> None:
    """mpidp prepares its flat-storage views once; one the caller re-strides still reduces correctly."""
    import warnings

    bufs = dp.gradient_buffers()
    rng = np.random.default_rng(comm.rank)
    for g in grads_for(dp.params, rng).items():
        bufs[g[0]][...] = g[1]
    dp.reduce(bufs, 1)
    for name, g in grads_for(dp.params, rng).items():
        bufs[name][...] = g
    with warnings.catch_warnings():  # deprecated in NumPy 2.4, still possible
        warnings.simplefilter("ignore", DeprecationWarning)
        bufs["embed"].strides = (4, 64 * 4)
    expected, _ = gathered_expectation(comm, bufs, 1)
    out = dp.reduce(bufs, 1)
    for name in TRAINABLE:
        assert_close(out.gradients[name], expected[name], str(dp.params[name].dtype))
    assert_same_on_every_rank(comm, out.gradients)
