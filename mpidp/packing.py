"""Chunk plans and the per-chunk pack / reduce / scale / unpack loop.

A plan is a function of the contract and of what every rank agreed on
(global presence), never of local memory layout, so every rank issues the
same sequence of collectives with the same counts. Locally each call is
then either *direct* (the chunk already lies in one contiguous float32
region: reduce it in place, no copy) or *staged* (upcast into a reusable
chunk-sized float32 buffer, reduce, scale, cast back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from . import arrays

__all__ = ["DEFAULT_CHUNK_BYTES", "Call", "Segment", "Slot", "bcast_calls", "plan", "reduce_calls", "slot"]

#: Default chunk size in bytes. Measured with benchmarks/chunks.py on the
#: 2-core development machine (MPICH 5.0.2 wheel): 1-4 MiB chunks reach the
#: raw Allreduce limit; calls of 32 MiB and more page-fault MPICH's
#: temporary buffer on every call.
DEFAULT_CHUNK_BYTES = 4 << 20


class Segment(NamedTuple):
    slot: int  # index into the plan's slots
    src: int  # offset in the slot, in units
    dst: int  # offset in the call's buffer, in units
    length: int


class Call(NamedTuple):
    length: int
    segments: tuple[Segment, ...]


def plan(sizes: Sequence[int], present: Sequence[bool], chunk: int) -> tuple[Call, ...]:
    """Split present slots into calls of at most ``chunk`` units.

    A slot of at least ``chunk // 4`` units gets calls of its own (so a large
    contiguous array is reduced in place without packing); smaller slots are
    packed together, in slot order, into calls of at most ``chunk`` units.
    """
    chunk = max(1, chunk)
    large = max(1, chunk // 4)
    calls: list[Call] = []
    pending: list[Segment] = []
    filled = 0
    for index, (size, here) in enumerate(zip(sizes, present)):
        if not here or size == 0:
            continue
        if size >= large:
            for start in range(0, size, chunk):
                n = min(chunk, size - start)
                calls.append(Call(n, (Segment(index, start, 0, n),)))
            continue
        if filled + size > chunk:
            calls.append(Call(filled, tuple(pending)))
            pending, filled = [], 0
        pending.append(Segment(index, 0, filled, size))
        filled += size
    if pending:
        calls.append(Call(filled, tuple(pending)))
    return tuple(calls)


class Slot(NamedTuple):
    """One array as the loop sees it: a flat contiguous view and how to put it back."""

    flat: np.ndarray  # 1-D, C-contiguous, same memory as the array (or a temporary copy)
    address: int
    itemsize: int
    float32: bool
    original: Any  # the view to copy ``flat`` back into when it is a temporary, else None


def slot(v: Any) -> Slot:
    """Describe a host (NumPy) or device (CuPy) array view ``v`` for the chunk loop."""
    if v.flags.c_contiguous:
        flat, original = v.reshape(-1), None
    else:
        flat, original = arrays.xp(v).ascontiguousarray(v).reshape(-1), v
    address = arrays.address(flat) if flat.size else 0
    return Slot(flat, address, flat.itemsize, flat.dtype == np.float32, original)


def _direct(call: Call, slots: Sequence[Any], itemsize: int) -> np.ndarray | None:
    """Return the contiguous region holding the whole call, or None if it must be staged."""
    first = call.segments[0]
    s = slots[first.slot]
    if len(call.segments) == 1:
        if itemsize == 1:
            return s.flat.view(np.uint8)[first.src : first.src + first.length]
        return s.flat[first.src : first.src + first.length] if s.float32 else None
    end = s.address + first.src * itemsize
    start = end
    for seg in call.segments:
        t = slots[seg.slot]
        if itemsize != 1 and not t.float32:
            return None
        if t.original is not None or t.address + seg.src * itemsize != end:
            return None
        end += seg.length * itemsize
    dtype = np.uint8 if itemsize == 1 else np.float32
    if isinstance(s.flat, np.ndarray):
        raw: Any = MPI.buffer.fromaddress(start, end - start)
        return np.frombuffer(raw, dtype=dtype)
    import cupy

    memory = cupy.cuda.UnownedMemory(start, end - start, s.flat)
    return cupy.ndarray((end - start) // itemsize, dtype, cupy.cuda.MemoryPointer(memory, 0))


def reduce_calls(
    calls: Sequence[Call],
    slots: Sequence[Any],  # a Slot for every slot a call names; others may be None
    stage: np.ndarray,
    allreduce: Callable[[np.ndarray], None],
    scale: np.float32,
) -> None:
    """Sum every call over all ranks, divide by ``scale`` and leave the result in the slots."""
    xp = arrays.xp(stage)  # numpy for host arrays, cupy for device arrays (cast and scale on the device)
    for call in calls:
        region = _direct(call, slots, 4)
        if region is not None:
            allreduce(region)
            xp.divide(region, scale, out=region)
            continue
        buf = stage[: call.length]
        for seg in call.segments:
            buf[seg.dst : seg.dst + seg.length] = slots[seg.slot].flat[seg.src : seg.src + seg.length]
        allreduce(buf)
        xp.divide(buf, scale, out=buf)
        for seg in call.segments:
            slots[seg.slot].flat[seg.src : seg.src + seg.length] = buf[seg.dst : seg.dst + seg.length]
    for s in slots:
        if s is not None and s.original is not None:
            s.original[...] = s.flat.reshape(s.original.shape)


def bcast_calls(
    calls: Sequence[Call],
    slots: Sequence[Any],  # a Slot for every slot a call names; others may be None
    stage: np.ndarray,
    bcast: Callable[[np.ndarray], None],
    is_root: bool,
) -> None:
    """Broadcast every call's bytes from the root into the slots (units are bytes)."""
    for call in calls:
        region = _direct(call, slots, 1)
        if region is not None:
            bcast(region)
            continue
        buf = stage[: call.length]
        if is_root:
            for seg in call.segments:
                buf[seg.dst : seg.dst + seg.length] = slots[seg.slot].flat.view(np.uint8)[seg.src : seg.src + seg.length]
        bcast(buf)
        if not is_root:
            for seg in call.segments:
                slots[seg.slot].flat.view(np.uint8)[seg.src : seg.src + seg.length] = buf[seg.dst : seg.dst + seg.length]
    if not is_root:
        for s in slots:
            if s.original is not None:
                s.original[...] = s.flat.reshape(s.original.shape)
