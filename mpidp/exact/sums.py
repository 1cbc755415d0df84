"""The exact reduction: gradients as 64-bit integers at agreed scales, so that the sum has no order (pure).

Float32 sums depend on their order, and the order changes with the world
size, the reduction path and a resume. Integer sums do not. As CESM's
``shr_reprosum`` does, each *fold* (one micro-batch's gradient of one
reduction slot) is rounded once to a quantum of its own,
``2**(e - BITS)``, where ``2**e`` is the smallest power of two above the
fold's largest magnitude (a fact of the micro-batch alone), and kept as
int64 multiples of the finest quantum folded so far (a left shift, exact).
The window's record carries, per slot, the finest quantum, the largest
exponent and the number of folds; the ranks with a weight agree on their
minimum, maximum and sum, which do not depend on how the micro-batches
were spread over the ranks. Every rank shifts its integers to the agreed
quantum, the integers are summed with MPI_SUM in any order or grouping,
and the sum is converted once: ``float(sum) * 2**quantum / global_weight``,
in float64, then cast to the parameter's dtype. The result's bits depend
only on the set of micro-batches.

A slot whose folds span more than :data:`LIMIT` bits (largest exponent
minus finest quantum, plus the bits of the number of folds) could overflow
the int64 sum: that is one ContractError on every rank, decided on agreed
facts, so at every world size alike. Values that are not finite (inf,
NaN) are kept apart, summed in float32 (a sum of infinities and NaNs has
no order either), and win over the finite sum, as in a float32 sum.

Where every agreed slot of a chunk spans at most :data:`FLOAT_BITS` bits,
the integers travel as float64 values instead (MPI_DOUBLE): every partial
sum is then an integer below 2**53, which float64 adds exactly in any
order, so the sums and results are those of int64, bit for bit, and no
pass converts between integers and floats.

The passes over the values (:func:`kernels`, ``MPIDP_EXACT_KERNELS``) are
numba's compiled ones (:mod:`mpidp.exact.compiled`) where numba is
installed, else torch's (:mod:`mpidp.exact.torch_passes`) where the process has
imported torch, else NumPy's: the same bits every way.
"""

from __future__ import annotations

import bisect
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..arrays import dtype_name
from ..casts import Casts
from . import numpy_passes as _NumPy  # the last resort: NumPy's forms of the passes

__all__ = [
    "BITS", "FLOAT_BITS", "LIMIT", "MODES", "Accumulator", "Facts", "Measured", "SlowPassesWarning", "Stage", "decode", "encode", "kernels", "measured", "route", "shard",
    "slow_passes_once",
]

#: each fold keeps its values to 2**-BITS of the power of two above its largest magnitude
BITS = 36
#: the bits an agreed slot may span: largest exponent - finest quantum + bits of the number of folds
LIMIT = 62
#: the bits of the slots whose integers may travel and be summed as float64 (exact below 2**53)
FLOAT_BITS = 53
#: values of ``MPIDP_EXACT_KERNELS``: ``auto`` (numba's where installed, else torch's where the process imported
#: torch, else NumPy's), ``torch`` (torch's where imported, else NumPy's), ``numba`` (never torch's), ``numpy``
MODES = ("auto", "torch", "numba", "numpy")

_BIAS = 1 << 11  # exponents travel as unsigned 12-bit fields
_COUNT_BITS = 32
_SPECIAL = 1 << 62  # a fold held a value that is not finite
_OVERFLOW = 1 << 63  # a fold could not be added without exceeding LIMIT


def shard(count: int, rank: int, size: int) -> range:
    """The micro-batches of a fixed list of ``count`` that rank ``rank`` of ``size`` takes: ``rank, rank + size, ...``.

    Local. Micro-batch ``i`` goes to rank ``i % size``: the same list, cut
    the same way at every world size, so that an exact reduction of the
    micro-batches' gradients gives the same bits at any world size.
    """
    if min(count, rank, size - 1) < 0 or rank >= size:
        raise ValueError(f"shard needs count >= 0 and 0 <= rank < size, got count={count}, rank={rank}, size={size}")
    return range(rank, count, size)


