"""The reduce-scatter pipeline: owners divide and cast their share, the allgather moves the gradient's dtype.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank: the values are the one
process's (within float32 sum-order tolerance), the bits are the same on
every rank, and the algorithm is the one the agreed facts choose.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
from conftest import same_error_everywhere, snapshot
from mpi4py import MPI
from replicas import BF16, ZERO

import mpidp
from mpidp import ContractError
from mpidp import comm as mpidp_comm
from mpidp.packing import SCATTER_MIN, SCATTER_MIN_FP32, Moves, Scatter, plan, reduce_calls, reduce_scatter_for, slot

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport

#: name -> (size, dtype): odd sizes, sizes below any world size, calls long enough for ``auto``
SHAPES = {
    "one": (1, np.float16),
    "three": (3, BF16),
    "five": (5, np.float32),
    "pair": (2, np.float16),
    "long_bf16": (SCATTER_MIN * 2 + 1, BF16),
    "long_fp16": (SCATTER_MIN + 3, np.float16),
    "long_fp32": (SCATTER_MIN_FP32 + 1, np.float32),
    "even_bf16": (3 * 4 * 5 * 1000, BF16),
    "absent": (11, BF16),  # no rank with weight has a gradient for it: stays absent
    "zeroed": (13, np.float32),  # only rank 0 has one (policy ZERO)
}
TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def params_for(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(size).astype(dtype) for name, (size, dtype) in SHAPES.items()}


def grads_of(params: dict[str, Any], rng: np.random.Generator, rank: int) -> dict[str, Any]:
    names = [n for n in params if n != "absent" and (n != "zeroed" or rank == 0)]
    return {n: (rng.standard_normal(params[n].shape) * 10).astype(params[n].dtype) for n in names}


class Counting:
    """Counts the host collectives a session issues (wraps the Communicator's methods)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"Allreduce": 0, "Reduce_scatter_block": 0, "Allgather_in_place": 0}
        for name in self.calls:
            monkeypatch.setattr(mpidp_comm.Communicator, name, self._wrap(name, getattr(mpidp_comm.Communicator, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        def counted(comm: Any, *args: Any) -> Any:
            self.calls[name] += 1
            return method(comm, *args)

        return counted


@pytest.mark.parametrize("mode", ["auto", "allreduce", "reduce_scatter"])
@pytest.mark.parametrize("layout", ["caller arrays", "gradient_buffers"])
def test_every_mode_is_the_mean_with_the_same_bits_on_every_rank(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, mode: str, layout: str) -> None:
    monkeypatch.setenv("MPIDP_REDUCTION", mode)
    counting = Counting(monkeypatch)
    params = params_for(5 + comm.rank)
    rng = np.random.default_rng(comm.rank)
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=1 << 18) as dp:
        grads: dict[str, Any] = dp.gradient_buffers() if layout == "gradient_buffers" else {}
        for window in range(4):  # the third and fourth windows rerun the kept steps of the caller's arrays
            values = grads_of(params, rng, comm.rank)
            mine = {n: grads.setdefault(n, np.empty_like(v)) for n, v in values.items()}
            for n, v in values.items():
                mine[n][...] = v
            weight = 0 if comm.size > 1 and comm.rank == comm.size - 1 and window == 1 else comm.rank + window + 1
            every = comm.allgather((weight, values))
            total = sum(w for w, _ in every)
            out = dp.reduce(mine, weight, ZERO)
            assert out.global_weight == total
            assert "absent" not in out.gradients
            assert sorted(out.gradients) == sorted(n for n in SHAPES if n != "absent")
            for name, got in out.gradients.items():
                if name in mine:
                    assert got is mine[name]
                dtype = np.dtype(SHAPES[name][1])
                assert got.dtype == dtype and got.shape == (SHAPES[name][0],)
                want = sum((g[name].astype(np.float64) for w, g in every if w and name in g), np.zeros(got.shape)) / total
                scale = max(1.0, float(np.abs(want).max()))
                assert float(np.abs(got.astype(np.float64) - want).max()) <= TOL[dtype.name] * scale, (name, window)
            bits = snapshot(out.gradients)
            assert all(b == bits for b in comm.allgather(bits)), f"results differ between ranks (window {window})"
    scattered = counting.calls["Reduce_scatter_block"]
    assert counting.calls["Allgather_in_place"] == scattered
    if mode == "allreduce" or (mode == "auto" and comm.size == 1):
        assert scattered == 0
    else:
        assert scattered > 0 and (mode == "reduce_scatter" or counting.calls["Allreduce"] > 0)  # auto: float32 keeps Allreduce


def test_ranks_that_read_different_reduction_modes_get_one_error(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    if comm.size == 1:
        pytest.skip("needs two ranks")
    mode = "allreduce" if comm.rank == 1 else "reduce_scatter"
    monkeypatch.setenv("MPIDP_REDUCTION", mode)
    params = params_for(comm.rank)
    before = snapshot(params)
    same_error_everywhere(
        comm, partial(mpidp.DataParallel.initialize, params, comm), ContractError,
        "rank 1 uses MPIDP_REDUCTION='allreduce', rank 0 MPIDP_REDUCTION='reduce_scatter'",
    )
    assert snapshot(params) == before


def test_an_unknown_reduction_mode_is_one_error(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = comm.size - 1
    if comm.rank == bad:
        unknown = "ring"
        monkeypatch.setenv("MPIDP_REDUCTION", unknown)
    params = params_for(comm.rank)
    before = snapshot(params)
    same_error_everywhere(
        comm, partial(mpidp.DataParallel.initialize, params, comm), ContractError,
        f"rank {bad}: MPIDP_REDUCTION must be one of auto, allreduce, reduce_scatter, got 'ring'",
    )
    assert snapshot(params) == before


# ----------------------------------------------------------- pure: no MPI


def test_the_rule_uses_agreed_facts_only() -> None:
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert not reduce_scatter_for(1 << 20, None, 4, "reduce_scatter")  # a call mixing dtypes
    assert not reduce_scatter_for(1 << 20, f16, 4, "allreduce")
    assert reduce_scatter_for(1, f32, 1, "reduce_scatter")
    assert reduce_scatter_for(SCATTER_MIN, f16, 2, "auto") and reduce_scatter_for(SCATTER_MIN, np.dtype(BF16), 4, "auto")
    assert not reduce_scatter_for(SCATTER_MIN - 1, f16, 4, "auto")
    assert not reduce_scatter_for(1 << 20, f32, 2, "auto")  # float32: the Allreduce at 2 ranks,
    assert reduce_scatter_for(SCATTER_MIN_FP32, f32, 3, "auto") and reduce_scatter_for(1 << 20, f32, 4, "auto")  # from 3 on
    assert not reduce_scatter_for(SCATTER_MIN_FP32 - 1, f32, 4, "auto")  # float32's own minimum: 1 MiB,
    assert not reduce_scatter_for(105_814, f32, 4, "auto") and reduce_scatter_for(105_814, f16, 4, "auto")  # 16-bit's lower
    assert not reduce_scatter_for(1 << 20, f16, 1, "auto")


def test_plans_with_kinds_never_mix_them() -> None:
    sizes = [3, 5, 100, 7, 2, 9, 1]
    kinds = ["a", "b", "a", "a", "b", "a", "b"]
    calls = plan(sizes, [True] * len(sizes), 16, kinds=kinds)
    assert all(len({kinds[s.slot] for s in c.segments}) == 1 for c in calls)
    assert sorted((s.slot, s.src, s.length) for c in calls for s in c.segments) == sorted(
        [(i, 0, n) for i, n in enumerate(sizes) if n < 4] + [(i, 0, n) for i, n in enumerate(sizes) if 4 <= n < 16]
        + [(2, lo, min(16, 100 - lo)) for lo in range(0, 100, 16)]
    )
    assert all(c.length <= 16 for c in calls)


@pytest.mark.parametrize("strided", [False, True])
def test_one_rank_reduce_scatter_steps_are_bitwise_the_allreduce_steps(strided: bool) -> None:
    """At one rank the share is the whole call: staging, padding, gathering and copying back change no bit."""
    dtypes = [np.float32, BF16, np.float16, np.float32, BF16, np.float16, np.float32]
    sizes = [5, 40_000, 9_001, 20_000, 7, 3, 1]

    def arrays() -> list[np.ndarray]:
        r = np.random.default_rng(4)
        out = [(r.standard_normal(n) * 100).astype(d) for n, d in zip(sizes, dtypes)]
        if strided:
            out[1] = np.repeat(out[1], 2)[::2]  # a view with a stride: staged through a copy
        return out

    kinds = [np.dtype(d).name for d in dtypes]
    calls = plan(sizes, [True] * len(sizes), 4096, kinds=kinds)
    chunk = 4096
    want, got = arrays(), arrays()
    reduce_calls(calls, [slot(a) for a in want], np.empty(chunk, np.float32), lambda b: None, 7.0)
    scatter = Scatter.allocate(0, 1, "reduce_scatter", chunk)
    moves = Moves(lambda b: None, lambda send, recv: np.copyto(recv, send), lambda b: None)
    reduce_calls(calls, [slot(a) for a in got], np.empty(chunk, np.float32), moves, 7.0, scatter)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.tobytes() == g.tobytes()
