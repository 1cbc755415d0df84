"""The fake CuPy's ``cupy.cuda``: devices, device and pinned memory, streams and events.

Work queued on a stream runs only when something waits for it (see the
package docstring); events are the only order between streams.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import random
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

_local = threading.local()
_seq = itertools.count(1)
_pinned: list[tuple[weakref.ref[Any], int, int]] = []
_streams: weakref.WeakSet[Stream] = weakref.WeakSet()


def _count() -> int:
    return int(os.environ.get("MPIDP_FAKE_GPUS", "2"))


def _current_id() -> int:
    return getattr(_local, "device", 0)


class Device:
    """A device index; ``with Device(i):`` and ``use()`` make it current for this thread."""

    def __init__(self, device: Any = None) -> None:
        self.id = _current_id() if device is None else int(device)
        if not 0 <= self.id < _count():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal ({self.id})")
        self._previous: list[int] = []

    def use(self) -> None:
        _local.device = self.id

    def __enter__(self) -> Device:  # noqa: PYI034 - Self needs Python 3.11
        self._previous.append(_current_id())
        self.use()
        return self

    def __exit__(self, *exc: object) -> None:
        _local.device = self._previous.pop()

    def synchronize(self) -> None:
        for s in list(_streams):
            s.synchronize()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class runtime:
    @staticmethod
    def getDeviceCount() -> int:
        return _count()

    @staticmethod
    def getDevice() -> int:
        return _current_id()

    @staticmethod
    def setDevice(device: int) -> None:
        Device(device).use()

    @staticmethod
    def deviceSynchronize() -> None:
        Device().synchronize()


class Memory:
    """A device allocation (host memory underneath, 256-byte aligned) on the current device."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.device_id = _current_id()
        self._buffer = np.empty(self.size + 256, dtype=np.uint8)
        base = self._buffer.ctypes.data
        self.ptr = base + (-base % 256)

    device = property(lambda self: Device(self.device_id))


class UnownedMemory:
    """Device memory owned by ``owner`` (kept alive), as CuPy wraps foreign pointers."""

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        self.ptr, self.size, self._owner = int(ptr), int(size), owner
        self.device_id = _current_id() if device_id < 0 else int(device_id)

    device = property(lambda self: Device(self.device_id))


class MemoryPointer:
    """A pointer into a device allocation: ``mem`` is the allocation, shared by every view of it."""

    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + int(offset)
        self.device_id = mem.device_id

    device = property(lambda self: Device(self.device_id))

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)


