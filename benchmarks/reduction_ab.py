"""A/B of the two host reductions on the same gradients: reduce-scatter (or auto) against Allreduce.

Two sessions on one gradient set, one with ``MPIDP_REDUCTION=allreduce``,
one with the other mode; their reduce calls alternate (which goes first
alternates too) and the ratio of each pair is taken, so load changes on a
shared machine cancel. Prints the median ratio (other mode / allreduce)::

    mpiexec -n 2 python -m mpi4py benchmarks/reduction_ab.py --set resnet50 --mix mixed --kind buffers
    mpiexec -n 4 python -m mpi4py benchmarks/reduction_ab.py --set gpt2 --mix fp16 --casts numpy --mode auto
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradsets
import pairs

import mpidp

COMM = MPI.COMM_WORLD


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="resnet50", choices=list(gradsets.SETS))
    p.add_argument("--mix", default="mixed", choices=gradsets.MIXES)
    p.add_argument("--kind", default="buffers", choices=("buffers", "arrays"), help="gradient_buffers or caller arrays")
    p.add_argument("--casts", default="torch", choices=("torch", "numba", "numpy"),
                   help="16-bit casts: torch's (imports torch), mpidp.kernels' (numba) or NumPy's")
    p.add_argument("--mode", default="reduce_scatter", choices=("reduce_scatter", "auto"), help="the mode timed against allreduce")
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if a.casts == "torch":
        import torch

        torch.set_num_threads(1)
    else:
        os.environ["MPIDP_CASTS"] = a.casts  # read by initialize (this checkout's sessions; an older mpidp ignores it)
    _, layout = gradsets.shapes(a.set)
    params = {n: np.zeros(s, gradsets.dtype_of(a.mix, s)) for n, s in layout}
    sessions: dict[str, tuple[mpidp.DataParallel, dict[str, Any]]] = {}
    for mode in ("allreduce", a.mode):
        os.environ["MPIDP_REDUCTION"] = mode  # read by initialize, alike on every rank
        dp = mpidp.DataParallel.initialize(params, COMM)
        grads = dp.gradient_buffers() if a.kind == "buffers" else {n: np.empty(s, gradsets.dtype_of(a.mix, s)) for n, s in layout}
        sessions[mode] = (dp, grads)

    res = pairs.alternate(sessions["allreduce"], sessions[a.mode], a.reps)
    if COMM.rank == 0:
        print(f"{a.set} {a.mix} {a.kind}, {a.casts} casts, {COMM.size} ranks: {a.mode} / allreduce "
              f"median {res['ratio']:.3f} (min {res['ratio_min']:.3f}, max {res['ratio_max']:.3f}); "
              f"allreduce {res['base_seconds'] * 1e3:.1f} ms, {a.mode} {res['other_seconds'] * 1e3:.1f} ms")
    for dp, _ in sessions.values():
        dp.close()


if __name__ == "__main__":
    main()
