"""A small training loop that misbehaves on purpose; run by tests/test_faults.py.

``python train.py MODE [WINDOWS]`` under ``mpiexec -n 4`` (plain python, not
``-m mpi4py``: the point is what mpidp itself does). MODE:

- ``ok``: train and exit 0.
- ``raise``: rank 2 raises an uncaught exception outside any mpidp call.
- ``kill``: rank 1 kills itself with SIGKILL in the middle of training.
- ``skip``: rank 3 skips one reduce and waits in the user's own barrier; the
  others wait in mpidp's exchange until the watchdog (MPIDP_TIMEOUT) aborts.
- ``skip-buffers``: the same with the PyTorch adapter: rank 3 skips
  ``broadcast_buffers``, whose collectives the adapter's own watchdog watches.
- ``skip-overlap``: the PyTorch adapter with ``overlap="hooks"``: ranks 0-2 run a
  backward and close; rank 3 runs none and waits in the user's own barrier; the
  others wait in the exchange that opens the window before its first bucket
  until the watchdog aborts.
- ``skip-overlap-thread``: ``overlap="thread"``: rank 3 runs a backward through
  the last layer only (the window opens, its first buckets are summed), then
  waits in the user's own barrier; ranks 0-2's communication threads wait in
  the first layer's bucket until the buckets' own watchdog aborts.
- ``thread-mpi-error``: ``overlap="thread"``; MPI fails inside rank 3's
  communication thread (a CollectiveError, injected): the collectives cannot
  finish, so rank 3 prints the traceback and aborts the job.
- ``extra``: rank 3 runs one reduce more than the others, which close the
  session: one ContractError on every rank at once (close agrees too).
- ``one``: rank 0 alone reduces once more (``if rank == 0: dp.reduce(...)``),
  then every rank closes: the same.
- ``exit``: rank 3 runs one reduce more than the others, whose scripts end
  without closing: the close at interpreter exit agrees with rank 3's reduce.
- ``exit-clean``: no rank closes; the session is closed at exit, before MPI
  is finalized, and the job exits 0.
- ``finalize-first``: no rank closes, every rank finalizes MPI itself: nothing
  is left to close at exit, and the job exits 0.
- ``sessions``: two sessions (``generator``, ``critic``) trained alternately,
  then rank 0 reduces the generator first and the others the critic (issue
  44): one ContractError on every rank at once, naming both sessions.
- ``sessions-exit``: rank 0's script ends one generator reduce early; the
  others wait in it while rank 0 closes the critic at exit: the same.
- ``late``: rank 3 comes to ``initialize`` 30 s after the others, which wait
  in its first collective (the communicator's Dup) until the watchdog aborts.
- ``raise-early``: rank 3 raises before ``initialize`` (no abort hook yet:
  plain python), the others wait in the Dup until the watchdog aborts.
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidp

mode = sys.argv[1]
windows = int(sys.argv[2]) if len(sys.argv) > 2 else 20
comm = MPI.COMM_WORLD
rank = comm.rank
if mode in ("late", "raise-early") and rank == 3:
    print(f"rank {rank}: {mode} at {time.time():.3f}", flush=True)
    if mode == "raise-early":
        raise RuntimeError("boom before initialize")
    time.sleep(30)
if mode in ("sessions", "sessions-exit"):
    g = mpidp.DataParallel.initialize({"w": np.zeros(10, np.float32)}, comm, name="generator")
    c = mpidp.DataParallel.initialize({"w": np.zeros(100, np.float32), "b": np.zeros(3, np.float32)}, comm, name="critic")
    for step in range(3):
        c.reduce({"w": np.ones(100, np.float32), "b": np.ones(3, np.float32)}, 1)
        g.reduce({"w": np.ones(10, np.float32)}, 1)
    print(f"rank {rank}: {mode} at {time.time():.3f}", flush=True)
    if mode == "sessions-exit":
        if rank != 0:
            g.reduce({"w": np.ones(10, np.float32)}, 1)
        sys.exit(0)
    for d in [g, c] if rank == 0 else [c, g]:
        d.reduce({"w": np.ones(10, np.float32)} if d is g else {"w": np.ones(100, np.float32), "b": np.ones(3, np.float32)}, 1)
    sys.exit(0)
if mode == "skip-buffers":
    import torch

    import mpidp.torch

    tdp = mpidp.torch.DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), comm)
    if rank == 3:
        print(f"rank {rank}: skipping broadcast_buffers at {time.time():.3f}", flush=True)
        comm.Barrier()
    tdp.broadcast_buffers()
    sys.exit(0)
if mode in ("skip-overlap", "skip-overlap-thread", "thread-mpi-error"):
    import torch

    import mpidp.torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    tdp = mpidp.torch.DataParallel(model, comm, overlap="hooks" if mode == "skip-overlap" else "thread", bucket_bytes=4096)
    if mode == "thread-mpi-error" and rank == 3:

        def failing(*args: object) -> None:
            raise mpidp.CollectiveError("MPI_Allreduce failed on rank 3: injected")

        tdp._overlap.owner._engine.comm.Allreduce_into = failing  # type: ignore[union-attr]
        print(f"rank {rank}: failing in MPI at {time.time():.3f}", flush=True)
    if rank == 3 and mode != "thread-mpi-error":
        if mode == "skip-overlap-thread":
            model[1](torch.ones(2, 64)).sum().backward()
        print(f"rank {rank}: skipping the backward and close at {time.time():.3f}", flush=True)
        comm.Barrier()
    model(torch.ones(2, 64)).sum().backward()
    if mode == "thread-mpi-error":
        tdp.reduce(local_weight=2)
    tdp.close()
    sys.exit(0)
if mode in ("exit-clean", "finalize-first"):
    import atexit

    def report() -> None:  # registered before mpidp's hook: runs after it
        print(f"rank {rank}: at exit closed={dp._closed} freed={dp._comm.comm == MPI.COMM_NULL}", flush=True)

    atexit.register(report)
params = {"w": np.zeros(1000, np.float32), "b": np.zeros(10, np.float32)}
dp = mpidp.DataParallel.initialize(params, comm)
grads = dp.gradient_buffers()
for window in range(windows):
    if window == 5:
        if mode == "raise" and rank == 2:
            print(f"rank {rank}: raising at {time.time():.3f}", flush=True)
            raise RuntimeError("boom outside mpidp")
        if mode == "kill" and rank == 1:
            print(f"rank {rank}: killing myself at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "skip" and rank == 3:
            print(f"rank {rank}: skipping a reduce at {time.time():.3f}", flush=True)
            comm.Barrier()  # the user's own collective: mpidp's watchdog is not armed here
    for g in grads.values():
        g[...] = rank + 1
    out = dp.reduce(grads, 1)
    params["w"] -= 0.1 * out.gradients["w"]
dp.verify_replicas()
if (mode in ("extra", "exit") and rank == 3) or (mode == "one" and rank == 0):
    print(f"rank {rank}: one reduce too many at {time.time():.3f}", flush=True)
    dp.reduce(grads, 1)
if mode in ("exit", "exit-clean", "finalize-first"):
    if mode == "finalize-first":
        MPI.Finalize()
    print(f"rank {rank}: done, not closed", flush=True)
    sys.exit(0)
dp.close()
print(f"rank {rank}: done", flush=True)