def encode(quantum: int | None, top: int, count: int, special: bool, overflow: bool) -> int:
    """One slot's word of a window record (0: nothing folded, nothing special)."""
    word = (_SPECIAL if special else 0) | (_OVERFLOW if overflow else 0)
    if quantum is not None:
        word |= (quantum + _BIAS) | ((top + _BIAS) << 12) | (min(count, (1 << _COUNT_BITS) - 1) << 24)
    return word


def decode(word: int) -> tuple[int | None, int, int, bool, bool]:
    """(quantum or None, top, count, special, overflow) of a slot's word."""
    low = word & 0xFFF
    quantum = None if low == 0 else low - _BIAS
    top = ((word >> 12) & 0xFFF) - _BIAS
    count = (word >> 24) & ((1 << _COUNT_BITS) - 1)
    return quantum, top, count, bool(word & _SPECIAL), bool(word & _OVERFLOW)


#: a measured gradient: contiguous float32 values with inf and NaN zeroed; the exponent above their largest
#: magnitude (None: all zero); the inf and NaN apart (None: none)
Measured = tuple[np.ndarray, "int | None", "np.ndarray | None"]


class Facts:
    """The agreed facts of one slot over the ranks with a weight: finest quantum, largest exponent, folds."""

    __slots__ = ("count", "overflow", "quantum", "ranks", "single", "special", "top")

    def __init__(self, words: Sequence[int]) -> None:
        self.quantum: int | None = None
        self.top = -_BIAS
        self.count = 0
        self.special = False
        self.overflow = False
        #: the positions of ``words`` that have a quantum: the ranks whose rows :meth:`Accumulator.combine` sums, so every
        #: rank must give a word and a rank without a weight 0 (:meth:`mpidp.exact.window.ExactWindow.facts` does)
        self.ranks: tuple[int, ...] = ()
        #: whether no word holds more than one fold (each rank's integers are one rounded float32 each)
        self.single = True
        for j, word in enumerate(words):
            q, top, count, special, overflow = decode(word)
            self.special |= special
            self.overflow |= overflow
            self.single &= count <= 1
            if q is not None:
                self.ranks += (j,)
                self.quantum = q if self.quantum is None else min(self.quantum, q)
                self.top = max(self.top, top)
                self.count += count
        if self.quantum is not None and _span(self.top, self.quantum, self.count) > LIMIT:
            self.overflow = True

    def key(self) -> tuple[int | None, int, int, bool, bool]:
        """Everything the facts say, to compare two agreements of one slot."""
        return self.quantum, self.top, self.count, self.special, self.overflow


def _span(top: int, quantum: int, count: int) -> int:
    """Bits the sum of ``count`` folds of magnitude below ``2**top`` at ``quantum`` may need."""
    return top - quantum + int(count).bit_length()


class Stage(NamedTuple):
    """The chunk buffers of an exact window: two int64 send chunks (used in turns), this rank's summed share, the float32 results,
    every rank's part of this rank's share.

    Packing into the chunk the other ranks read in the previous call made
    the pack 20-30% slower at 2 ranks (its cache lines were theirs).
    """

    send: tuple[np.ndarray, np.ndarray]
    shard: np.ndarray
    floats: np.ndarray
    #: every rank's float32 integers of this rank's share (a thin chunk: :meth:`Accumulator.thin`), a row per rank
    parts: np.ndarray


