"""Chunk plans and the per-chunk pack / reduce / scale / unpack loop.

A plan is a function of the contract and of what every rank agreed on
(global presence), never of local memory layout, so every rank issues the
same sequence of collectives with the same counts. Locally each call is
then either *direct* (the chunk already lies in one contiguous float32
region: reduce it in place, no copy) or *staged* (upcast into a reusable
chunk-sized float32 buffer, reduce, scale, cast back).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import arrays

__all__ = [
    "BCAST_OWN_BYTES", "BCAST_SPLIT_BYTES", "DEFAULT_CHUNK_BYTES", "NUMBA_CASTS", "REDUCTIONS", "SCATTER_MIN", "SCATTER_MIN_FP32", "TORCH_CASTS", "Call", "Moves",
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


#: Elements per sub-block of the host conversion loops: small enough that a
#: sub-block and its scratch stay in a core's L2 cache between passes.
_BLOCK = 1 << 16
#: Shorter bfloat16 segments use ml_dtypes' cast (one call) instead of the
#: integer passes below (several calls, each faster per element).
_FAST_BF16 = 1 << 13


def _scaler(scale: float) -> tuple[Callable[..., Any], np.float32]:
    """Return ``(ufunc, operand)`` that divides by ``float32(scale)``, bitwise equal to ``x / float32(scale)``.

    A power of two is a multiplication by its (exact) reciprocal: both are
    the correctly rounded value of the same real number, subnormal results
    included, and a multiplication is several times cheaper than a division.
    """
    f = np.float32(scale)
    mantissa, exponent = math.frexp(float(f))  # f == mantissa * 2**exponent
    if mantissa == 0.5 and -125 <= exponent <= 127:  # 2**k with k and -k normal exponents
        return np.multiply, np.float32(2.0 ** (1 - exponent))
    return np.divide, f


def _bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """Upcast bfloat16 ``src`` into float32 ``dst``: the bits shifted into the high half (exact)."""
    s16, d32 = src.view(np.uint16), dst.view(np.uint32)
    for lo in range(0, s16.size, _BLOCK):
        d = d32[lo : lo + _BLOCK]
        np.copyto(d, s16[lo : lo + _BLOCK])
        np.left_shift(d, 16, out=d)


#: Elements per sub-block of the float16 upcast (measured best of 2**12 to 2**16 on the development machine).
_BLOCK16 = 1 << 14
#: float16 magnitude bits moved to float32's place, from exponent 31 (infinity, NaN) up
_F16_SPECIAL = np.uint32(0x1F << 23)


def _f16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """Upcast float16 ``src`` into float32 ``dst`` exactly, bitwise as NumPy casts it (NaN payloads too).

    The magnitude bits moved into float32's place are a float32 of the same
    mantissa with the exponent 112 lower (a float16 subnormal a float32 one),
    so one multiplication by 2**112 (exact) rebiases every finite value;
    infinity and NaN get float32's all-ones exponent instead; then the sign.
    About twice as fast as NumPy's scalar cast loop.
    """
    s16, d32 = src.view(np.uint16), dst.view(np.uint32)
    sign = np.empty(min(_BLOCK16, s16.size), np.uint32)
    for lo in range(0, s16.size, _BLOCK16):
        d = d32[lo : lo + _BLOCK16]
        t = sign[: d.size]
        np.copyto(d, s16[lo : lo + _BLOCK16])
        np.left_shift(d, 16, out=d)
        np.bitwise_and(d, np.uint32(0x80000000), out=t)
        np.bitwise_and(d, np.uint32(0x7FFF0000), out=d)
        np.right_shift(d, 3, out=d)
        special = d >= _F16_SPECIAL if d.max() >= _F16_SPECIAL else None
        f = d.view(np.float32)
        np.multiply(f, np.float32(2.0**112), out=f)
        if special is not None:
            np.bitwise_or(d, np.uint32(0x7F800000), out=d, where=special)
        np.bitwise_or(d, t, out=d)


def _f32_to_bf16(src: np.ndarray, dst: np.ndarray, scratch: np.ndarray) -> None:
    """Round float32 ``src`` to nearest even bfloat16 into ``dst``, bitwise as ml_dtypes casts it.

    ``(bits + 0x7FFF + lowest kept bit) >> 16`` is round-to-nearest-even on
    the bits for every finite value and infinity (overflow rounds to
    infinity, subnormals round on the same grid). Only NaN needs care: a
    segment holding one is cast by ml_dtypes instead.
    """
    if np.isnan(np.max(src)):
        dst[...] = src
        return
    u32, d16 = src.view(np.uint32), dst.view(np.uint16)
    for lo in range(0, u32.size, _BLOCK):
        u = u32[lo : lo + _BLOCK]
        t = scratch[: u.size]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(d16[lo : lo + _BLOCK], t, casting="unsafe")


#: Use PyTorch's vectorized 16-bit casts on host arrays when the process has
#: imported torch (None: automatic; False: never, NumPy / ml_dtypes casts
#: only). They are bitwise equal to NumPy's and ml_dtypes' for every non-NaN
#: value (a NaN stays a NaN, its payload may differ) and, measured per cast
#: on one thread of the development machine, 2-9 (bfloat16) and 25-45
#: (float16) times faster: NumPy's float16 casts are scalar loops. mpidp
#: never imports torch itself.
TORCH_CASTS: bool | None = None
#: Shorter segments use the NumPy casts: one torch call costs about 2 us.
_TORCH_MIN = 1 << 12


def _torch_for(n: int) -> Any:
    """The torch module to cast ``n`` elements with, or None."""
    if TORCH_CASTS is False or n < _TORCH_MIN:
        return None
    return sys.modules.get("torch")


#: Use the compiled 16-bit casts of :mod:`mpidp.kernels` (numba, ``pip install
#: mpidp[numba]``) where torch's are not used (None: when numba is installed;
#: False: never, NumPy / ml_dtypes casts only). As fast as torch's on one core
#: of the development machine, 2-27x faster than NumPy's (docs/performance.md), and
#: bitwise equal to NumPy's and ml_dtypes' for every non-NaN value (a NaN
#: stays a NaN of its sign, its payload may differ). The first cast of a
#: process imports numba and loads the compiled kernels (about 1 s; they are
#: compiled on the first use after installing and cached beside the module).
NUMBA_CASTS: bool | None = None
#: the kernels module once imported; False when numba is absent or the kernels failed to build
_kernels: Any = None


def _kernels_for(*pair: np.ndarray) -> Any:
    """The compiled kernels to cast between ``pair`` with, or None (not wanted, absent, or arrays they do not take)."""
    global _kernels
    if NUMBA_CASTS is False or pair[0].size < _TORCH_MIN or _kernels is False:
        return None
    if not all(a.flags.c_contiguous and a.flags.aligned and a.dtype.isnative and a.ndim == 1 for a in pair):
        return None
    if _kernels is None:
        try:
            from . import kernels
        except Exception as e:  # noqa: BLE001 - numba absent (ImportError), or it could not build them: NumPy casts
            _kernels = False
            if NUMBA_CASTS is True or not isinstance(e, ImportError):
                warnings.warn(f"mpidp: compiled 16-bit casts unavailable, using NumPy's: {type(e).__name__}: {e}", stacklevel=3)
            return None
        _kernels = kernels
    return _kernels


def _tensor(torch: Any, a: np.ndarray) -> Any:
    """A tensor sharing the memory of host array ``a`` (bfloat16 through its bits)."""
    if a.dtype == arrays.BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _pack(dst: np.ndarray, src: np.ndarray) -> None:
    """Upcast one host segment into the float32 stage."""
    if src.dtype != np.float32:
        torch = _torch_for(src.size)
        if torch is not None:
            _tensor(torch, dst).copy_(_tensor(torch, src))
            return
        kernels = _kernels_for(src, dst)
        if kernels is not None:
            if src.dtype == np.float16:
                kernels.f16_to_f32(src.view(np.uint16), dst)
            else:
                kernels.bf16_to_f32(src.view(np.uint16), dst.view(np.uint32))
            return
    if src.dtype == arrays.BFLOAT16 and src.size >= _FAST_BF16:
        _bf16_to_f32(src, dst)
    elif src.dtype == np.float16 and src.size >= _FAST_BF16:
        _f16_to_f32(src, dst)
    else:
        dst[...] = src


def _unpack(dst: np.ndarray, src: np.ndarray, op: Callable[..., Any], operand: np.float32, scratch: list[np.ndarray]) -> None:
    """Scale one reduced host segment of the stage and cast it back into its slot.

    float32 segments are scaled straight into their slot. 16-bit ones are
    scaled in the stage and cast by torch when it is loaded; otherwise
    bfloat16 is scaled and rounded per sub-block while the sub-block is in
    cache, and float16 is scaled straight into its slot (the ufunc computes
    in float32 and casts its output, as a division followed by ``astype``
    does).
    """
    if dst.dtype == np.float32:
        op(src, operand, out=dst)
        return
    torch = _torch_for(src.size)
    if torch is not None:
        op(src, operand, out=src)  # whole segments: the torch calls cost more than the cache misses
        _tensor(torch, dst).copy_(_tensor(torch, src))
        return
    kernels = _kernels_for(src, dst)
    if kernels is not None:  # the division and the cast in one pass
        cast = kernels.f32_to_f16 if dst.dtype == np.float16 else kernels.f32_to_bf16
        cast(src, dst.view(np.uint16), operand, op is np.multiply)
        return
    if dst.dtype == arrays.BFLOAT16 and src.size >= _FAST_BF16:
        if not scratch:  # one sub-block of scratch per reduce_calls, allocated on first use
            scratch.append(np.empty(_BLOCK, np.uint32))
        for lo in range(0, src.size, _BLOCK):
            s = src[lo : lo + _BLOCK]
            op(s, operand, out=s)
            _f32_to_bf16(s, dst[lo : lo + _BLOCK], scratch[0])
        return
    if dst.dtype == np.float16:
        op(src, operand, out=dst, casting="unsafe")
        return
    op(src, operand, out=src)
    dst[...] = src


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


def run_steps(work: Sequence[Step], moves: Moves | Callable[[np.ndarray], None], scale: float) -> None:
    """Sum each step over all ranks and divide by ``float32(scale)``: the host loop of :func:`reduce_calls`."""
    if not isinstance(moves, Moves):
        moves = Moves(moves)
    allreduce, reduce_scatter, allgather = moves
    op, operand = _scaler(scale)
    scratch: list[np.ndarray] = []
    for buf, pieces, gather, mine, shard, back, pad in work:
        for piece, src in pieces:
            _pack(piece, src)
        if gather is None:
            allreduce(buf)
            if not pieces:
                op(buf, operand, out=buf)
            for piece, dst in pieces:
                _unpack(dst, piece, op, operand, scratch)
            continue
        if pad:
            buf[buf.size - pad :] = 0
        assert reduce_scatter is not None and allgather is not None and mine is not None and shard is not None
        reduce_scatter(buf, shard)
        _unpack(mine, shard, op, operand, scratch)  # the owner divides its share and casts it, once
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
) -> None:
    """Sum every call over all ranks, divide by ``float32(scale)`` and leave the result in the slots (host arrays).

    Results are bitwise those of upcasting to float32, summing, dividing by
    ``scale`` in float32 and casting back with NumPy / ml_dtypes, and equal
    on every rank (a reduce-scattered value is computed by one rank). Extra
    host memory: at most one sub-block of scratch (256 KiB) beside ``stage``
    and ``scatter``'s buffers. Device arrays go through :func:`mpidp.cuda.reduce_calls`.
    """
    run_steps(steps(calls, slots, stage, scatter), moves, scale)
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
