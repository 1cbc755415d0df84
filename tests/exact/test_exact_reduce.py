"""The exact reduction, collective: the same bits as one process at every world size, and its errors on every rank.

Serially a world of one; under ``mpiexec -n 4`` four ranks, and three and
two split from them; on two simulated hosts in the multi-host step. Each
result is compared with a session on ``COMM_SELF`` that folded every
micro-batch itself: one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import first_ranks, same_error_everywhere
from mpi4py import MPI

import mpidp
import mpidp.torch
from mpidp import ContractError
from mpidp.exact import shard

COUNT = 12  # micro-batches per window


def params() -> dict[str, np.ndarray]:
    return {"w": np.zeros((5, 7), np.float32), "b": np.zeros(3, np.float32), "h": np.zeros(9, np.float16)}


def grads_of(i: int, step: int = 0) -> dict[str, np.ndarray]:
    """Micro-batch ``i``'s gradients: a fact of ``(i, step)``, not of the rank."""
    rng = np.random.default_rng([step, i])
    scale = 10.0 ** rng.uniform(-2, 2)
    return {k: (rng.standard_normal(v.shape) * scale).astype(v.dtype) for k, v in params().items()}


def window(dp: Any, mine: Any, weight_per: int = 3, step: int = 0) -> dict[str, bytes]:
    """Fold this rank's micro-batches but the last, reduce with the last; the results' bytes."""
    mine = list(mine)
    for i in mine[:-1]:
        dp.fold(grads_of(i, step))
    last = grads_of(mine[-1], step) if mine else {}
    out = dp.reduce(last, weight_per * len(mine), mpidp.MissingGradientPolicy.ZERO)
    return {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(out.gradients.items())}


def one_process(weight_per: int = 3, step: int = 0) -> dict[str, bytes]:
    with mpidp.DataParallel.initialize(params(), MPI.COMM_SELF, exact=True) as dp:
        return window(dp, range(COUNT), weight_per, step)


@pytest.mark.parametrize("ranks", [None, 3, 2])
def test_the_same_bits_as_one_process(comm: MPI.Comm, ranks: int | None) -> None:
    expected = one_process()
    with first_ranks(comm, ranks or comm.size) as sub:
        if sub is None:
            return
        with mpidp.DataParallel.initialize(params(), sub, exact=True) as dp:
            for step in range(2):  # a second window starts clean
                got = window(dp, shard(COUNT, sub.rank, sub.size), step=step)
                assert got == (expected if step == 0 else one_process(step=step)), f"rank {sub.rank} of {sub.size}"


@pytest.mark.parametrize("chunk_bytes", [4096, 40960])
def test_nor_on_the_chunk_size(comm: MPI.Comm, chunk_bytes: int) -> None:
    """Calls of 512 and 5120 int64 values, and the default 4 MiB: the same bits (the 300-value slots straddle calls)."""
    p = {f"p{i}": np.zeros(300 + 37 * i, np.float32) for i in range(20)}

    def run(c: MPI.Comm, **options: Any) -> bytes:
        with mpidp.DataParallel.initialize(p, c, exact=True, **options) as dp:
            for i in shard(COUNT, c.rank, c.size):
                rng = np.random.default_rng(i)
                dp.fold({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()})
            out = dp.reduce({}, 7 * len(shard(COUNT, c.rank, c.size)), mpidp.MissingGradientPolicy.ZERO)
            return b"".join(out.gradients[k].tobytes() for k in sorted(out.gradients))

    assert run(comm, chunk_bytes=chunk_bytes) == run(MPI.COMM_SELF)


def test_a_rank_of_weight_zero_adds_nothing_of_what_it_folded(comm: MPI.Comm) -> None:
    expected = one_process()
    with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
        mine = list(shard(COUNT, comm.rank, comm.size))
        if comm.size > 1 and comm.rank == comm.size - 1:  # folds gradients, then says they had no tokens
            dp.fold(grads_of(100))
            out = dp.reduce(grads_of(101), 0, mpidp.MissingGradientPolicy.ZERO)
            got = {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(out.gradients.items())}
            mine = []
        else:
            got = window(dp, [i for i in range(COUNT) if i % max(1, comm.size - 1) == comm.rank] if comm.size > 1 else mine)
        assert got == expected


def test_a_bad_fold_is_one_error_everywhere_and_the_next_window_is_clean(comm: MPI.Comm) -> None:
    with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
        if comm.rank == comm.size - 1:
            dp.fold({"w": np.zeros((7, 5), np.float32)})  # the wrong shape: no raise here, inside the loop
        dp.fold(grads_of(50))
        same_error_everywhere(comm, lambda: dp.reduce(grads_of(51), 1), ContractError, f"rank {comm.size - 1}: fold:", "'w'")
        assert window(dp, shard(COUNT, comm.rank, comm.size)) == one_process()


def test_a_slot_too_wide_for_int64_is_one_error_everywhere(comm: MPI.Comm) -> None:
    with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
        g = grads_of(0)
        g["b"] = np.full(3, 2.0**30 if comm.rank == 0 else 2.0**-30, np.float32)  # at one rank: spans 2**-30 to 2**30
        if comm.size == 1:
            dp.fold({"b": np.full(3, 2.0**-30, np.float32)})
        same_error_everywhere(comm, lambda: dp.reduce(g, 1), ContractError, "exact reduction", "'b'", "int64")


