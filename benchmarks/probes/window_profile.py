"""Where a window's time goes: mpidp ``reduce`` next to the raw limit, then cProfile of rank 0.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 2 python -m mpi4py benchmarks/probes/window_profile.py --set resnet50 --mix fp32
    mpiexec -n 2 python -m mpi4py benchmarks/probes/window_profile.py --set gpt2 --mix mixed --windows 5
    mpiexec -n 2 python -m mpi4py benchmarks/probes/window_profile.py --set tiny --arrays --torch

It times the raw chunked Allreduce limit (``--limit-chunk`` MiB) and mpidp's
reduce in alternating pairs, as ``bench.py`` does, prints the ratio, then
profiles ``--windows`` reduce calls on rank 0 (gradients refilled, untimed
and unprofiled, before each) and prints the functions by own time:
``comm.py:Allreduce`` is the MPI time, ``reduce_calls`` / ``_unpack`` own time
is the division, ``copy_`` the torch casts, the rest is the window's checks.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the checkout

import bench
import gradsets

import mpidp

COMM = MPI.COMM_WORLD


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="resnet50", help=f"gradient set: {', '.join(gradsets.SETS)}")
    p.add_argument("--mix", default="fp32", choices=gradsets.MIXES)
    p.add_argument("--arrays", action="store_true", help="caller-allocated arrays instead of gradient_buffers()")
    p.add_argument("--torch", action="store_true", help="import torch first (its 16-bit casts; one thread per rank)")
    p.add_argument("--limit-chunk", type=int, default=4, help="MiB per call of the raw limit (default 4)")
    p.add_argument("--chunk-bytes", type=int, default=bench.DEFAULT_CHUNK_BYTES, help="mpidp's chunk_bytes")
    p.add_argument("--reps", type=int, default=7, help="paired repetitions (default 7)")
    p.add_argument("--windows", type=int, default=10, help="profiled reduce calls (default 10)")
    p.add_argument("--top", type=int, default=15, help="functions shown (default 15)")
    a = p.parse_args(argv)
    if a.torch:
        import torch

        torch.set_num_threads(1)
    _, layout = gradsets.shapes(a.set)
    n = gradsets.count(layout)
    params = bench.random_arrays(layout, a.mix, 7000 + COMM.rank)
    limit_buf = bench.np.full(n, 0, dtype=bench.np.float32)  # written memory, as bench.py's
    limit = bench.raw_allreduce(limit_buf, a.limit_chunk * bench.MIB)
    with mpidp.DataParallel.initialize(params, COMM, chunk_bytes=a.chunk_bytes) as dp:
        grads = bench.empty_arrays(layout, a.mix) if a.arrays else dp.gradient_buffers()
        reset = bench.reset_values(list(grads.values()))
        fn = bench.mpidp_reduce(dp, grads)
        probe = bench.timed(fn, 1, reset)
        inner = bench.inner_for(probe, 0.05)
        res = bench.paired(limit, fn, a.reps, 1, inner, reset, lambda: limit_buf.fill(0))
        profile = cProfile.Profile()
        for _ in range(a.windows):
            reset()
            COMM.Barrier()
            profile.enable()
            fn()
            profile.disable()
    if COMM.rank == 0:
        kind = "separate arrays" if a.arrays else "gradient_buffers"
        print(f"{a.set} {a.mix} {kind}, {COMM.size} ranks, chunk_bytes {a.chunk_bytes >> 20} MiB: reduce "
              f"{res['seconds'] * 1e3:.2f} ms, raw limit ({a.limit_chunk} MiB calls) {res['limit_seconds'] * 1e3:.2f} ms, "
              f"ratio x{res['ratio']:.2f} (per repetition: {', '.join(f'{r:.2f}' for r in res['samples']['ratios'])}; "
              f"median of medians {statistics.median(res['samples']['ratios']):.2f})")
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.top)
        print(f"cProfile of rank 0, {a.windows} windows (divide the times by {a.windows} for one window):")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
