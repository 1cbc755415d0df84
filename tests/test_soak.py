"""Soak: 1,000 windows of random weights, random absent gradients and both policies."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import MissingGradientPolicy

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport

WINDOWS = int(os.environ.get("MPIDP_SOAK_WINDOWS", "1000"))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.mpi(min_size=2)
def test_soak(comm: MPI.Comm) -> None:
    shapes = {"a": (3,), "b": (50,), "c": (40, 25), "d": (64,), "e": (5, 8), "tied": None}
    dtypes = {"a": np.float32, "b": np.float32, "c": np.float32, "d": ml_dtypes.bfloat16, "e": np.float16}
    rng = np.random.default_rng(comm.rank)
    params = {k: rng.standard_normal(shapes[k]).astype(dtypes[k]) for k in dtypes}
    params["tied"] = params["c"]
    trainable = sorted(dtypes)
    shared = np.random.default_rng(12345)  # the same stream on every rank: the window's policy
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=4096) as dp:
        baseline = 0
        for window in range(WINDOWS):
            zero = bool(shared.random() < 0.5)
            policy = MissingGradientPolicy.ZERO if zero else MissingGradientPolicy.ERROR
            weight = int(rng.integers(0, 4)) * int(rng.integers(0, 1000))  # zero about a quarter of the time
            if window % 7 == 0 and comm.rank == 0:
                weight = max(weight, 1)  # never a zero global weight here; that error is tested elsewhere
            names = [n for n in trainable if rng.random() < 0.7] if (zero or weight == 0) else trainable
            grads = {n: rng.standard_normal(params[n].shape).astype(params[n].dtype) for n in names}
            every = comm.allgather((weight, {n: g.astype(np.float64) for n, g in grads.items()}))
            total = sum(w for w, _ in every)
            if total == 0:
                with pytest.raises(mpidp.ContractError, match="global weight is 0"):
                    dp.reduce(grads, weight, policy)
                continue
            out = dp.reduce(grads, weight, policy)
            expected: dict[str, np.ndarray] = {}
            for w, g in every:
                for n, v in g.items():
                    if w > 0:
                        expected[n] = expected.get(n, 0) + v
            assert out.global_weight == total
            assert sorted(out.gradients) == sorted(expected), window
            for n, v in out.gradients.items():
                exact = expected[n] / total
                tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[v.dtype.name]
                assert np.abs(v.astype(np.float64) - exact).max() <= tol * max(1.0, np.abs(exact).max()), (window, n)
            mine = {n: v.tobytes() for n, v in out.gradients.items()}
            assert all(o == mine for o in comm.allgather(mine)), window
            for n, v in out.gradients.items():
                params[n] -= (0.01 * v.astype(np.float32)).astype(v.dtype)
            if window == 100:
                baseline = resident_bytes()
        dp.verify_replicas()
        growth = resident_bytes() - baseline
        assert growth < 4 << 20, f"resident memory grew by {growth} bytes after warm-up"
