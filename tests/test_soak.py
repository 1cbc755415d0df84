"""Soak: 1,000 windows of random weights, random absent gradients and both policies."""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import MissingGradientPolicy

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport

WINDOWS = int(os.environ.get("MPIDP_SOAK_WINDOWS", "1000"))
#: the last windows, traced byte by byte (tracemalloc slows every allocation: over all 900, the test took 3x as long)
TRACED = 100


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def draw(rng: np.random.Generator, params: dict[str, np.ndarray], zero: bool, first: bool) -> tuple[int, dict[str, np.ndarray]]:
    """One rank's window: its weight (zero about a quarter of the time) and gradients (some absent where allowed).

    ``first``: rank 0 on every 7th window, whose weight is never zero (no zero global weight here; tested elsewhere).
    """
    trainable = sorted(n for n in params if n != "tied")
    weight = int(rng.integers(0, 4)) * int(rng.integers(0, 1000))
    if first:
        weight = max(weight, 1)
    names = [n for n in trainable if rng.random() < 0.7] if (zero or weight == 0) else trainable
    return weight, {n: rng.standard_normal(params[n].shape).astype(params[n].dtype) for n in names}


@pytest.mark.mpi(min_size=2)
def test_soak(comm: MPI.Comm) -> None:
    """Every rank draws every rank's window from that rank's own stream (no test traffic between the reductions), so
    the expected mean is known locally; the ranks compare their results' digests once, at the end, window by window."""
    shapes = {"a": (3,), "b": (50,), "c": (40, 25), "d": (64,), "e": (5, 8), "tied": None}
    dtypes = {"a": np.float32, "b": np.float32, "c": np.float32, "d": ml_dtypes.bfloat16, "e": np.float16}
    start = [np.random.default_rng(r) for r in range(comm.size)]
    every_params = [{k: g.standard_normal(shapes[k]).astype(dtypes[k]) for k in dtypes} for g in start]
    params = every_params[comm.rank]
    params["tied"] = params["c"]
    shared = np.random.default_rng(12345)  # the same stream on every rank: the window's policy
    digests = bytearray(32 * WINDOWS)  # each reduction's sha256, in place: the test's own record allocates nothing
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=4096) as dp:
        baseline, blocks = 0, sys.getallocatedblocks()
        for window in range(WINDOWS):
            if window == 100:  # after the warm-up (here: a window that may end in the zero-weight error)
                baseline = resident_bytes()
                gc.collect()  # a full collection empties the free lists: what stays allocated after is held
                blocks = sys.getallocatedblocks()
            if window == WINDOWS - TRACED:  # the last windows: what Python and NumPy allocate and keep, to the byte
                gc.collect()
                tracemalloc.start()
            zero = bool(shared.random() < 0.5)
            policy = MissingGradientPolicy.ZERO if zero else MissingGradientPolicy.ERROR
            every = [draw(g, params, zero, window % 7 == 0 and r == 0) for r, g in enumerate(start)]
            weight, grads = every[comm.rank]
            total = sum(w for w, _ in every)
            if total == 0:
                with pytest.raises(mpidp.ContractError, match="global weight is 0"):
                    dp.reduce(grads, weight, policy)
                continue
            expected: dict[str, np.ndarray] = {}  # before the reduction, which may sum this rank's arrays in place
            for w, g in every:
                for n, v in g.items():
                    if w > 0:
                        expected[n] = expected.get(n, 0) + v.astype(np.float64)
            out = dp.reduce(grads, weight, policy)
            assert out.global_weight == total
            assert sorted(out.gradients) == sorted(expected), window
            for n, v in out.gradients.items():
                exact = expected[n] / total
                tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[v.dtype.name]
                assert np.abs(v.astype(np.float64) - exact).max() <= tol * max(1.0, np.abs(exact).max()), (window, n)
            digest = hashlib.sha256(b"".join(n.encode() + out.gradients[n].tobytes() for n in sorted(out.gradients))).digest()
            digests[32 * window : 32 * window + 32] = digest
            for n, v in out.gradients.items():
                params[n] -= (0.01 * v.astype(np.float32)).astype(v.dtype)
        dp.verify_replicas()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]  # mpidp is Python over NumPy: what it keeps, it keeps here
        tracemalloc.stop()
        blocks = sys.getallocatedblocks() - blocks
        growth = resident_bytes() - baseline
    others = comm.allgather(bytes(digests))
    differ = [w for w in range(WINDOWS) if len({o[32 * w : 32 * w + 32] for o in others}) > 1]
    assert not differ, f"ranks' results differ from reduction {differ[:1]} on"
    assert blocks < 600, f"{blocks} more Python objects (pymalloc blocks) are held than after warm-up"
    assert held < 128 << 10, f"{held} bytes that Python and NumPy allocated in the last {TRACED} windows are still held"
    assert growth < 16 << 20, f"resident memory grew by {growth} bytes after warm-up"