class PinnedMemoryPointer(bytearray):
    """Page-locked host memory: exports the buffer protocol, like CuPy's, for ``numpy.frombuffer``."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    memory = PinnedMemoryPointer(int(size))
    lo = memory.ptr
    _pinned.append((weakref.ref(memory), lo, lo + int(size)))
    return memory


def _is_pinned(a: np.ndarray) -> bool:
    """Whether host array ``a`` lies in pinned memory (copies out of it run late, as DMA does)."""
    if not a.size:
        return False
    lo = a.__array_interface__["data"][0]
    hi = lo + a.nbytes
    _pinned[:] = [p for p in _pinned if p[0]() is not None]
    return any(start <= lo and hi <= end for _, start, end in _pinned)


_schedule = "lazy"
_random = random.Random(0)


def set_schedule(name: str) -> None:
    """Run queued work ``lazy`` (only when waited for) or ``random:SEED`` (sometimes early too), from a fresh seed.

    Set from ``MPIDP_FAKE_SCHEDULE`` at import; tests/conftest.py sets it per test when one job runs every schedule.
    """
    global _schedule, _random
    if name != "lazy" and not (name.startswith("random:") and name[7:].isdigit()):
        raise ValueError(f"a fake-GPU schedule is lazy or random:SEED, got {name!r}")
    _schedule = name
    _random = random.Random(int(name[7:]) if name.startswith("random:") else 0)


set_schedule(os.environ.get("MPIDP_FAKE_SCHEDULE", "lazy"))


def _progress() -> None:
    """Under the random schedule, maybe run the first queued operation of a random stream."""
    if not _schedule.startswith("random") or _random.random() < 0.5:
        return
    busy = [s for s in list(_streams) if s._ops and not s._running]
    if busy:
        stream = _random.choice(busy)
        stream._run(stream._ops[0][0])


class Stream:
    """An in-order queue of device work of one device; it runs when waited for."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self._ops: collections.deque[tuple[int, Callable[[], Any]]] = collections.deque()
        self._running = False
        self.ptr = 0 if null else id(self)
        self.device_id = _current_id()
        _streams.add(self)

    def _enqueue(self, fn: Callable[[], Any]) -> int:
        seq = next(_seq)
        self._ops.append((seq, fn))
        _progress()
        return seq

    def _run(self, upto: int | None = None) -> None:
        if self._running:  # a stream this one waits on waits on this one, up to a point
            if self._ops and (upto is None or self._ops[0][0] <= upto):
                raise RuntimeError("the fake CuPy found a cycle of streams waiting on each other")
            return  # everything up to that point has run
        self._running = True
        try:
            while self._ops and (upto is None or self._ops[0][0] <= upto):
                _, fn = self._ops.popleft()
                fn()
        finally:
            self._running = False

    def synchronize(self) -> None:
        self._run()

    @property
    def done(self) -> bool:
        return not self._ops

    def record(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on runs after ``event``'s work as recorded now (a later record does not count)."""
        stream, seq = event._stream, event._seq
        if stream is not None:
            self._enqueue(lambda: stream._run(seq))

    def use(self) -> Stream:
        if not hasattr(_local, "current"):
            _local.current = {}
        _local.current[self.device_id] = self
        return self

    def __enter__(self) -> Stream:  # noqa: PYI034 - Self needs Python 3.11
        if self.device_id != _current_id():
            raise RuntimeError(f"This stream belongs to device {self.device_id}, but the current device is {_current_id()}")
        if not hasattr(_local, "streams"):
            _local.streams = []
        _local.streams.append(get_current_stream())
        self.use()
        return self

    def __exit__(self, *exc: object) -> None:
        _local.streams.pop().use()

    def __repr__(self) -> str:
        return f"<fake Stream {self.ptr:#x}>"


_nulls: dict[int, Stream] = {}


def _null(device: int) -> Stream:
    """Each device's legacy default stream."""
    if device not in _nulls:
        with Device(device):
            _nulls[device] = Stream(null=True)
    return _nulls[device]


Stream.null = _null(0)


class Event:
    """A point in one stream's queue, of the device current when it was made."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._stream: Stream | None = None
        self._seq = 0
        self.device_id = _current_id()

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()
        if stream.device_id != self.device_id:
            raise RuntimeError("cudaErrorInvalidResourceHandle: an event of device "
                               f"{self.device_id} recorded on a stream of device {stream.device_id}")
        self._stream = stream
        self._seq = stream._enqueue(lambda: None)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream._run(self._seq)

    @property
    def done(self) -> bool:
        return self._stream is None or not self._stream._ops or self._stream._ops[0][0] > self._seq


def get_current_stream(device_id: int = -1) -> Stream:
    device = _current_id() if device_id < 0 else device_id
    return getattr(_local, "current", {}).get(device) or _null(device)


def _kernel(fn: Callable[[], Any], *operands: Any) -> None:
    """Queue a kernel on the current stream; its device arrays must be on the current device."""
    device = _current_id()
    for a in operands:
        data = getattr(a, "data", None)
        if isinstance(data, MemoryPointer) and data.device_id != device:
            raise ValueError(
                f"The device where the array resides ({data.device_id}) is different from the current device ({device}). "
                "Peer access is unavailable between these devices."
            )
    get_current_stream()._enqueue(fn)


def _copy_stream(stream: Stream | None, a: Any) -> Stream:
    """The stream a copy of ``a`` runs on: CuPy's current one by default, which must be of ``a``'s device
    unless it is the legacy default stream (handle 0 means the copying device's own)."""
    stream = stream or get_current_stream()
    if stream.ptr == 0:
        return _null(a.data.device_id)
    if stream.device_id != a.data.device_id:
        raise RuntimeError(f"cudaErrorInvalidResourceHandle: a copy of device {a.data.device_id} on a stream of device {stream.device_id}")
    return stream


class memory:
    Memory = Memory
    UnownedMemory = UnownedMemory
    MemoryPointer = MemoryPointer


class pinned_memory:
    PinnedMemoryPointer = PinnedMemoryPointer
    alloc_pinned_memory = staticmethod(alloc_pinned_memory)