def test_inf_and_nan_on_one_rank_reach_every_rank(comm: MPI.Comm) -> None:
    with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
        g = grads_of(comm.rank)
        if comm.rank == comm.size - 1:
            g["w"][0, 0], g["w"][1, 1] = np.inf, np.nan
        out = dp.reduce(g, 1).gradients
        assert out["w"][0, 0] == np.inf and np.isnan(out["w"][1, 1]) and np.isfinite(out["w"][2:]).all()
        rows = comm.allgather(out["w"].tobytes())
        assert all(r == rows[0] for r in rows)


# ------------------------------------------------------------------ the passes' routes (issue 41)


def routes() -> list[str]:
    """The routes of the exact passes this process has: NumPy's, torch's where importable, numba's where installed."""
    import importlib.util

    from mpidp import exact

    return ["numpy"] + ["torch"] * (importlib.util.find_spec("torch") is not None) + ["numba"] * (exact.route("numba") == "numba")


@pytest.mark.parametrize("shift", [0, 1, 2])
def test_ranks_on_different_routes_give_one_process_s_bits(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, shift: int) -> None:
    """Each rank runs another route (MPIDP_EXACT_KERNELS): the bits of one process on its default route, on every rank."""
    import warnings

    from mpidp import exact

    if "torch" in routes():
        import torch  # noqa: F401 - the torch route runs where the process imported torch
    expected = [one_process(step=s) for s in range(2)]
    mine = routes()[(comm.rank + shift) % len(routes())]
    monkeypatch.setenv("MPIDP_EXACT_KERNELS", mine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", exact.SlowPassesWarning)
        with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
            assert dp._exact.acc.mode == mine and exact.route(mine) == mine
            got = [window(dp, shard(COUNT, comm.rank, comm.size), step=s) for s in range(2)]
    assert comm.allgather(got == expected) == [True] * comm.size, f"routes {comm.allgather(mine)}"


def test_numpy_s_passes_are_announced_once_on_the_root_rank(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from mpidp.exact import sums as exact

    monkeypatch.setattr(exact, "_warned", False)
    root = comm.size - 1
    seen = []
    for mode, exact_session in [("numba", False), ("numpy", True), ("numpy", True), ("auto", True)]:
        monkeypatch.setenv("MPIDP_EXACT_KERNELS", mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mpidp.DataParallel.initialize(params(), comm, root, exact=exact_session).close()
        seen.append([str(w.message) for w in caught if issubclass(w.category, exact.SlowPassesWarning)])
    every = comm.allgather(seen)
    for rank, mine in enumerate(every):
        told = [len(m) for m in mine]
        assert told == ([0, 1, 0, 0] if rank == root else [0, 0, 0, 0]), f"rank {rank}: {mine}"
    said = every[root][1][0]
    assert "MPIDP_EXACT_KERNELS=numpy" in said and "pip install numba" in said and "import torch" in said


def test_torch_s_passes_are_announced_once_on_the_root_rank_with_their_cost(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process with torch and without numba (MPIDP_EXACT_KERNELS=torch stands in for it) is told, once, on root, what the
    torch passes cost against numba's and how to get numba's."""
    import warnings

    from mpidp.exact import sums as exact

    pytest.importorskip("torch")
    monkeypatch.setattr(exact, "_warned", False)
    seen = []
    for mode in ("torch", "torch", "auto"):
        monkeypatch.setenv("MPIDP_EXACT_KERNELS", mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mpidp.DataParallel.initialize(params(), comm, exact=True).close()
        seen.append([str(w.message) for w in caught if issubclass(w.category, exact.SlowPassesWarning)])
    every = comm.allgather(seen)
    for rank, mine in enumerate(every):
        assert [len(m) for m in mine] == ([1, 0, 0] if rank == 0 else [0, 0, 0]), f"rank {rank}: {mine}"
    said = every[0][0][0]
    assert "torch operations" in said and exact.TORCH_COST in said and exact.NUMBA_COST in said and "pip install numba" in said


def test_every_rank_must_ask_for_it(comm: MPI.Comm) -> None:
    if comm.size == 1:
        pytest.skip("needs two ranks")
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params(), comm, exact=comm.rank == 0), ContractError, "exact=True", "exact=False"
    )


def test_fold_needs_an_exact_session(dp: Any) -> None:
    with pytest.raises(ContractError, match="exact=True"):
        dp.fold({})


# ------------------------------------------------------------------ PyTorch


def train(comm: MPI.Comm) -> str:
    """A small transformer, AdamW, 3 steps of the same 12 micro-batches spread over ``comm`` (folded, the last added by reduce): its hash."""
    from test_exact_overlap import train as exact_training

    return exact_training(comm, steps=3, options={})


def test_a_transformer_trained_with_adamw_has_one_hash_at_every_world_size(comm: MPI.Comm) -> None:
    expected = train(MPI.COMM_SELF)
    for ranks in sorted({comm.size, 3, 2} & set(range(1, comm.size + 1))):
        with first_ranks(comm, ranks) as sub:
            if sub is not None:
                assert train(sub) == expected, f"rank {sub.rank} of {ranks}"


@pytest.mark.parametrize("sizes", [[300 + 37 * i for i in range(20)], [10, 30000, 7]])  # the second: slot 0 not first in the flat storage
def test_gradient_buffers_take_the_results_in_place_with_the_same_bits(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> None:
    """Issue 33 item 7: the Allgather writes straight into the flat gradient storage (no copy-out pass), bits unchanged."""
    import mpidp.exact.window

    p = {f"p{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}

    def grads(i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(i)
        return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}

    def run(c: MPI.Comm, buffers: bool) -> bytes:
        with mpidp.DataParallel.initialize(p, c, exact=True, chunk_bytes=4096) as dp:
            mine = list(shard(COUNT, c.rank, c.size))
            for i in mine[:-1]:
                dp.fold(grads(i))
            last = grads(mine[-1])
            if buffers:
                for k, g in dp.gradient_buffers().items():
                    g[...] = last[k]
                last = dp.gradient_buffers()
            out = dp.reduce(last, 7 * len(mine), mpidp.MissingGradientPolicy.ZERO).gradients
            return b"".join(out[k].tobytes() for k in sorted(out))

    expected = run(MPI.COMM_SELF, False)
    copies: list[int] = []
    write = mpidp.exact.window._write
    monkeypatch.setattr(mpidp.exact.window, "_write", lambda *a: copies.append(1) or write(*a))
    assert run(comm, False) == expected
    apart = len(copies)
    assert run(comm, True) == expected
    assert apart >= 10 and len(copies) - apart <= 1  # a call each chunk; in place, at most the padded last one copies


# ------------------------------------------------------------------ one micro-batch per rank: float32 on the wire (issue 41)


def one_each(case: str, i: int, n: int) -> dict[str, np.ndarray]:
    """Micro-batch ``i`` of ``n``, one per rank, as the README's loop reduces them; ``case`` makes it hard."""
    rng = np.random.default_rng([41, i])
    g = {k: (rng.standard_normal(v.shape) * 10.0 ** rng.uniform(-1, 1)).astype(v.dtype) for k, v in params().items()}
    if case == "zeros":  # -0.0 and values that round to -0.0 at the same places on every rank: the sums are +0.0
        for v in g.values():
            v.reshape(-1)[:3] = np.array([-0.0, -1e-30, -(2.0**-149)]).astype(v.dtype)
    elif case == "wide" and i == n - 1 and n > 1:  # 2**18 above the others: more than 53 bits, the int64 exchange
        g["w"] *= np.float32(2.0**18)
    elif case == "nan" and i == 0:
        g["w"][1, 2] = np.nan
        g["b"][0] = -np.inf
    return g


@pytest.mark.parametrize("case", ["plain", "zeros", "wide", "nan", "join", "routes"])
def test_one_micro_batch_per_rank_travels_as_float32_with_one_process_s_bits(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Each rank's one gradient crosses as float32 and its owner sums in float64 (Accumulator.thin): the bits of one process
    that folded them all and summed its integers as int64 or float64, on every rank; with a rank of weight zero whose stale
    buffers nobody reads, and with each rank on another route."""
    import warnings

    from mpidp.exact import sums as exact

    n = comm.size
    given = [i for i in range(n) if not (case == "join" and n > 1 and i == n - 1)]  # join: the last rank has no data left
    with monkeypatch.context() as m:  # one process, every micro-batch folded: the int64 / float64 exchange
        m.setattr(exact.Accumulator, "thin", lambda *a: False)
        with mpidp.DataParallel.initialize(params(), MPI.COMM_SELF, exact=True) as dp:
            for i in given[:-1]:
                dp.fold(one_each(case, i, n))
            out = dp.reduce(one_each(case, given[-1], n), 3 * len(given), mpidp.MissingGradientPolicy.ZERO).gradients
            expected = {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(out.items())}
    if case == "routes":
        if "torch" in routes():
            import torch  # noqa: F401 - the torch route runs where the process imported torch
        monkeypatch.setenv("MPIDP_EXACT_KERNELS", routes()[comm.rank % len(routes())])
    thin: list[int] = []
    combine = exact.Accumulator.combine
    monkeypatch.setattr(exact.Accumulator, "combine", lambda *a: thin.append(1) or combine(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", exact.SlowPassesWarning)
        with mpidp.DataParallel.initialize(params(), comm, exact=True) as dp:
            for window_ in range(2):  # the second window: stale buffers from the first
                mine = one_each(case, comm.rank, n) if comm.rank in given else {}
                out = dp.reduce(mine, 3 * len(mine) // 3 if mine else 0, mpidp.MissingGradientPolicy.ZERO).gradients
                got = {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(out.items())}
                assert comm.allgather(got == expected) == [True] * n, f"window {window_}"
    assert bool(thin) == (case != "wide" or n == 1)  # the float32 exchange ran, but where a slot spans too many bits
