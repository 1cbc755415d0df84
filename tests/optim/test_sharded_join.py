"""A rank with no data left still owns and steps its slice (``dp.join``): one process's bits over the same micro-batches."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import first_ranks
from mpi4py import MPI

import mpidp
from mpidp import optim

SHAPES = {"a": (7,), "b": (33, 3), "c": (5001,)}
WINDOWS, MICRO = 4, 5


def grads(p: dict[str, np.ndarray], window: int, i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * window + i)
    return {k: (rng.standard_normal(v.shape) * (i + 1)).astype(v.dtype) for k, v in p.items()}


def run(comm: MPI.Comm, plan: dict[int, list[list[int]]]) -> str:
    """Exact sharded AdamW windows; ``plan[rank]`` lists each of its windows' micro-batches (shorter lists: it runs out)."""
    rng = np.random.default_rng(3)
    p = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    with mpidp.DataParallel.initialize(p, comm, exact=True) as dp:
        opt = optim.AdamW(dp, lr=1e-2, weight_decay=0.1)
        window = 0
        for mine in dp.join(plan[dp.rank]):
            weight = 0
            for i in mine or []:  # None: this rank's data ran out, it still owns and steps its slice
                dp.fold(grads(p, window, i))
                weight += i % 3 + 1
            opt.step({}, weight, step=window, max_norm=3.0)
            window += 1
        assert window == WINDOWS
    return hashlib.sha256(b"".join(p[k].tobytes() for k in sorted(p))).hexdigest()


@pytest.mark.mpi(min_size=2)
def test_a_rank_out_of_data_steps_its_slice_and_the_bits_are_one_process_s(comm: MPI.Comm) -> None:
    size = comm.size
    last = size - 1
    # every rank takes its share of each window's micro-batches; the last rank runs out after 2 windows
    plan = {r: [list(mpidp.shard(MICRO, r, size)) for _ in range(2 if r == last else WINDOWS)] for r in range(size)}
    alone = {0: [[i for r in range(size) for i in (plan[r][w] if w < len(plan[r]) else [])] for w in range(WINDOWS)]}
    with first_ranks(comm, 1) as one:
        expected = run(one, alone) if one is not None else None
    expected = comm.bcast(expected)
    assert run(comm, plan) == expected
