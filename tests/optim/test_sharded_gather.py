"""The sharded step's gather moves the parameters' own bytes: half for 16-bit models, the same results bit for bit (collective).

The reference is the float32 gather the step used before (every value
widened to float32, equal padded blocks, one Allgather per round), put back
in place of the byte gather; the counts come from wrapping the communicator.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import first_ranks
from mpi4py import MPI

import mpidp
import mpidp.optim as mo
from mpidp import comm as mpidp_comm
from mpidp.cut import pieces
from mpidp.exact import shard
from mpidp.optim import moves

BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = {"a": 1, "b": 7, "c": 99, "d": 3001, "e": 65}  # rounds of 4096 bytes end inside elements at 3 ranks


def float32_gather(self: mo.ShardedOptimizer, updated: list[bool], operation: str) -> None:
    """The step's former gather: float32 rounds of ``chunk`` values per rank, padded, one Allgather each."""
    cut, flats = self.cut, self._flats

    def fill(lo: int, hi: int, out: np.ndarray) -> None:
        for p in pieces(cut.begin, lo, hi):
            out[p.offset : p.offset + p.b - p.a] = flats[p.slot][p.a : p.b]

    if cut.size == 1:
        return
    c, n = moves.rounds(cut, self._chunk)
    buf = np.zeros(cut.size * c, np.float32)
    for k in range(n):
        lo = cut.lo + k * c
        fill(lo, min(lo + c, cut.hi), buf[cut.rank * c :])
        self._comm.Allgather_in_place(buf, f"{operation}: Allgather")
        for j in range(cut.size):
            lo = cut.bounds[j] + k * c
            for p in pieces(cut.begin, lo, min(lo + c, cut.bounds[j + 1])):
                if updated[p.slot] and j != cut.rank:
                    flats[p.slot][p.a : p.b] = buf[j * c + p.offset : j * c + p.offset + p.b - p.a]


class Bytes:
    """Counts the bytes the gathers hand to MPI (each rank's contribution, summed over calls) and the largest call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.moved, self.largest = 0, 0
        allgatherv, allgather = mpidp_comm.Communicator.Allgatherv_in_place, mpidp_comm.Communicator.Allgather_in_place

        def counted_v(comm: Any, buf: np.ndarray, counts: list[int], displs: list[int], operation: str) -> None:
            if ": parameters" in operation:
                self.moved += sum(counts)
                self.largest = max(self.largest, sum(counts))
            allgatherv(comm, buf, counts, displs, operation)

        def counted(comm: Any, buf: np.ndarray, operation: str) -> None:
            if ": parameters" in operation:  # not the exact reduction's own
                self.moved += buf.nbytes
            allgather(comm, buf, operation)

        monkeypatch.setattr(mpidp_comm.Communicator, "Allgatherv_in_place", counted_v)
        monkeypatch.setattr(mpidp_comm.Communicator, "Allgather_in_place", counted)


def train(comm: MPI.Comm, dtype: np.dtype, exact: bool) -> dict[str, np.ndarray]:
    """Three AdamW steps (clipped) on a model of ``dtype``; the parameters."""
    rng = np.random.default_rng(3)
    p = {k: rng.standard_normal(n).astype(dtype) for k, n in SIZES.items()}
    with mpidp.DataParallel.initialize(p, comm, exact=exact, chunk_bytes=4096) as dp:
        opt = mo.AdamW(dp, [{"params": ["a", "b", "c", "d"]}, {"params": ["e"], "weight_decay": 0.0}], lr=1e-2)
        for s in range(3):
            grads: dict[str, np.ndarray] = {}
            weight = 0
            for i in shard(4, dp.rank, dp.world_size):
                rng = np.random.default_rng(100 * s + i)
                g = {k: (rng.standard_normal(v.size) * (i + 1)).astype(dtype) for k, v in p.items()}
                if exact:
                    dp.fold(g)
                else:  # this rank's loss sum, summed here
                    grads = {k: grads[k] + g[k] if k in grads else g[k] for k in g}
                weight += i + 1
            opt.step(grads, weight, step=s, max_norm=3.0)
        dp.close()
    return p


@pytest.mark.parametrize("exact", [False, True])
def test_the_gather_moves_each_parameter_in_its_own_dtype(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, exact: bool) -> None:
    for n in sorted({min(3, comm.size), comm.size}):
        with first_ranks(comm, n) as sub:
            if sub is None:
                continue
            moved: dict[tuple[str, str], int] = {}
            results: dict[tuple[str, str], dict[str, np.ndarray]] = {}
            for dtype in (np.dtype(np.float32), BF16):
                for how in ("bytes", "float32"):
                    with monkeypatch.context() as m:
                        if how == "float32":
                            m.setattr(mo.ShardedOptimizer, "_gather", float32_gather)
                        count = Bytes(m)
                        results[dtype.name, how] = train(sub, dtype, exact)
                    moved[dtype.name, how] = count.moved
                    assert count.largest <= 4096
                for k, v in results[dtype.name, "bytes"].items():  # the same bits as the float32 gather's
                    assert v.tobytes() == results[dtype.name, "float32"][k].tobytes(), (n, dtype, k)
            total = sum(SIZES.values())
            steps = 3 if n > 1 else 0  # a world of one gathers nothing
            assert moved["float32", "bytes"] == steps * 4 * total  # each parameter's bytes once, unpadded
            assert moved["bfloat16", "bytes"] == steps * 2 * total == moved["float32", "bytes"] // 2
            assert moved["bfloat16", "bytes"] * 2 <= moved["bfloat16", "float32"]
            every = sub.allgather({k: v.tobytes() for k, v in results["bfloat16", "bytes"].items()})
            assert all(e == every[0] for e in every)  # replicas bitwise equal
