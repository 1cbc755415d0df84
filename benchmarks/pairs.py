"""Two sessions' reduce windows, timed in alternating pairs: the harness of reduction_ab.py and versus.py.

Both sessions reduce the same values every window; which goes first
alternates, and each pair gives one ratio, so load changes on a shared
machine cancel.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from mpi4py import MPI

COMM = MPI.COMM_WORLD

#: a session under test: (its DataParallel, the gradients it reduces every window)
Session = tuple[Any, dict[str, Any]]


def window(dp: Any, grads: dict[str, Any]) -> float:
    """One reduce window from the same values; the slowest rank's seconds (collective)."""
    for g in grads.values():
        g.fill(1.0 + COMM.rank / 8)
    COMM.Barrier()
    t0 = time.perf_counter()
    dp.reduce(grads, 1 + (COMM.rank == 0))
    return float(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))


def alternate(base: Session, other: Session, reps: int, warmup: int = 1) -> dict[str, Any]:
    """``reps`` pairs of windows (collective): the median of other / base, its range, both median times."""
    for _ in range(warmup):  # first touch, the kept plans and programs
        window(*base)
        window(*other)
    ratios, before, now = [], [], []
    for r in range(reps):
        if r % 2 == 0:
            b = window(*base)
            o = window(*other)
        else:
            o = window(*other)
            b = window(*base)
        ratios.append(o / b)
        before.append(b)
        now.append(o)
    return {
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "base_seconds": statistics.median(before), "other_seconds": statistics.median(now),
    }
