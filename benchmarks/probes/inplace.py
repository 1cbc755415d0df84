"""What an out-of-place Allreduce costs MPI against an in-place one: the reason the last bucket is summed in place.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 2 python -m mpi4py benchmarks/probes/inplace.py            # 77 MB, GPT-2 29.7 M's tied embedding
    mpiexec -n 4 python -m mpi4py benchmarks/probes/inplace.py --mib 16 --reps 5

Sums ``--mib`` MiB of float32 in calls of ``--chunk-mib`` MiB, each call
followed by its division by the global weight (as :mod:`mpidp.overlap.owner`'s
calls are), two ways in turns: in place (``MPI.IN_PLACE``, what ``reduce``
does with the last bucket once the window is agreed) and from a send buffer
into a receive buffer (what the buckets do while backward runs, so that the
caller's gradients are not written before the window is agreed). Prints the
medians and their ratio (slowest rank's times); nothing gates on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=73.6, help="MiB of float32 summed (default: 19.3 M values, GPT-2's 50257x384 embedding)")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="MiB per call (default 4, mpidp's chunk_bytes)")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args(argv)
    n = max(1, int(args.mib * (1 << 20)) // 4)
    chunk = max(1, int(args.chunk_mib * (1 << 20)) // 4)
    send = np.full(n, 1.0, np.float32)
    recv = np.zeros(n, np.float32)
    weight = np.float32(3 * COMM.size)

    def in_place() -> None:
        for lo in range(0, n, chunk):
            part = send[lo : lo + chunk]
            COMM.Allreduce(MPI.IN_PLACE, part, MPI.SUM)
            np.divide(part, weight, out=part)

    def out_of_place() -> None:
        for lo in range(0, n, chunk):
            part = recv[lo : lo + chunk]
            COMM.Allreduce(send[lo : lo + chunk], part, MPI.SUM)
            np.divide(part, weight, out=part)

    def timed(fn: Callable[[], None]) -> float:
        send.fill(1.0)  # written memory, the same values every time
        COMM.Barrier()
        t0 = time.perf_counter()
        fn()
        return float(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))

    timed(in_place), timed(out_of_place)  # warm-up: pages faulted in, MPI's buffers made
    times: dict[str, list[float]] = {"in place": [], "out of place": []}
    for _ in range(args.reps):
        times["in place"].append(timed(in_place))
        times["out of place"].append(timed(out_of_place))
    if COMM.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{n * 4 / 1e6:.1f} MB in {args.chunk_mib:g} MiB calls, {COMM.size} ranks, medians of {args.reps}:")
        for k, v in med.items():
            print(f"  {k:13s} {v * 1e3:8.2f} ms")
        print(f"  out of place / in place: {med['out of place'] / med['in place']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
