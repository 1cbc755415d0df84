"""The sharded optimizer on device arrays (CuPy): state and update on the host (offload), the host run's bits.

Skipped without CuPy and a GPU; scripts/test runs it under ``mpiexec -n 4``
on the CPU stand-in for CuPy (tests/fakegpu), whose copies run only when
waited for (in one schedule) or at random moments (in two more), and on a
GPU where one is lent.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from conftest import same_error_everywhere
from mpi4py import MPI

import mpidp
import mpidp.optim as mo
from mpidp import cuda

cupy: Any = None
try:  # a GPU (or the stand-in) is needed for anything here
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        cupy = None
except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: skip
    cupy = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy is None, reason="needs CuPy and a GPU")]  # gpu: the fake-GPU passes

SHAPES = {"a": (1,), "b": (7,), "c": (33, 3), "d": (20003,), "h": (65,)}  # "h": float16, with float32 masters
GROUPS = [{"params": ["a", "c", "d"]}, {"params": ["b"], "weight_decay": 0.0, "lr": 3e-2}, {"params": ["h"]}]


def host_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(s).astype(np.float16 if k == "h" else np.float32) for k, s in SHAPES.items()}


def run(comm: MPI.Comm, device: bool, kind: str, join: bool) -> tuple[str, int, bytes]:
    """Three sharded steps with every rank's own gradients; the parameters' hash, the optimizer's bytes, its state's bytes."""
    host = host_params()
    p = {k: cupy.asarray(v) for k, v in host.items()} if device else host
    kw: dict[str, Any] = {"momentum": 0.9, "nesterov": True} if kind == "sgd" else {}
    with mpidp.DataParallel.initialize(p, comm, chunk_bytes=4096) as dp:  # gather rounds cut inside tensors
        assert dp.device == ("cpu" if not device else dp.device) and (dp.device != "cpu") == device
        opt = mo.sharded(dp, kind, GROUPS, lr=1e-2, weight_decay=0.1, **kw)
        for s in range(3):
            rng = np.random.default_rng([s, comm.rank])
            out = join and comm.size > 1 and comm.rank == comm.size - 1 and s > 0  # out of data: still owns and steps its slice
            g = {} if out else {k: (rng.standard_normal(v.shape) * 3).astype(v.dtype) for k, v in host.items()}
            if device:
                g = {k: cupy.asarray(v) for k, v in g.items()}
            opt.step(g, 0 if out else comm.rank + 1, max_norm=2.0)
        values = {k: cupy.asnumpy(v) if device else v for k, v in p.items()}
        state = b"".join(a.tobytes() for name in sorted(opt.state_pieces()) for _, a in sorted(opt.state_pieces()[name].items()))
        return hashlib.sha256(b"".join(values[k].tobytes() for k in sorted(values))).hexdigest(), opt.nbytes, state


@pytest.mark.parametrize(("kind", "join"), [("adamw", False), ("sgd", False), ("adamw", True)])
def test_device_arrays_get_the_host_run_s_bits_and_state(comm: MPI.Comm, kind: str, join: bool) -> None:
    cuda.select_device(comm)
    on_host = run(comm, False, kind, join)
    on_device = run(comm, True, kind, join)
    assert on_device == on_host
    assert len({h for h, _, _ in comm.allgather(on_device)}) == 1  # equal replicas


def test_exact_sessions_stay_on_host_arrays(comm: MPI.Comm) -> None:
    cuda.select_device(comm)
    p = {"w": cupy.zeros(3, dtype=cupy.float32)}
    same_error_everywhere(comm, lambda: mpidp.DataParallel.initialize(p, comm, exact=True), mpidp.ContractError, "exact=True reduces host")
