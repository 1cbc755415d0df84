"""The fake CuPy's ``cupy.cuda``: devices, device and pinned memory, streams and events.

Work queued on a stream runs only when something waits for it (see the
package docstring); events are the only order between streams.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
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


class Stream:
    """An in-order queue of device work; it runs when waited for."""

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
        """Work queued on this stream from now on runs after ``event``'s work."""
        self._enqueue(event.synchronize)

    def use(self) -> Stream:
        _local.stream = self
        return self

    def __enter__(self) -> Stream:  # noqa: PYI034 - Self needs Python 3.11
        if not hasattr(_local, "streams"):
            _local.streams = []
        _local.streams.append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stream = _local.streams.pop()

    def __repr__(self) -> str:
        return f"<fake Stream {self.ptr:#x}>"


Stream.null = Stream(null=True)


class Event:
    """A point in one stream's queue."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._stream: Stream | None = None
        self._seq = 0

    def record(self, stream: Stream | None = None) -> None:
        self._stream = stream if stream is not None else get_current_stream()
        self._seq = self._stream._enqueue(lambda: None)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream._run(self._seq)

    @property
    def done(self) -> bool:
        return self._stream is None or not self._stream._ops or self._stream._ops[0][0] > self._seq


def get_current_stream(device_id: int = -1) -> Stream:
    return getattr(_local, "stream", None) or Stream.null


def _enqueue(fn: Callable[[], Any]) -> None:
    """Queue a kernel on the current stream."""
    get_current_stream()._enqueue(fn)


class memory:
    Memory = Memory
    UnownedMemory = UnownedMemory
    MemoryPointer = MemoryPointer


class pinned_memory:
    PinnedMemoryPointer = PinnedMemoryPointer
    alloc_pinned_memory = staticmethod(alloc_pinned_memory)
