"""Where the reduction left after backward goes, with ``overlap="thread"``: one step's timeline on rank 0.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 2 python -m mpi4py benchmarks/probes/overlap_timeline.py --model offcpu-resnet-3m
    mpiexec -n 2 python -m mpi4py benchmarks/probes/overlap_timeline.py --model offcpu-gpt2-5m --no-weight

It trains one of ``train_step.py``'s models with ``overlap="thread"`` (and,
unless ``--no-weight``, ``dp.expect_weight`` before backward) for
``--steps`` steps and prints, for the last ones, when each bucket was queued
and when the communication thread's calls ran, relative to the end of
backward on rank 0, then the parts of ``reduce``: the checks, the agreement
(checks and exchange), and the last bucket, summed in place after it
(``tail``). A probe, not a benchmark: it wraps private methods of the
session to read the clock (the progress engine's ``queue``, the buckets'
communicator's ``Allreduce_into``, ``DataParallel.agree_window`` and
``_check_window``, ``Overlapped._finish``, which sums the tail).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/

import train_step as ts

import mpidp.torch

COMM = MPI.COMM_WORLD


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="offcpu-resnet-3m", help="one of train_step.py's: " + ", ".join([*ts.MODELS, *ts.OFFCPU]))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--show", type=int, default=2, help="print the last SHOW steps")
    ap.add_argument("--bucket-bytes", type=int, default=None)
    ap.add_argument("--no-weight", action="store_true", help="do not give the weight before backward")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.model in ts.OFFCPU:
        real_make, batch = ts.MODELS[ts.OFFCPU[args.model]]
        f, b = ts.calibrate(ts.OFFCPU[args.model])
        torch.manual_seed(1234)
        model: torch.nn.Module = ts.OffCPU(real_make(), f, b)
        loss_of = ts.offcpu_loss
    else:
        make, batch = ts.MODELS[args.model]
        torch.manual_seed(1234)
        model, loss_of = make(), ts.real_loss
    dp = mpidp.torch.DataParallel(model, flat_parameters=True, overlap="thread", bucket_bytes=args.bucket_bytes)
    x, target = batch(COMM.rank, torch.Generator().manual_seed(COMM.rank + 1))
    tokens = int((target != -100).sum())
    owner = dp._overlap.owner  # type: ignore[union-attr]
    events: list[tuple[Any, ...]] = []
    start = [0.0]

    def clock() -> float:
        return time.perf_counter() - start[0]

    def wrap(obj: Any, name: str, label: str) -> None:
        real = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return real(*a, **k)
            finally:
                size = a[0].size if label == "call" and hasattr(a[0], "size") else None
                events.append((label, t, clock(), size))

        setattr(obj, name, timed)

    wrap(owner._engine.comm, "Allreduce_into", "call")
    wrap(owner._engine, "queue", "queue")
    wrap(dp._core, "agree_window", "agreement")
    wrap(dp._core, "_check_window", "checks")
    wrap(owner, "_finish", "tail")
    for step in range(args.steps):
        events.clear()
        COMM.Barrier()
        start[0] = time.perf_counter()
        if not args.no_weight:
            dp.expect_weight(tokens)
        loss_of(model(x), target).backward()
        backward = clock()
        dp.reduce(local_weight=tokens)
        end = clock()
        dp.zero_grad()
        slowest = max(COMM.allgather(backward))  # the clocks started at the same Barrier
        if COMM.rank == 0 and step >= args.steps - args.show:
            print(
                f"step {step}: backward ended at {backward * 1e3:.1f} ms (the slowest rank's {(slowest - backward) * 1e3:+.2f} ms later); "
                f"reduce took {(end - backward) * 1e3:.2f} ms"
            )
            for label, t0, t1, size in events:
                what = f"{size} values" if size is not None else ""
                print(f"  {label:9s} {(t0 - backward) * 1e3:+8.2f} .. {(t1 - backward) * 1e3:+8.2f} ms  {what}")
    dp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
