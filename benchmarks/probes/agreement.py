"""What one window's agreement costs: ``reduce`` of a one-tensor model, the exchange and almost nothing else.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 2 python -m mpi4py benchmarks/probes/agreement.py --calls 3000 --rounds 5

With ``--sessions 2`` a second session over the same ranks is made first
and reduced once per round (its frame is the wider: the first session's
records grow to its width), so the timed session's agreement is the one of
a job of several sessions (issue 44). Prints the median microseconds per
``reduce`` over the rounds (each round's mean over ``--calls`` calls, the
slowest rank's), the same on every rank; nothing gates on it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpidp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="reduce calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=1, choices=(1, 2), help="sessions over the same ranks (the timed one first)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    grads = {"w": np.ones(8, np.float32)}
    dp = mpidp.DataParallel.initialize({"w": np.zeros(8, np.float32)}, comm)
    other = None
    if args.sessions == 2:
        other = mpidp.DataParallel.initialize({f"p{i}": np.zeros(2, np.float32) for i in range(130)}, comm)
    means = []
    for _ in range(args.rounds):
        if other is not None:
            other.reduce({f"p{i}": np.ones(2, np.float32) for i in range(130)}, 1)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            dp.reduce(grads, 1)
        means.append(comm.allreduce((time.perf_counter() - start) / args.calls, op=MPI.MAX))
    if other is not None:
        other.close()
    dp.close()
    if comm.rank == 0:
        print(f"reduce of one 8-value tensor, {comm.size} ranks, {args.sessions} session(s): "
              f"{statistics.median(means) * 1e6:.1f} us per call (median of {args.rounds} rounds of {args.calls})")


if __name__ == "__main__":
    main()
