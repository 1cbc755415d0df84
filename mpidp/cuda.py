"""GPU transfer: device selection, CUDA-awareness detection, pinned staging and the staged pipeline.

Passing a device pointer to an MPI library that is not CUDA-aware crashes
the job, so mpidp decides at run time, per rank, whether device buffers may
reach MPI, and otherwise stages every chunk through reusable pinned host
buffers. ``MPIDP_CUDA_AWARE=0|1`` always wins over detection.

With :mod:`mpidp.comm`, the only module that imports mpi4py: the host
collectives are comm's; what reaches them from device memory, and when
(streams, events, pinned copies), is decided here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .casts import Divisor, divisor
from .comm import Communicator
from .packing import Call, direct, write_back
from .records import Frame, agree

#: the public names; :class:`Device`, :class:`Staging` and :func:`wait_for_torch` are the sessions' (internal)
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

    Collective on ``comm`` when ``device`` is None: the ranks then agree, and a
    rank that cannot select a GPU (no CuPy and no CUDA build of PyTorch, no
    GPU, a CUDA error) is one ContractError on every rank, naming it, instead
    of an exception on that rank alone while the others go on to wait in
    ``initialize``. With ``device`` given it is local and raises RuntimeError.
    Call it before creating the model's arrays; ``DataParallel.initialize``
    then expects every array on this device. Returns the device index.
    """
    if device is not None:
        return _select(device)
    comm = comm if comm is not None else MPI.COMM_WORLD
    rank = local_rank(comm)
    index, error = -1, None
    try:
        index = _select(None, rank)
    except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank alike
        error = str(e) if isinstance(e, RuntimeError) and str(e).startswith("select_device") else f"{type(e).__name__}: {e}"
    private = Communicator(comm)  # a duplicate: the agreement's traffic never matches the caller's
    try:
        agree(private, Frame(0).new(0), error, "select_device")  # kind 0: the duplicate carries this one exchange
    finally:
        private.close()
    return index


def _select(device: int | None, rank: int = 0) -> int:
    """Make ``device`` (None: ``rank`` modulo the GPU count) current for CuPy and PyTorch (local)."""
    count, used, index = 0, False, -1
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


