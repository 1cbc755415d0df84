"""The CPU stand-in for CuPy (tests/fakegpu) stays strict: what the GPU tests on it prove depends on it.

Loaded under another name, so that nothing else in this process sees a ``cupy``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_PACKAGE = Path(__file__).resolve().parent / "fakegpu" / "cupy"


@pytest.fixture(scope="module")
def fake() -> Any:
    spec = importlib.util.spec_from_file_location("mpidp_fake_cupy", _PACKAGE / "__init__.py", submodule_search_locations=[str(_PACKAGE)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.modules.pop(f"{spec.name}.cuda", None)


def _memory(a: Any) -> np.ndarray:
    """What MPI would read at a device array's pointer, now."""
    return np.frombuffer((ctypes.c_char * a.nbytes).from_address(a.data.ptr), dtype=a.dtype).copy()


def test_device_arrays_are_not_host_buffers(fake: Any) -> None:
    a = fake.zeros(4, dtype=np.float32)
    with pytest.raises(TypeError):
        memoryview(a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[...] = np.ones(4, dtype=np.float32)
    assert a.__cuda_array_interface__["data"][0] == a.data.ptr


def test_kernels_run_only_when_waited_for(fake: Any) -> None:
    a = fake.zeros(4, dtype=np.float32)
    fake.cuda.get_current_stream().synchronize()
    a += 1
    assert _memory(a).tolist() == [0, 0, 0, 0]  # MPI reading now sees the old bytes
    assert not fake.cuda.get_current_stream().done
    assert fake.asnumpy(a).tolist() == [1, 1, 1, 1]  # a blocking copy to the host waits for the stream
    assert _memory(a).tolist() == [1, 1, 1, 1]


def test_streams_are_ordered_by_events_only(fake: Any) -> None:
    current = fake.cuda.get_current_stream()
    copies = fake.cuda.Stream(non_blocking=True)
    a = fake.zeros(4, dtype=np.float32)
    pinned = np.frombuffer(fake.cuda.alloc_pinned_memory(16), dtype=np.float32, count=4)
    a += 2
    copies.wait_event(current.record())
    a.get(stream=copies, out=pinned, blocking=False)
    done = copies.record()
    assert pinned.tolist() == [0, 0, 0, 0]  # not copied yet: the host must wait for the event
    done.synchronize()
    assert pinned.tolist() == [2, 2, 2, 2]
    pinned[...] = 5
    a.set(pinned, stream=copies)  # a pinned source is read when the copy runs
    pinned[...] = 7
    current.wait_event(copies.record())
    assert fake.asnumpy(a).tolist() == [7, 7, 7, 7]
    host = np.full(4, 3, dtype=np.float32)
    a.set(host)  # a pageable source is read at once
    host[...] = 9
    assert fake.asnumpy(a).tolist() == [3, 3, 3, 3]


def test_views_share_one_allocation(fake: Any) -> None:
    a = fake.zeros(12, dtype=np.float32)
    v = a[4:8]
    assert v.data.mem is a.data.mem and v.data.ptr == a.data.ptr + 16
    assert a.reshape(3, 4).data.ptr == a.data.ptr
    assert not a.reshape(3, 4).T.flags.c_contiguous
    b = fake.ndarray((2,), np.float32, fake.cuda.MemoryPointer(fake.cuda.UnownedMemory(a.data.ptr + 8, 8, a, a.device.id), 0))
    b[...] = 4
    assert fake.asnumpy(a)[:4].tolist() == [0, 0, 4, 4]


def test_a_wait_takes_the_event_as_recorded_when_it_is_queued(fake: Any) -> None:
    current = fake.cuda.get_current_stream()
    copies = fake.cuda.Stream(non_blocking=True)
    a = fake.zeros(2, dtype=np.float32)
    event = fake.cuda.Event(block=True, disable_timing=True)
    current.record(event)
    copies.wait_event(event)
    a += 1
    current.record(event)  # re-recorded after the wait was queued: the wait does not cover this
    pinned = np.frombuffer(fake.cuda.alloc_pinned_memory(8), dtype=np.float32, count=2)
    a.get(stream=copies, out=pinned, blocking=False)
    copies.synchronize()
    assert pinned.tolist() == [0, 0]  # the copy ran before the increment: nothing ordered it after
    current.synchronize()


def test_devices_are_checked(fake: Any) -> None:
    with fake.cuda.Device(1):
        a = fake.zeros(3, dtype=np.float32)
        stream = fake.cuda.Stream(non_blocking=True)
        event = fake.cuda.Event()
    assert a.device.id == 1 and fake.cuda.runtime.getDevice() == 0
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device \(0\)"):
        a += 1
    assert fake.empty_like(a).device.id == 0  # on the current device, as CuPy's
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        event.record(fake.cuda.get_current_stream())
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        fake.zeros(3, dtype=np.float32).get(stream=stream)
    with pytest.raises(RuntimeError, match="belongs to device 1"), stream:
        pass
    assert fake.asnumpy(a).tolist() == [0, 0, 0]  # a copy on the default stream works from any device
