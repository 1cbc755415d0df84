"""What initialize checks on this rank before the ranks agree (local; nothing is communicated or modified).

Every check that can fail runs here, and so does every allocation a rank
might fail at (the chunk buffers), so that a failure is this rank's error
in the initialize record, raised alike on every rank, never a raise on one.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import contract, cuda, layout, packing
from .casts import DEFAULT, MODES, Casts
from .exact.sums import MODES as EXACT_MODES
from .records import Setup

if TYPE_CHECKING:
    from .comm import Communicator

__all__ = ["NO_REGIONS", "ByteRegions", "Found", "cast_strategy", "chunk_buffers", "exact_kernels", "on_host", "setup"]


class ByteRegions(NamedTuple):
    """Named byte regions an adapter moves from root with the parameters (torch's buffers), read before agreeing."""

    entries: contract.Regions  # what every rank must hold alike
    views: tuple[np.ndarray, ...]  # host uint8 views, one per distinct region, in entry order
    written: Callable[[], None]  # called on every rank but root once the bytes have landed in the views
    error: str | None  # why this rank cannot take part, or None


NO_REGIONS = ByteRegions((), (), lambda: None, None)


class Found(NamedTuple):
    """What initialize found on this rank before agreeing."""

    setup: Setup
    error: str | None
    found: contract.Local
    aware: tuple[bool, str]
    stage: Any
    gpu: cuda.Device | None
    scatter: packing.Scatter | None = None  # host reduce-scatter buffers, where the agreed mode may use them
    casts: Casts = DEFAULT  # this rank's 16-bit casts (``MPIDP_CASTS``; local: every way gives the same bits)
    exact_mode: str = "auto"  # this rank's exact passes (``MPIDP_EXACT_KERNELS``; local: every way gives the same bits)


def setup(
    c: Communicator, params: Any, root: Any, frozen: Any, options: dict[str, Any], regions: ByteRegions, setup_error: str | None
) -> Found:
    """Everything initialize checks on this rank before agreeing (local): its record and first error."""
    try:
        found = contract.build(params, frozen, options["device"])
    except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
        found = contract.Local((), (), (), f"could not read the parameters: {type(e).__name__}: {e}")
    error = regions.error or found.error or setup_error
    aware = (False, "host arrays")
    if found.device != "cpu":
        try:
            import cupy  # noqa: F401 - device staging, casts and scaling run in CuPy

            aware = cuda.detect(c.comm)
        except ImportError:
            error = error or "GPU arrays need CuPy (pip install mpidp[cupy])"
        except ValueError as e:
            error = error or str(e)
    root, chunk, why_numbers = _root_and_chunk(root, options["chunk_bytes"], c.size)
    error = error or why_numbers
    reduction, why = reduction_mode()
    casts, why_casts = cast_strategy()
    exact_mode, why_exact = exact_kernels()
    name, why_name = _name(options.get("name"))
    error = error or why or why_casts or why_exact or why_name
    exact = options.get("exact", False)
    if not isinstance(exact, bool):
        error = error or f"exact must be True or False, got {exact!r}"
    elif exact and found.device != "cpu":
        error = error or f"exact=True reduces host (CPU) arrays only; this rank's device is {found.device}"
    stage: Any = None
    gpu: cuda.Device | None = None
    scatter: packing.Scatter | None = None
    if error is None:  # before the ranks agree: a rank that cannot allocate them is an error on every rank
        try:
            stage, gpu = chunk_buffers(found.device, chunk, aware[0])
            if gpu is None and (reduction == "reduce_scatter" or (reduction == "auto" and c.size > 1)):
                scatter = packing.Scatter.allocate(c.rank, c.size, reduction, chunk // 4)
        except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
            error = f"could not allocate the chunk buffers (chunk_bytes={options['chunk_bytes']}, {found.device}): {type(e).__name__}: {e}"
    heads = [a for i, (e, a) in enumerate(zip(found.contract, found.arrays)) if e.alias == i]
    runs = layout.runs(heads, found.device) if error is None else None
    setup = Setup(found.contract, int(root), chunk, on_host(found), runs, regions.entries, reduction, exact is True, name)
    return Found(setup, error, found, aware, stage, gpu, scatter, casts, exact_mode)


def _root_and_chunk(root: Any, chunk_bytes: Any, size: int) -> tuple[Any, int, str | None]:
    """The root (-1 where invalid), the chunk in bytes (0 where invalid) and the first error of the two (local)."""
    error = None
    if isinstance(root, bool) or not isinstance(root, numbers.Integral) or not 0 <= int(root) < size:
        error = f"root {root!r} is outside the world of {size} ranks"
        root = -1
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or int(chunk_bytes) < 4096:
        error = error or f"chunk_bytes must be an integer of at least 4096, got {chunk_bytes!r}"
        chunk_bytes = 0
    return root, int(chunk_bytes) // 4 * 4, error


def _name(name: Any) -> tuple[str | None, str | None]:
    """The session's name (``initialize(..., name=)``), and why it is invalid, or None (local)."""
    if name is None or isinstance(name, str):
        return name, None
    return None, f"name must be a str or None, got {type(name).__name__} {name!r}"


def reduction_mode() -> tuple[str, str | None]:
    """This rank's ``MPIDP_REDUCTION`` (default ``auto``), and why it is invalid, or None (local).

    The value is part of the initialize record: ranks that read different
    values get the same ContractError, never different collectives.
    """
    raw = os.environ.get("MPIDP_REDUCTION", "auto")
    mode = raw.strip().lower() or "auto"
    if mode in packing.REDUCTIONS:
        return mode, None
    return "auto", f"MPIDP_REDUCTION must be one of {', '.join(packing.REDUCTIONS)}, got {raw!r}"


def cast_strategy() -> tuple[Casts, str | None]:
    """This rank's 16-bit casts from ``MPIDP_CASTS`` (default ``auto``), and why the value is invalid, or None (local).

    Not agreed: every way gives the same bits (NaN payloads aside). The
    module switches of earlier releases (``mpidp.packing.TORCH_CASTS`` and
    ``NUMBA_CASTS``) are no longer read: a process that still sets them is told so.
    """
    if any(getattr(packing, name, None) is not None for name in ("TORCH_CASTS", "NUMBA_CASTS")):
        warnings.warn("mpidp.packing.TORCH_CASTS and NUMBA_CASTS are no longer read: set MPIDP_CASTS=numba or numpy", stacklevel=4)
    raw = os.environ.get("MPIDP_CASTS", "auto")
    mode = raw.strip().lower() or "auto"
    if mode in MODES:
        return Casts(mode), None
    return DEFAULT, f"MPIDP_CASTS must be one of {', '.join(MODES)}, got {raw!r}"


def exact_kernels() -> tuple[str, str | None]:
    """This rank's exact passes from ``MPIDP_EXACT_KERNELS`` (default ``auto``), and why the value is invalid, or None (local).

    Not agreed: every route gives the same bits (:mod:`mpidp.exact`).
    """
    raw = os.environ.get("MPIDP_EXACT_KERNELS", "auto")
    mode = raw.strip().lower() or "auto"
    if mode in EXACT_MODES:
        return mode, None
    return "auto", f"MPIDP_EXACT_KERNELS must be one of {', '.join(EXACT_MODES)}, got {raw!r}"


def chunk_buffers(device: str, chunk_bytes: int, cuda_aware: bool) -> tuple[Any, cuda.Device | None]:
    """Allocate a session's chunk-sized buffers (local): the float32 stage, and for device arrays the device's.

    Host arrays get a host stage. Device arrays get a device stage (the casts and scaling run on the
    device) and, where MPI is not CUDA-aware, the pinned staging of :class:`mpidp.cuda.Device`.
    """
    if device == "cpu":
        return np.empty(chunk_bytes // 4, dtype=np.float32), None
    gpu = cuda.Device(device, cuda_aware, chunk_bytes)
    return gpu.stage, gpu


def on_host(local: contract.Local) -> bool:
    """Whether this rank's arrays are host memory (a fact of the initialize record: plans depend on every rank's)."""
    return local.device == "cpu"
