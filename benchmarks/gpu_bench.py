"""GPU reduce benchmark: mpidp on CuPy gradients against a raw CuPy-buffer Allreduce of the same bytes.

Run: ``mpiexec -n 4 python -m mpi4py benchmarks/gpu_bench.py [--mib 256] [--reps 5]``
(ranks may share one GPU). Prints whether this MPI is CUDA-aware or staged,
the median time of each variant, and the ratios of mpidp to the limits:

* ``raw``: a raw CuPy-buffer Allreduce of the same bytes in the same
  chunks, the device buffer handed to MPI where the MPI is CUDA-aware,
  else each chunk copied down into pinned memory, summed and copied up
  one after the other (what a hand-written staged loop does);
* ``host``: the same chunked Allreduce of host (pinned) memory, no device
  copies at all: the MPI limit, which a staged pipeline can approach only
  when its copies hide behind the communication.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpidp
from mpidp import cuda


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="fp32 gradient bytes per rank, in MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import cupy

    comm = MPI.COMM_WORLD
    device = cuda.select_device(comm)
    n = args.mib * (1 << 20) // 4
    sizes = np.full(args.tensors, n // args.tensors)
    params = {f"t{i:03d}": cupy.zeros(int(s), dtype=cupy.float32) for i, s in enumerate(sizes)}
    dp = mpidp.DataParallel.initialize(params, comm)
    grads = dp.gradient_buffers()
    aware, reason = dp.cuda_aware
    flat = cupy.ones(int(sizes.sum()), dtype=cupy.float32)
    chunk = 4 << 20
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(chunk), dtype=np.float32)

    def raw() -> None:
        cupy.cuda.get_current_stream().synchronize()
        for start in range(0, flat.size, chunk // 4):
            part = flat[start : start + chunk // 4]
            if aware:
                comm.Allreduce(MPI.IN_PLACE, part, MPI.SUM)
            else:
                host = pinned[: part.size]
                part.get(out=host)
                comm.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
                part.set(host)
        cupy.cuda.get_current_stream().synchronize()

    host_flat = np.frombuffer(cupy.cuda.alloc_pinned_memory(flat.nbytes), dtype=np.float32, count=flat.size)
    host_flat[...] = 1

    def host() -> None:
        for start in range(0, host_flat.size, chunk // 4):
            comm.Allreduce(MPI.IN_PLACE, host_flat[start : start + chunk // 4], MPI.SUM)

    def reduce() -> None:
        dp.reduce(grads, 1)
        cupy.cuda.get_current_stream().synchronize()

    times: dict[str, list[float]] = {"raw": [], "host": [], "mpidp": []}
    for rep in range(args.reps + 1):
        for name, fn in (("raw", raw), ("host", host), ("mpidp", reduce)):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if rep:  # the first repetition is warm-up
                times[name].append(dt)
    def ratio(limit: str) -> float:  # median of per-repetition ratios
        return statistics.median(m / r for m, r in zip(times["mpidp"], times[limit]))

    if comm.rank == 0:
        print(f"GPU cuda:{device}, {comm.size} ranks, {args.mib} MiB fp32 in {args.tensors} tensors")
        print(f"MPI: {'CUDA-aware' if aware else 'host-staged'} ({reason})")
        if getattr(cupy, "_mpidp_fake", False):
            print("  (the CPU stand-in for CuPy, tests/fakegpu: these are not GPU times)")
        for name, ts in times.items():
            print(f"  {name:6s} median {statistics.median(ts) * 1e3:9.2f} ms")
        print(f"  mpidp / raw:  {ratio('raw'):.2f}x (median of per-repetition ratios)")
        print(f"  mpidp / host: {ratio('host'):.2f}x (the MPI limit: the same Allreduce of host memory)")
    dp.close()


if __name__ == "__main__":
    main()
