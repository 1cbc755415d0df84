"""Run one example many times in one MPI job, each run on the world's first n ranks, and record what each run did.

    mpiexec -n N python -m mpi4py tests/examples/sweep.py MODULE PLAN.json OUT.json

``PLAN.json`` is a list of ``[n, argv]``. Run ``i`` calls ``MODULE.main(argv, comm)`` on a communicator of the
world's first ``n`` ranks, or ``MODULE.main(argv)`` where ``n == N`` (the world, as ``python -m MODULE`` does).
Rank 0 writes ``OUT.json``: per run, ``{"returned": [every rank's return value], "printed": [every rank's
standard output]}``. One job instead of one per run: its processes import torch once (on a 2-core machine
the start of a job costs more than a short run), and the tests that read the runs share them. The ranks
outside a run wait without spinning (an Ibarrier tested every 2 ms), so the ranks that run get the cores.
A run that raises aborts the job (``python -m mpi4py``); the test that starts the job sets its time limit.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import time
from typing import Any

from mpi4py import MPI


def settle(world: MPI.Comm) -> None:
    """A barrier that sleeps while it waits: ranks idle in a run do not compete with the ranks in it."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def run(module: Any, world: MPI.Comm, n: int, argv: list[str]) -> tuple[Any, str] | None:
    """Run ``module.main(argv)`` on the first ``n`` ranks (collective on ``world``); None on the others."""
    sub = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        return None
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            returned = module.main(argv) if n == world.size else module.main(argv, sub)
    finally:
        sub.Free()
    return returned, printed.getvalue()


def main() -> None:
    name, plan_path, out_path = sys.argv[1:]
    module = importlib.import_module(name)
    world = MPI.COMM_WORLD
    with open(plan_path) as f:
        plan = json.load(f)
    results = []
    for n, argv in plan:
        assert 1 <= n <= world.size, (n, world.size)
        mine = run(module, world, n, argv)
        settle(world)
        every = world.gather(mine)
        if world.rank == 0:
            done = [r for r in every if r is not None]
            results.append({"ranks": n, "argv": argv, "returned": [r[0] for r in done], "printed": [r[1] for r in done]})
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
