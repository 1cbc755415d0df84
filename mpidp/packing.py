"""Chunk plans and the per-chunk pack / reduce / scale / unpack loop.

A plan is a function of the contract and of what every rank agreed on
(global presence), never of local memory layout, so every rank issues the
same sequence of collectives with the same counts. Locally each call is
then either *direct* (the chunk already lies in one contiguous float32
region: reduce it in place, no copy) or *staged* (upcast into a reusable
chunk-sized float32 buffer, reduce, scale, cast back). How a segment is
cast, and the division by the global weight, are :mod:`mpidp.casts`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import arrays
from .casts import DEFAULT, Casts, divisor

__all__ = [
    "BCAST_OWN_BYTES", "BCAST_SPLIT_BYTES", "DEFAULT_CHUNK_BYTES", "REDUCTIONS", "SCATTER_MIN", "SCATTER_MIN_FP32", "Call", "Moves",
    "Scatter", "Segment", "Slot", "Step", "bcast_calls", "direct", "plan", "reduce_calls", "reduce_scatter_for", "run_steps",
    "slot", "steps", "write_back",
]

#: Default chunk size in bytes. Measured with the chunk sweeps of
#: benchmarks/bench.py on the 2-core development machine (MPICH 5.0.2 wheel): 1-4 MiB chunks reach the
#: raw Allreduce limit; calls of 32 MiB and more page-fault MPICH's
#: temporary buffer on every call.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Largest Bcast of one host array region in ``initialize`` (never below the
#: chunk size). The raw Bcast sweeps of ``benchmarks/bench.py`` on the
#: development machine (MPICH 5.0.2 wheel, one written buffer, 5 runs):
#: 4 MiB calls within 0-6% of the best call size at 2 and 4 ranks, 64 MiB
#: calls within 0-14% at 2 ranks but 10-50% slower at 4.
BCAST_SPLIT_BYTES = 4 << 20
#: Host arrays of at least this many bytes get Bcast calls of their own in
#: ``initialize``; smaller ones are packed. A Bcast has no other pass over
#: the bytes, so the packing copies cost more than the extra calls: on the
#: ResNet-50 layout (161 arrays) with the development machine's MPICH,
#: arrays from 16 KiB to 256 KiB on their own were equally fast, and 1.20x /
#: 1.12x the raw Bcast limit at 2 / 4 ranks against 1.29x / 1.17x for
#: packing everything under 1 MiB (the reduce plan's threshold).
BCAST_OWN_BYTES = 64 << 10


class Segment(NamedTuple):
    slot: int  # index into the plan's slots
    src: int  # offset in the slot, in units
    dst: int  # offset in the call's buffer, in units
    length: int


class Call(NamedTuple):
    length: int
    segments: tuple[Segment, ...]


def plan(
    sizes: Sequence[int],
    present: Sequence[bool],
    chunk: int,
    split: int | None = None,
    large: int | None = None,
    kinds: Sequence[Any] | None = None,
) -> tuple[Call, ...]:
    """Split present slots into calls of at most ``chunk`` units.

    A slot of at least ``large`` units (default ``chunk // 4``) gets calls of
    its own (so a large contiguous array is reduced in place without
    packing), of at most ``split`` units (default ``chunk``); smaller slots
    are packed together, in slot order, into calls of at most ``chunk`` units.
    With ``kinds`` (one per slot, e.g. the dtypes), only slots of the same
    kind share a call, so that a call can be gathered in its own dtype.
    """
    chunk = max(1, chunk)
    large = max(1, min(chunk, large) if large is not None else chunk // 4)
    step = max(chunk, split or chunk)
    calls: list[Call] = []
    pending: dict[Any, list[Segment]] = {}  # kind -> the segments of its open call
    filled: dict[Any, int] = {}
    for index, (size, here) in enumerate(zip(sizes, present)):
        if not here or size == 0:
            continue
        if size >= large:
            for start in range(0, size, step):
                n = min(step, size - start)
                calls.append(Call(n, (Segment(index, start, 0, n),)))
            continue
        kind = None if kinds is None else kinds[index]
        at = filled.get(kind, 0)
        if at + size > chunk:
            calls.append(Call(at, tuple(pending.pop(kind))))
            at = 0
        pending.setdefault(kind, []).append(Segment(index, 0, at, size))
        filled[kind] = at + size
    calls.extend(Call(filled[kind], tuple(segments)) for kind, segments in pending.items())
    return tuple(calls)


class Slot(NamedTuple):
    """One array as the loop sees it: a flat contiguous view and how to put it back."""

    flat: np.ndarray  # 1-D, C-contiguous, same memory as the array (or a temporary copy)
    address: int
    itemsize: int
    float32: bool  # aligned float32: MPI may sum it where it lies (an unaligned one goes through the stage)
    original: Any  # the view to copy ``flat`` back into when it is a temporary, else None


def slot(v: Any) -> Slot:
    """Describe a host (NumPy) or device (CuPy) array view ``v`` for the chunk loop."""
    if v.flags.c_contiguous:
        flat, original = v.reshape(-1), None
    else:
        flat, original = arrays.xp(v).ascontiguousarray(v).reshape(-1), v
    address = arrays.address(flat) if flat.size else 0
    aligned = not isinstance(flat, np.ndarray) or flat.flags.aligned  # mpi4py cannot map an unaligned buffer's '=f'
    return Slot(flat, address, flat.itemsize, flat.dtype == np.float32 and aligned, original)


def direct(call: Call, slots: Sequence[Any], itemsize: int, dtype: Any = None) -> np.ndarray | None:
    """Return the contiguous region holding the whole call, or None if it must be staged.

    Units are bytes (``itemsize`` 1), float32 values (4), or values of ``dtype``.
    """
    first = call.segments[0]
    s = slots[first.slot]
    dtype = np.dtype(np.uint8 if itemsize == 1 else np.float32) if dtype is None else np.dtype(dtype)
    if len(call.segments) == 1:
        if itemsize == 1:
            return s.flat.view(np.uint8)[first.src : first.src + first.length]
        return s.flat[first.src : first.src + first.length] if _fits(s, dtype) else None
    end = s.address + first.src * itemsize
    start = end
    host = isinstance(s.flat, np.ndarray)
    for seg in call.segments:
        t = slots[seg.slot]
        if itemsize != 1 and not _fits(t, dtype):
            return None
        if t.original is not None or t.address + seg.src * itemsize != end:
            return None
        # device memory is joined only within one allocation: a CUDA copy or a
        # CUDA-aware MPI may refuse a range that spans two
        if not host and t.flat.data.mem is not s.flat.data.mem:
            return None
        end += seg.length * itemsize
    if host:
        return arrays.host_region(start, end - start, dtype)
    import cupy

    memory = cupy.cuda.UnownedMemory(start, end - start, s.flat, s.flat.device.id)
    return cupy.ndarray((end - start) // itemsize, dtype, cupy.cuda.MemoryPointer(memory, 0))


def _fits(s: Slot, dtype: np.dtype) -> bool:
    """Whether slot ``s`` can be handed to MPI as values of ``dtype``: float32 only when aligned (``s.float32``).

    mpi4py cannot map an unaligned float32 buffer ('=f'); 16-bit values are
    gathered as bytes, which have no alignment.
    """
    return s.flat.dtype == dtype and (s.float32 or dtype != np.float32)


#: Values of ``MPIDP_REDUCTION``: how a host call is summed (agreed in ``initialize``).
REDUCTIONS = ("auto", "allreduce", "reduce_scatter")
#: ``auto`` reduce-scatters 16-bit calls of at least this many units (shorter calls: one Allreduce
#: costs less than two collectives).
SCATTER_MIN = 1 << 15
#: ``auto`` reduce-scatters float32 calls of at least this many units (1 MiB): float32 saves only
#: the division of (n-1)/n of the values, which must outweigh a second collective's latency (a
#: 0.4 MiB call at 4 ranks took 1.39x the Allreduce's time reduce-scattered).
SCATTER_MIN_FP32 = 1 << 18
#: ``auto`` reduce-scatters float32 calls from this many ranks on (measured: slower at 2; at 4, even
#: on small pages and faster where huge pages came and went; it saves the division either way).
SCATTER_MIN_RANKS_FP32 = 3


def reduce_scatter_for(length: int, dtype: Any, size: int, mode: str) -> bool:
    """Whether a call of ``length`` units of one ``dtype`` (None: mixed) is reduce-scattered (pure; agreed facts only).

    ``allreduce``: never. ``reduce_scatter``: every call of one dtype.
    ``auto``: 16-bit calls of at least :data:`SCATTER_MIN` units on two
    ranks or more, float32 ones of at least :data:`SCATTER_MIN_FP32` units
    on :data:`SCATTER_MIN_RANKS_FP32` ranks or more. The owners divide (and
    cast) 1/n of the values instead of all of them after an Allreduce, and
    for 16-bit the Allgather moves 2-byte values. float32 saves only the
    division: on shared memory its pair of collectives was 0.94-1.02x the
    Allreduce's time at 4 ranks (small pages) but up to 1.18x at 2, and
    slower for short calls (docs/performance.md).
    """
    if dtype is None or mode == "allreduce":
        return False
    if mode == "reduce_scatter":
        return True
    if dtype == np.float32:
        return length >= SCATTER_MIN_FP32 and size >= SCATTER_MIN_RANKS_FP32
    return length >= SCATTER_MIN and size >= 2


class Scatter(NamedTuple):
    """What the reduce-scatter steps of one rank need: its place, the agreed mode, its buffers."""

    rank: int
    size: int
    mode: str  # one of REDUCTIONS, equal on every rank
    padded: np.ndarray  # float32, chunk + size units: a call padded to a multiple of ``size``
    shard: np.ndarray  # float32, chunk // size + 1 units: this rank's summed share

    @classmethod
    def allocate(cls, rank: int, size: int, mode: str, chunk: int) -> Scatter:
        """Buffers for calls of at most ``chunk`` units (local; may raise MemoryError)."""
        return cls(rank, size, mode, np.empty(chunk + size, np.float32), np.empty(chunk // size + 1, np.float32))


class Step(NamedTuple):
    """One host call of a window, its views cut in advance.

    A direct ``buf`` spanning several slots is built from their address and
    holds no reference to them: whoever keeps steps must keep the slots'
    arrays alive as long (``DataParallel`` keeps them in its kept result).
    A step with a ``gather`` is reduce-scattered: ``buf`` (float32, padded to
    a multiple of the world size) is summed into ``shard``, this rank divides
    and casts its shard into ``mine`` (its share of ``gather``, in the
    gradient's dtype) and every rank's share is gathered into ``gather``.
    """

    buf: np.ndarray  # what is summed: a region of the slots (direct) or of the stage
    pieces: tuple[tuple[np.ndarray, np.ndarray], ...]  # (stage piece, slot piece) per segment; () when direct
    gather: np.ndarray | None = None  # reduce-scatter: the finished values of every rank, in the gradient's dtype
    mine: np.ndarray | None = None  # this rank's share of ``gather``
    shard: np.ndarray | None = None  # float32: this rank's summed share
    back: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # (gather piece, slot piece) copied after the gather
    pad: int = 0  # units at the end of ``buf`` zeroed before the reduce-scatter


def _dtype(call: Call, slots: Sequence[Any]) -> Any:
    """The one dtype of every segment of ``call``, or None when they mix dtypes."""
    dtype = slots[call.segments[0].slot].flat.dtype
    return dtype if all(slots[seg.slot].flat.dtype == dtype for seg in call.segments) else None


def _scatter_step(call: Call, slots: Sequence[Any], scatter: Scatter, dtype: Any) -> Step:
    """The views of one reduce-scattered call (no data is touched)."""
    size = scatter.size
    share = -(-call.length // size)
    padded = share * size
    pad = padded - call.length
    if dtype == np.float32 and not pad:
        region = direct(call, slots, 4)
        if region is not None:  # summed from and gathered into the slots' own memory
            return Step(region, (), region, region[scatter.rank * share : (scatter.rank + 1) * share], scatter.shard[:share])
    buf = scatter.padded[:padded]
    pieces = tuple(
        (buf[seg.dst : seg.dst + seg.length], slots[seg.slot].flat[seg.src : seg.src + seg.length]) for seg in call.segments
    )
    gather = None if pad else direct(call, slots, dtype.itemsize, dtype)
    back: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    if gather is None:  # gathered in the stage (free once summed), then copied into the slots
        gather = scatter.padded.view(np.uint8)[: padded * dtype.itemsize].view(dtype)
        back = tuple((gather[dst : dst + n], src) for (_, src), (_, _, dst, n) in zip(pieces, call.segments))
    mine = gather[scatter.rank * share : (scatter.rank + 1) * share]
    return Step(buf, pieces, gather, mine, scatter.shard[:share], back, pad)


def steps(calls: Sequence[Call], slots: Sequence[Any], stage: np.ndarray, scatter: Scatter | None = None) -> tuple[Step, ...]:
    """Cut the views the host loop of ``calls`` works on (no data is touched).

    With ``scatter``, the calls :func:`reduce_scatter_for` picks are
    reduce-scattered. The steps stay valid as long as the slots' memory and
    the buffers do: a caller can keep them and run them again on the same arrays.
    """
    out: list[Step] = []
    for call in calls:
        if scatter is not None:
            dtype = _dtype(call, slots)
            if reduce_scatter_for(call.length, dtype, scatter.size, scatter.mode):
                out.append(_scatter_step(call, slots, scatter, dtype))
                continue
        region = direct(call, slots, 4)
        if region is not None:
            out.append(Step(region, ()))
            continue
        buf = stage[: call.length]
        pieces = tuple(
            (buf[seg.dst : seg.dst + seg.length], slots[seg.slot].flat[seg.src : seg.src + seg.length]) for seg in call.segments
        )
        out.append(Step(buf, pieces))
    return tuple(out)


class Moves(NamedTuple):
    """How the host loop reaches the other ranks (collectives, each called by every rank alike)."""

    allreduce: Callable[[np.ndarray], None]  # sum a float32 buffer in place
    reduce_scatter: Callable[[np.ndarray, np.ndarray], None] | None = None  # sum float32 ``send``, keep this rank's share
    allgather: Callable[[np.ndarray], None] | None = None  # every rank's equal share of a byte buffer, in place


def run_steps(
    work: Sequence[Step], moves: Moves | Callable[[np.ndarray], None], scale: float, casts: Casts = DEFAULT
) -> None:
    """Sum each step over all ranks and divide by ``float32(scale)``: the host loop of :func:`reduce_calls`."""
    if not isinstance(moves, Moves):
        moves = Moves(moves)
    allreduce, reduce_scatter, allgather = moves
    by = divisor(scale)
    upcast, downcast = casts.upcast, casts.downcast
    scratch: list[np.ndarray] = []
    for buf, pieces, gather, mine, shard, back, pad in work:
        for piece, src in pieces:
            upcast(piece, src)
        if gather is None:
            allreduce(buf)
            if not pieces:
                by.ufunc(buf, by.operand, out=buf)
            for piece, dst in pieces:
                downcast(dst, piece, by, scratch)
            continue
        if pad:
            buf[buf.size - pad :] = 0
        assert reduce_scatter is not None and allgather is not None and mine is not None and shard is not None
        reduce_scatter(buf, shard)
        downcast(mine, shard, by, scratch)  # the owner divides its share and casts it, once
        allgather(gather.view(np.uint8))
        for piece, dst in back:
            np.copyto(dst, piece)


def write_back(slots: Sequence[Any]) -> None:
    """Copy every temporary contiguous slot back into the strided array it stands for."""
    for s in slots:
        if s is not None and s.original is not None:
            s.original[...] = s.flat.reshape(s.original.shape)


def reduce_calls(
    calls: Sequence[Call],
    slots: Sequence[Any],  # a Slot for every slot a call names; others may be None
    stage: np.ndarray,
    moves: Moves | Callable[[np.ndarray], None],
    scale: float,
    scatter: Scatter | None = None,
    casts: Casts = DEFAULT,
) -> None:
    """Sum every call over all ranks, divide by ``float32(scale)`` and leave the result in the slots (host arrays).

    Results are bitwise those of upcasting to float32, summing, dividing by
    ``scale`` in float32 and casting back with NumPy / ml_dtypes, and equal
    on every rank (a reduce-scattered value is computed by one rank). Extra
    host memory: at most one sub-block of scratch (256 KiB) beside ``stage``
    and ``scatter``'s buffers. ``casts``: whose 16-bit casts (:class:`mpidp.casts.Casts`).
    Device arrays go through :meth:`mpidp.cuda.Device.reduce_calls`.
    """
    run_steps(steps(calls, slots, stage, scatter), moves, scale, casts)
    write_back(slots)


def bcast_calls(
    calls: Sequence[Call],
    slots: Sequence[Any],  # a Slot for every slot a call names; others may be None
    stage: np.ndarray,
    bcast: Callable[[np.ndarray], None],
    is_root: bool,
) -> None:
    """Broadcast every call's bytes from the root into the slots (units are bytes)."""
    for call in calls:
        region = direct(call, slots, 1)
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
        write_back(slots)