class Device:
    """A session's device: its chunk buffers, and how device buffers reach MPI on this rank.

    CUDA-aware: directly, once the queued work that writes them is done.
    Otherwise every byte goes through pinned host memory (:class:`Staging`),
    so a device pointer never reaches MPI. Allocated before the ranks agree
    (local): a rank that cannot is an error every rank raises.
    """

    def __init__(self, name: str, cuda_aware: bool, chunk_bytes: int) -> None:
        import cupy

        self.name = name
        self.index = int(name.split(":")[1])
        self.cuda_aware = cuda_aware
        with cupy.cuda.Device(self.index):
            #: one chunk of float32 on the device: the casts and scaling run there
            self.stage = cupy.empty(chunk_bytes // 4, dtype=cupy.float32)
            #: the host-staged pipeline's buffers and copy stream (MPI not CUDA-aware), else None
            self.staging = None if cuda_aware else Staging.create(self.stage)

    def current(self) -> Any:
        """A context in which this device is current (CuPy's; allocations, kernels and copies run there)."""
        import cupy

        return cupy.cuda.Device(self.index)

    def bcast(self, comm: Communicator, buf: Any, root: int, operation: str) -> None:
        """Broadcast device array ``buf`` (at most one chunk) from ``root`` in place (collective).

        Torch's and CuPy's current streams are waited for first, so MPI never
        reads memory a kernel is still writing; the copy back from the
        pinned stage is waited for before the stage is reused.
        """
        import cupy

        wait_for_torch()
        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        if self.staging is None:
            comm.Bcast(buf, root, operation)
            return
        host = self.staging.pinned[0].view(np.uint8)[: buf.nbytes].view(buf.dtype)
        buf.get(out=host)
        comm.Bcast(host, root, operation)
        buf.set(host)
        stream.synchronize()

    def reduce_calls(self, comm: Communicator, calls: Sequence[Call], slots: Sequence[Any], scale: float, operation: str) -> None:
        """:func:`mpidp.packing.reduce_calls` for device arrays: cast and scale on the device (collective).

        The caller has made this device current and waited for torch's
        stream. CUDA-aware: one loop, each call handed to MPI once CuPy's
        stream is done. Otherwise the two-deep host-staged pipeline.
        """
        import cupy

        by = divisor(scale)
        if self.staging is not None:
            _reduce_staged(calls, slots, self.staging, lambda b: comm.Allreduce(b, operation), by, cupy)
            return
        stream = cupy.cuda.get_current_stream()

        def allreduce(b: Any) -> None:
            stream.synchronize()  # MPI reads the buffer: the kernels that wrote it are done
            comm.Allreduce(b, operation)

        _reduce_device(calls, slots, self.stage, allreduce, by, cupy)


def wait_for_torch() -> None:
    """Wait for PyTorch's current CUDA stream, if this process uses torch on a GPU (local).

    Gradients computed by torch are written on torch's stream; device work
    and MPI that read them must not start before it is done.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _gather(buf: Any, call: Call, slots: Sequence[Any]) -> None:
    """Copy (and upcast) a packed call's segments from their slots into ``buf`` (device arrays)."""
    for seg in call.segments:
        buf[seg.dst : seg.dst + seg.length] = slots[seg.slot].flat[seg.src : seg.src + seg.length]


def _scatter(buf: Any, call: Call, slots: Sequence[Any]) -> None:
    """Copy (and cast back) a packed call's segments from ``buf`` into their slots (device arrays)."""
    for seg in call.segments:
        slots[seg.slot].flat[seg.src : seg.src + seg.length] = buf[seg.dst : seg.dst + seg.length]


class Staging(NamedTuple):
    """What the device loop needs when MPI is not CUDA-aware: device memory never reaches MPI.

    Two chunk-sized float32 stages on the device and two in pinned host
    memory, used in turn, the stream the copies between them run on, and
    the events that order the streams (reused: a wait takes the event as it
    was last recorded when the wait is queued). The only order between the
    two streams is events:

    * a copy down waits for everything queued on the current stream before
      (the gradients, the zeroing of weight-0 ranks, the packing);
    * MPI waits (on the host) for its buffer's copy down;
    * the division and cast back wait for the copy up;
    * buffer ``i % 2`` is reused by call ``i + 2`` only after call ``i``'s
      copy up (same copy stream) and cast back (same current stream).
    """

    stages: tuple[Any, Any]  # CuPy float32 arrays of one chunk each
    pinned: tuple[np.ndarray, np.ndarray]  # float32 host arrays of one chunk each, in pinned memory
    stream: Any  # a CuPy stream of the arrays' device (non-blocking: only events order it)
    #: (copied down into pinned 0, copied down into pinned 1, packed, copied up): blocking (the
    #: host sleeps instead of spinning while it waits) and without timing
    events: tuple[Any, Any, Any, Any]

    @classmethod
    def create(cls, stage: Any) -> Staging:
        """Staging around the session's device stage, on the current device (pinned memory: two chunks)."""
        import cupy

        def event() -> Any:
            return cupy.cuda.Event(block=True, disable_timing=True)

        memory = cupy.cuda.alloc_pinned_memory(2 * stage.nbytes)
        both = np.frombuffer(memory, dtype=np.float32, count=2 * stage.size)
        second = cupy.empty(stage.size, dtype=cupy.float32)
        pinned = (both[: stage.size], both[stage.size :])
        return cls((stage, second), pinned, cupy.cuda.Stream(non_blocking=True), (event(), event(), event(), event()))


def _reduce_device(
    calls: Sequence[Call],
    slots: Sequence[Any],
    stage: Any,
    allreduce: Callable[[Any], None],
    by: Divisor,
    xp: Any,
) -> None:
    """:func:`reduce_calls` for device (CuPy) arrays: cast and scale on the device."""
    for call in calls:
        region = direct(call, slots, 4)
        if region is not None:
            allreduce(region)
            by(region, region, xp)
            continue
        buf = stage[: call.length]
        _gather(buf, call, slots)
        allreduce(buf)
        by(buf, buf, xp)
        _scatter(buf, call, slots)
    write_back(slots)
    xp.cuda.get_current_stream().synchronize()  # the results are ready for any stream (torch's too) and the host


def _reduce_staged(
    calls: Sequence[Call],
    slots: Sequence[Any],
    staging: Staging,
    allreduce: Callable[[np.ndarray], None],
    by: Divisor,
    xp: Any,
) -> None:
    """:func:`reduce_calls` for device arrays and an MPI that is not CUDA-aware: a two-deep pipeline.

    Call ``i`` is packed (upcast) into device stage ``i % 2``, or is a direct
    region of the gradients, and copied down into pinned buffer ``i % 2`` on
    the copy stream (:func:`_copy_down`). While the host sums call ``i`` in
    MPI, call ``i + 1``'s copy down runs, and call ``i - 1``'s copy up,
    division and cast back run behind it, ordered by events only
    (:class:`Staging`). The current stream is synchronised at the end, so
    the results are ready for any stream and for the host when this
    returns, as with the CUDA-aware loop; so is the copy stream when a call
    fails, so that no copy is left running into buffers that are given
    back. The caller makes the arrays' device current and waits for torch's stream first.
    """
    current = xp.cuda.get_current_stream()
    copies, up = staging.stream, staging.events[3]
    regions: list[Any] = [None] * len(calls)  # per call: (what it sums: a direct region of the slots or a stage, staged)
    try:
        if calls:
            regions[0] = _copy_down(0, calls, slots, staging, current)
        for i, call in enumerate(calls):
            if i + 1 < len(calls):  # buffers (i + 1) % 2: call i - 1's copy up and cast back are queued before
                regions[i + 1] = _copy_down(i + 1, calls, slots, staging, current)
            host = staging.pinned[i % 2][: call.length]
            staging.events[i % 2].synchronize()
            allreduce(host)
            region, staged = regions[i]
            region.set(host, stream=copies)
            copies.record(up)
            current.wait_event(up)
            by(region, region, xp)
            if staged:
                _scatter(region, call, slots)
        write_back(slots)
        current.synchronize()
    except BaseException:
        copies.synchronize()
        raise


def _copy_down(i: int, calls: Sequence[Call], slots: Sequence[Any], staging: Staging, current: Any) -> tuple[Any, bool]:
    """Pack call ``i`` into device stage ``i % 2`` (or take its direct region), queue its copy into pinned buffer ``i % 2``.

    Returns what the call sums on the device, and whether it was packed
    (its values are then cast back into the slots).
    """
    call = calls[i]
    region: Any = direct(call, slots, 4)
    staged = region is None
    if staged:
        region = staging.stages[i % 2][: call.length]
        _gather(region, call, slots)
    copies, packed = staging.stream, staging.events[2]
    current.record(packed)
    copies.wait_event(packed)
    region.get(stream=copies, out=staging.pinned[i % 2][: call.length], blocking=False)
    copies.record(staging.events[i % 2])
    return region, staged