class Accumulator:
    """This rank's integer sums of one window, per reduction slot (local, but for :meth:`reduce`).

    ``fold`` adds one micro-batch's gradient of a slot; ``measure`` takes
    the last one's facts without adding it (what the window's record needs
    before the agreement, so that a refused window leaves nothing added);
    ``reduce`` packs what was folded and measured chunk by chunk at the
    agreed quanta, sums over the ranks and converts back.
    """

    def __init__(self, sizes: Sequence[int], order: Sequence[int] | None = None, mode: str = "auto") -> None:
        self.sizes = tuple(int(n) for n in sizes)
        #: whose passes (:data:`MODES`; local: every route gives the same bits)
        self.mode = mode
        #: the slots in slot-space order (default: by index); any order agreed by every rank gives the same bits
        self.order = list(range(len(self.sizes)) if order is None else order)
        self._edges = np.cumsum((0, *(self.sizes[i] for i in self.order))).tolist()  # slot-space start of each, in order
        self.starts = [0] * len(self.sizes)
        for i, start in zip(self.order, self._edges):
            self.starts[i] = start
        self.bounds = [(self.starts[i], self.starts[i] + n) for i, n in enumerate(self.sizes)]
        self.total = self._edges[-1]
        self.sums: np.ndarray | None = None  # int64, allocated on the first fold
        self._stage: Stage | None = None
        self.quantum: list[int | None] = []  # per slot, the finest quantum folded (None: nothing folded); set by clear
        #: the first error of a fold, this rank's error at the next reduce
        self.error: str | None = None
        self.clear()

    def clear(self) -> None:
        """Forget the window's folds (after a reduce, and after a refused window)."""
        if self.sums is not None and any(q is not None for q in self.quantum):  # a fold wrote there
            self.sums[...] = 0
        n = len(self.sizes)
        self.quantum = [None] * n
        self.top = [-_BIAS] * n
        self.count = [0] * n
        self.folded = [False] * n
        self.overflow = [False] * n
        self.special: dict[int, np.ndarray] = {}
        #: per slot, what was measured for reduce
        self.pending: dict[int, Measured] = {}
        self.error = None

    def buffer(self) -> np.ndarray:
        """Every slot's integer sums, one int64 buffer in slot order (allocated on first use)."""
        if self.sums is None:
            self.sums = np.zeros(self.total, np.int64)
        return self.sums

    def slot(self, i: int) -> np.ndarray:
        """Slot ``i``'s integer sums."""
        lo, hi = self.bounds[i]
        return self.buffer()[lo:hi]

    def fold(self, i: int, values: Any) -> None:
        """Add one micro-batch's gradient of slot ``i`` (a host array of any floating dtype; not modified)."""
        k = kernels(self.mode)
        x, e, bad = measured(values, k)
        self.folded[i] = True
        if bad is not None:
            self._keep(i, bad)
        if e is None or self.overflow[i]:
            return
        now = self.quantum[i]
        target = e - BITS if now is None else min(now, e - BITS)
        if _span(max(self.top[i], e), target, self.count[i] + 1) > LIMIT:
            self.overflow[i] = True
            return
        s = self.slot(i)
        k.pack(x, 2.0 ** (BITS - e), e - BITS - target, _EMPTY if now is None else s, 0 if now is None else now - target, s)
        self.quantum[i] = target
        self.top[i] = max(self.top[i], e)
        self.count[i] += 1

    def measure(self, i: int, values: Any) -> None:
        """Take the facts of slot ``i``'s last micro-batch, to be added by :meth:`reduce` (nothing added yet)."""
        self.pending[i] = measured(values, kernels(self.mode))

    def word(self, i: int, measured: Measured | None = None) -> int:
        """Slot ``i``'s word of the window record: its folds and what was measured (or ``measured``, given)."""
        q, top, count, overflow = self.quantum[i], self.top[i], self.count[i], self.overflow[i]
        special = i in self.special
        measured = self.pending.get(i) if measured is None else measured
        if measured is not None:
            _, e, bad = measured
            special |= bad is not None
            if e is not None:
                q = e - BITS if q is None else min(q, e - BITS)
                top, count = max(top, e), count + 1
        return encode(q, top, count, special, overflow)

    def present(self, i: int) -> bool:
        """Whether slot ``i`` was folded or measured in this window."""
        return self.folded[i] or i in self.pending

    def take_specials(self) -> None:
        """Add the inf and NaN of what was measured to the slots' float32 specials (after the agreement)."""
        for i, (_, _, bad) in self.pending.items():
            if bad is not None:
                self._keep(i, bad)

    def _keep(self, i: int, bad: np.ndarray) -> None:
        kept = self.special.get(i)
        if kept is None:
            kept = self.special[i] = np.zeros(self.sizes[i], np.float32)
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as in a float32 sum
            kept += bad

    def stage(self, chunk: int, size: int) -> Stage:
        """The chunk buffers, made on first use: ``chunk`` int64 values, a multiple of ``size``."""
        if self._stage is None or self._stage.send[0].size != chunk:
            send = (np.empty(chunk, np.int64), np.empty(chunk, np.int64))
            self._stage = Stage(send, np.empty(chunk // size, np.int64), np.empty(chunk, np.float32), np.empty(chunk, np.float32))
        return self._stage

    def pack(self, lo: int, hi: int, facts: Sequence[Facts], out: np.ndarray) -> None:
        """Slot space ``[lo, hi)`` at the agreed quanta, as int64 into ``out`` (float64: see :meth:`floats`): the folds shifted,
        plus what was measured."""
        for i, a, b in self.pieces(lo, hi):
            base = self.starts[i]
            self.pack_slot(i, facts[i].quantum, self.pending.get(i, _NOTHING), out[a - lo : b - lo], a - base, b - base)

    def pack_slot(self, i: int, q: int | None, measured: Measured, out: np.ndarray, a: int = 0, b: int | None = None) -> None:
        """Values ``[a, b)`` of slot ``i`` at quantum ``q`` (None: zeros), as int64 (or float64) into ``out``: its folds plus ``measured``."""
        b = self.sizes[i] if b is None else b
        if q is None:
            out[...] = 0
            return
        k, now, (x, e, _) = kernels(self.mode), self.quantum[i], measured
        acc = _EMPTY if now is None else self.buffer()[self.starts[i] + a : self.starts[i] + b]
        s = 0 if now is None else now - q
        x, scale, t = (_EMPTY32, 1.0, 0) if e is None else (x[a:b], 2.0 ** (BITS - e), e - BITS - q)  # e None: the folds alone
        if out.dtype == np.int64:
            k.pack(x, scale, t, acc, s, out)
        else:
            k.pack_float(x, scale, 2.0**t, acc, 2.0**s, out)

    def floats(self, lo: int, hi: int, facts: Sequence[Facts]) -> bool:
        """Whether slot space ``[lo, hi)``'s integers may travel as float64: every agreed slot spans :data:`FLOAT_BITS` or fewer."""
        spans = (_span(f.top, f.quantum, f.count) for f in (facts[i] for i, _, _ in self.pieces(lo, hi)) if f.quantum is not None)
        return all(span <= FLOAT_BITS for span in spans)

    def thin(self, lo: int, hi: int, facts: Sequence[Facts]) -> bool:
        """Whether slot space ``[lo, hi)`` may travel as float32: every agreed slot spans :data:`FLOAT_BITS` or fewer, one fold per rank.

        Each rank's integers at the agreed quantum are then one fold's
        rounded float32 value times a power of two: at most 24 significant
        bits below 2**53, exact as float32 (:meth:`pack32`); the owner sums
        every rank's in float64 (:meth:`combine`), exactly. The exchange moves
        the bytes of the default float32 path.
        """
        return all(f.quantum is None or (f.single and _span(f.top, f.quantum, f.count) <= FLOAT_BITS) for f in (facts[i] for i, _, _ in self.pieces(lo, hi)))

    def pack32(self, lo: int, hi: int, facts: Sequence[Facts], out: np.ndarray) -> None:
        """Slot space ``[lo, hi)``, this rank's one fold or measured gradient per slot, at the agreed quanta as float32 into ``out``
        (where :meth:`thin`)."""
        k = kernels(self.mode)
        for i, a, b in self.pieces(lo, hi):
            o, base, q = out[a - lo : b - lo], self.starts[i], facts[i].quantum
            x, e, _ = self.pending.get(i, _NOTHING)
            if q is None or (e is None and self.quantum[i] is None):  # nothing here: zeros
                o[...] = 0
            elif e is not None:
                k.pack32(x[a - base : b - base], 2.0 ** (BITS - e), 2.0 ** (e - BITS - q), o)
            else:  # one fold, already rounded: the int64 times a power of two (exact)
                np.multiply(self.buffer()[a:b], 2.0 ** (self.quantum[i] - q), out=o, casting="unsafe")  # type: ignore[operator]
                o += 0.0  # no -0.0 is sent

    def combine(self, lo: int, hi: int, facts: Sequence[Facts], parts: np.ndarray, global_weight: int, out: np.ndarray) -> None:
        """Sum every rank's float32 integers of slot space ``[lo, hi)`` (``parts``: a row per rank, from ``lo``) and convert once,
        as :meth:`unpack`, into ``out``."""
        k = kernels(self.mode)
        for i, a, b in self.pieces(lo, hi):
            f, o = facts[i], out[a - lo : b - lo]
            if f.quantum is None:
                o[...] = 0
            else:
                k.combine(parts[:, a - lo : b - lo], f.ranks, global_weight / 2.0**f.quantum, o)

    def unpack(self, lo: int, hi: int, facts: Sequence[Facts], ints: np.ndarray, global_weight: int, out: np.ndarray) -> None:
        """Convert summed ints (int64, or float64) of slot space ``[lo, hi)`` to float32 ``ints * 2**quantum / global_weight`` into ``out``."""
        k = kernels(self.mode)
        convert = k.unpack if ints.dtype == np.int64 else k.unpack_float
        for i, a, b in self.pieces(lo, hi):
            q, o = facts[i].quantum, out[a - lo : b - lo]
            if q is None:
                o[...] = 0
            else:
                convert(ints[a - lo : b - lo], 2.0**q, float(global_weight), o)

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """The slots that overlap slot space ``[lo, hi)``: (slot, start, end) of each overlap."""
        j = bisect.bisect_right(self._edges, lo) - 1
        while j < len(self.order) and self._edges[j] < hi:
            i = self.order[j]
            a, b = max(lo, self.bounds[i][0]), min(hi, self.bounds[i][1])
            if a < b:
                yield i, a, b
            j += 1


_EMPTY = np.zeros(0, np.int64)
_EMPTY32 = np.zeros(0, np.float32)
_NOTHING: Measured = (_EMPTY32, None, None)


def measured(values: Any, passes: Any = None) -> Measured:
    """A contiguous float32 view or copy of a host array (16-bit upcast exactly), inf and NaN zeroed; its exponent; the inf and NaN.

    ``passes``: whose (:func:`kernels`; default: this process's ``auto``). A
    16-bit array is upcast by the casts of the same family (mpidp.casts:
    the same bits every way); its inf and NaN are NumPy's upcast of them.
    """
    k = kernels() if passes is None else passes
    x = np.asarray(values)
    if dtype_name(x.dtype) in _SIXTEEN and x.size:
        src = np.ascontiguousarray(x).reshape(-1)
        x = np.empty(src.size, np.float32)
        _CASTS.get(k, _CASTS[_NumPy]).upcast(x, src)
    elif x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(-1)
    top, bad = k.maxabs(x.view(np.uint32))
    e = None if top == 0 else int(np.frexp(np.uint32(top).view(np.float32))[1])
    if not bad:
        return x, e, None
    finite = np.isfinite(x)
    exact = np.asarray(values).astype(np.float32).reshape(-1)  # NaN payloads as NumPy upcasts them, whoever upcast x
    return np.where(finite, x, np.float32(0)), e, np.where(finite, np.float32(0), exact)


_SIXTEEN = ("float16", "bfloat16")  # by name (mpidp.arrays.dtype_name): bfloat16 is ml_dtypes', imported lazily
#: per passes, the 16-bit upcasts of the same family (filled as routes are first chosen)
_CASTS: dict[Any, Casts] = {_NumPy: Casts("numpy")}
#: the compiled passes once imported; False where numba is absent or they failed to build (a fact of the process)
_numba: Any = None
#: :mod:`mpidp.exact.torch_passes` once imported (on first use, only where the process has imported torch)
_torch: Any = None


def kernels(mode: str = "auto") -> Any:
    """The passes of ``mode`` (:data:`MODES`) in this process now: numba's, torch's or NumPy's (may load numba)."""
    return {"numba": _load_numba, "torch": _load_torch, "numpy": lambda: _NumPy}[route(mode)]()


def route(mode: str = "auto") -> str:
    """Whose passes ``mode`` gives in this process now: ``numba``, ``torch`` or ``numpy`` (may load numba; looks up torch each time)."""
    if mode in ("auto", "numba") and _load_numba() is not None:
        return "numba"
    if mode in ("auto", "torch") and "torch" in sys.modules and sys.modules["torch"] is not None:
        return "torch"
    return "numpy"


class SlowPassesWarning(UserWarning):
    """An exact session runs torch's or NumPy's passes, slower than numba's compiled ones (``initialize`` warns once)."""


#: what torch's and numba's passes cost (docs/performance.md: Hugging Face GPT-2 29.0 M, 2 ranks, the README's loop)
TORCH_COST = "the exact reduce about 2.2x the default path's (the step 1.05x) on a GPT-2 of 29 M parameters at 2 ranks"
NUMBA_COST = "about 1.5x (the step 1.02x)"
#: whether :func:`slow_passes_once` has spoken in this process
_warned = False


def slow_passes_once(mode: str) -> str | None:
    """What torch's or NumPy's passes cost and how to get numba's, the first time an exact session of this process would run
    them; else None."""
    global _warned
    way = route(mode)
    if _warned or way == "numba":
        return None
    _warned = True
    if way == "torch":
        why = "numba is not installed" if mode == "auto" else f"MPIDP_EXACT_KERNELS={mode}"
        return (
            f"mpidp: exact=True runs its passes over the gradients as torch operations here ({why}): "
            f"{TORCH_COST}, where numba's compiled passes cost {NUMBA_COST} (docs/performance.md). For them, "
            "pip install numba (the mpidp[torch] extra brings it where numba has wheels); the bits are the same."
        )
    why = "numba is not installed and torch is not imported" if mode == "auto" else f"MPIDP_EXACT_KERNELS={mode}"
    return (
        f"mpidp: exact=True runs its passes over the gradients in NumPy here ({why}): several times slower than numba's "
        "or torch's, the exact reduce about 3x the default path's on a GPT-2 of 29 M parameters (docs/performance.md). "
        "For the fast passes, pip install numba (the mpidp[numba] extra), or import torch before initialize; the bits are the same."
    )


def _load_numba() -> Any:
    """:mod:`mpidp.exact.compiled`, or None where numba is absent or the build failed (a warning then)."""
    global _numba
    if _numba is None:
        try:
            from . import compiled as exact_kernels
        except Exception as e:  # noqa: BLE001 - numba absent (ImportError), or it could not compile: another route
            _numba = False
            if not isinstance(e, ImportError):
                warnings.warn(f"mpidp: compiled exact passes unavailable: {type(e).__name__}: {e}", stacklevel=3)
        else:
            _numba = exact_kernels
            _CASTS[exact_kernels] = Casts("numba")
    return _numba or None


def _load_torch() -> Any:
    """:mod:`mpidp.exact.torch_passes` (only called where the process has imported torch)."""
    global _torch
    if _torch is None:
        from . import torch_passes as exact_torch

        _torch = exact_torch
        _CASTS[exact_torch] = Casts("auto")
    return _torch
