"""GPU support: node-local device selection and CUDA-awareness detection.

Passing a device pointer to an MPI library that is not CUDA-aware crashes
the job, so mpidp decides at run time, per rank, whether device buffers may
reach MPI, and otherwise stages every chunk through reusable pinned host
buffers. ``MPIDP_CUDA_AWARE=0|1`` always wins over detection.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

from mpi4py import MPI

__all__ = ["decide", "detect", "local_rank", "select_device"]


def decide(override: str | None, alloc_kinds: str | None, query: int | None) -> tuple[bool, str]:
    """Decide CUDA-awareness from what the environment and the MPI library report (pure, local).

    ``override`` is ``MPIDP_CUDA_AWARE`` (None when unset), ``alloc_kinds`` the
    MPI-4.1 info value ``mpi_memory_alloc_kinds`` (None when the library does
    not report it), ``query`` what ``MPIX_Query_cuda_support()`` returned
    (None when the library does not export it). Returns the decision and the
    reason, for logs and ``DataParallel.cuda_aware``.
    """
    if override is not None and override.strip() != "":
        value = override.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True, "MPIDP_CUDA_AWARE=1"
        if value in ("0", "false", "no", "off"):
            return False, "MPIDP_CUDA_AWARE=0"
        raise ValueError(f"MPIDP_CUDA_AWARE must be 0 or 1, got {override!r}")
    if alloc_kinds is not None:
        kinds = [k.strip() for k in alloc_kinds.split(",")]
        # "cuda" (every CUDA allocation) or "cuda:device" (cudaMalloc); "cuda:host" and
        # "cuda:managed" alone say nothing about device pointers
        if any(k in ("cuda", "cuda:device") for k in kinds):
            return True, f"mpi_memory_alloc_kinds={alloc_kinds}"
    if query is not None and query > 0:
        return True, "MPIX_Query_cuda_support() = 1"
    if query is not None:
        return False, "MPIX_Query_cuda_support() = 0"
    if alloc_kinds is not None:
        return False, f"mpi_memory_alloc_kinds={alloc_kinds}"
    return False, "the MPI library reports no CUDA support"


def _alloc_kinds(comm: MPI.Comm) -> str | None:
    for info in (comm.Get_info(), MPI.INFO_ENV):
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        except MPI.Exception:
            value = None
        finally:
            if info != MPI.INFO_ENV:
                info.Free()
        if value is not None:
            return str(value)
    return None


def _query() -> int | None:
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return int(fn())


def detect(comm: MPI.Comm | None = None, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Decide whether this rank's MPI accepts device buffers (local; no communication)."""
    env = os.environ if env is None else env
    override = env.get("MPIDP_CUDA_AWARE")
    if override is not None and override.strip():
        return decide(override, None, None)
    return decide(None, _alloc_kinds(comm if comm is not None else MPI.COMM_WORLD), _query())


def local_rank(comm: MPI.Comm | None = None) -> int:
    """Return this rank's index among the ranks on its node (collective on ``comm``)."""
    node = (comm if comm is not None else MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


def select_device(comm: MPI.Comm | None = None, device: int | None = None) -> int:
    """Make GPU ``device`` (default: node-local rank modulo the GPU count) current for CuPy and PyTorch.

    Collective on ``comm`` when ``device`` is None. Call it before creating
    the model's arrays; ``DataParallel.initialize`` then expects every array
    on this device. Returns the device index.
    """
    if device is None:
        rank = local_rank(comm)
    count, used = 0, False
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        index = device if device is not None else rank % max(1, count)
        cupy.cuda.Device(index).use()
        used = True
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            count = count or torch.cuda.device_count()
            index = device if device is not None else rank % max(1, count)
            torch.cuda.set_device(index)
            used = True
    except ImportError:
        pass
    if not used:
        raise RuntimeError("select_device needs CuPy or a CUDA build of PyTorch, and a GPU")
    return index
