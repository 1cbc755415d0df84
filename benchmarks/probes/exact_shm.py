"""Could the exact reduction come nearer the raw float32 limit through node-shared memory? A prototype, timed.

Run it under MPI, all ranks on one node (every rank runs the same command)::

    NUMPY_MADVISE_HUGEPAGE=0 mpiexec -n 2 python -m mpi4py benchmarks/probes/exact_shm.py [--values 25000000]

Times three things in turns, the slowest rank's, medians of ``--reps``:

* ``raw``: the raw limit, a 4 MiB-chunked in-place float32 Allreduce of all values;
* ``exact``: mpidp's ``reduce`` of an ``exact=True`` session on its gradient buffers (one slot per buffer,
  25 M values in 160 buffers as ``benchmarks/exact.py speed``): pack, int64 Reduce_scatter_block, convert
  this rank's share, float32 Allgather into the buffers;
* ``shm``: the same arithmetic (one quantum for all values: the per-slot scales cost nothing here) on
  ``MPI_Win_allocate_shared`` windows, chunk by chunk: every rank packs its chunk into its own int64
  window; a barrier; every rank sums its share of every rank's window and converts it, in one pass, into
  a shared float32 window; a barrier; every rank copies the whole chunk out. Two sets of windows take
  turns, so one barrier per phase suffices. Its one quantum rounds otherwise than the per-slot ones, so
  its result is checked against ``exact``'s to a relative 1e-6, not bit for bit.

Nothing here is used by mpidp; it measures whether a node-local path is worth building (issue 33 item 7).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI
from numba import njit

import mpidp
from mpidp import exact
from mpidp.exact.compiled import maxabs, pack

COMM = MPI.COMM_WORLD


@njit(nogil=True, cache=True)
def sum_convert(w0: np.ndarray, w1: np.ndarray, lo: int, hi: int, scale: float, weight: float, out: np.ndarray) -> None:  # pragma: no cover
    """``out[i - lo] = float32(float64(w0[i] + w1[i]) * scale / weight)`` for ``i`` in ``[lo, hi)`` (``w1`` may be ``w0``'s zeros)."""
    for i in range(lo, hi):
        out[i - lo] = np.float32(np.float64(w0[i] + w1[i]) * scale / weight)


@njit(nogil=True, cache=True)
def add_into(acc: np.ndarray, w: np.ndarray, lo: int, hi: int) -> None:  # pragma: no cover
    for i in range(lo, hi):
        acc[i - lo] += w[i]


def shm_reduce(x: np.ndarray, wins: list[tuple[list[np.ndarray], np.ndarray]], node: MPI.Comm, chunk: int, weight: int) -> None:
    """The prototype: ``x`` becomes ``sum over ranks / weight`` through the shared windows (collective on ``node``)."""
    top, _ = maxabs(x.view(np.uint32))
    e = int(np.frexp(np.uint32(top).view(np.float32))[1])
    words = node.allgather(e)  # what the window's record carries, here alone
    q = min(words) - exact.BITS
    empty = np.zeros(0, np.int64)
    rank, size = node.rank, node.size
    for k, lo in enumerate(range(0, x.size, chunk)):
        ints, floats = wins[k % 2]
        hi = min(lo + chunk, x.size)
        n = hi - lo
        pack(x[lo:hi], 2.0 ** (exact.BITS - e), e - exact.BITS - q, empty, 0, ints[rank][:n])
        node.Barrier()  # every rank's ints are in place
        part = -(-n // size)
        a, b = min(n, rank * part), min(n, (rank + 1) * part)
        if size == 2:
            sum_convert(ints[0], ints[1], a, b, 2.0**q, float(weight), floats[a:b])
        else:  # more ranks: add all but two into a scratch copy first
            scratch = ints[0][a:b].copy()
            for w in ints[1:-1]:
                add_into(scratch, w, a, b)
            sum_convert(scratch, ints[-1][a:b], 0, b - a, 2.0**q, float(weight), floats[a:b])
        node.Barrier()  # every share is converted
        x[lo:hi] = floats[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=25_000_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk-mib", type=int, default=4, help="MiB of int64 per chunk of the prototype")
    args = ap.parse_args()
    node = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    assert node.size == COMM.size, "run every rank on one node"
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, 160).astype(np.float64)
    sizes = np.maximum(1, (sizes / sizes.sum() * args.values).astype(int)).tolist()
    total = sum(sizes)
    chunk = (args.chunk_mib << 20) // 8
    wins, keep = [], []
    for _ in range(2):  # two sets of windows, in turns
        wi = MPI.Win.Allocate_shared(chunk * 8, 8, comm=node)
        wf = MPI.Win.Allocate_shared(chunk * 4 if node.rank == 0 else 0, 4, comm=node)
        ints = [np.frombuffer(wi.Shared_query(r)[0], np.int64, chunk) for r in range(node.size)]
        floats = np.frombuffer(wf.Shared_query(0)[0], np.float32, chunk)
        wins.append((ints, floats))
        keep += [wi, wf]
    p = {f"p{i:03d}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}
    dp = mpidp.DataParallel.initialize(p, COMM, exact=True)
    g = dp.gradient_buffers()
    raw = np.ones(total, np.float32)
    x = np.empty(total, np.float32)
    values = rng.standard_normal(total).astype(np.float32) * np.float32(COMM.rank + 1)
    times: dict[str, list[float]] = {"raw": [], "exact": [], "shm": []}
    for rep in range(args.reps + 1):
        for key, samples in times.items():
            if key == "exact":
                at = 0
                for v in g.values():
                    v[...] = values[at : at + v.size]
                    at += v.size
            x[...] = values
            COMM.Barrier()
            t = time.perf_counter()
            if key == "raw":
                for lo in range(0, total, (4 << 20) // 4):
                    COMM.Allreduce(MPI.IN_PLACE, raw[lo : lo + (4 << 20) // 4], MPI.SUM)
            elif key == "exact":
                dp.reduce(g, 3)
            else:
                shm_reduce(x, wins, node, chunk, 3 * COMM.size)
            dt = COMM.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if rep:
                samples.append(dt)
    flat = np.concatenate([v.reshape(-1) for v in g.values()])  # the buffers in slot order, as x
    scale = float(np.abs(flat).max())
    close = COMM.allreduce(int(float(np.abs(flat.astype(np.float64) - x).max()) <= 1e-6 * scale), op=MPI.MIN)
    dp.close()
    for w in keep:
        w.Free()
    if COMM.rank == 0:
        limit = statistics.median(times["raw"])
        print(f"{COMM.size} ranks, {total / 1e6:.1f} M values, {args.reps} reps; shm within 1e-6 of exact: {bool(close)}")
        for key, ts in times.items():
            m = statistics.median(ts)
            print(f"{key:6} {m * 1e3:7.1f} ms  {m / limit:5.2f}x the raw limit")


if __name__ == "__main__":
    main()
