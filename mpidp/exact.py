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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BITS", "LIMIT", "Accumulator", "Facts", "decode", "encode", "shard"]

#: each fold keeps its values to 2**-BITS of the power of two above its largest magnitude
BITS = 36
#: the bits an agreed slot may span: largest exponent - finest quantum + bits of the number of folds
LIMIT = 62

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


class Facts:
    """The agreed facts of one slot over the ranks with a weight: finest quantum, largest exponent, folds."""

    __slots__ = ("count", "overflow", "quantum", "special", "top")

    def __init__(self, words: Sequence[int]) -> None:
        self.quantum: int | None = None
        self.top = -_BIAS
        self.count = 0
        self.special = False
        self.overflow = False
        for word in words:
            q, top, count, special, overflow = decode(word)
            self.special |= special
            self.overflow |= overflow
            if q is not None:
                self.quantum = q if self.quantum is None else min(self.quantum, q)
                self.top = max(self.top, top)
                self.count += count
        if self.quantum is not None and _span(self.top, self.quantum, self.count) > LIMIT:
            self.overflow = True


def _span(top: int, quantum: int, count: int) -> int:
    """Bits the sum of ``count`` folds of magnitude below ``2**top`` at ``quantum`` may need."""
    return top - quantum + int(count).bit_length()


def _exponent(x: np.ndarray) -> tuple[int | None, bool]:
    """The exponent ``e`` with every finite magnitude below ``2**e`` (None: all zero), and whether some value is not finite."""
    if x.size == 0:
        return None, False
    m = float(np.max(np.abs(x)))
    if not np.isfinite(m):
        finite = np.isfinite(x)
        m = float(np.max(np.abs(x[finite]))) if finite.any() else 0.0
        special = True
    else:
        special = False
    if m == 0.0:
        return None, special
    return int(np.frexp(np.float32(m))[1]), special


def _integers(x: np.ndarray, e: int) -> np.ndarray:
    """``x`` rounded to multiples of ``2**(e - BITS)``, as int64 counts of that quantum (ties to even)."""
    scaled = np.ldexp(x, BITS - e)  # exact: a power of two, every magnitude stays below 2**BITS
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int64)


class Accumulator:
    """This rank's integer sums of one window, per reduction slot (local).

    ``fold`` adds one micro-batch's gradient of a slot; ``measure`` takes
    the last one's facts without adding it (what the window's record needs
    before the agreement, so that a refused window leaves nothing added);
    ``finish`` shifts every slot to its agreed quantum and adds what was
    measured; ``result`` converts an agreed sum back.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(int(n) for n in sizes)
        bounds = np.cumsum((0, *self.sizes)).tolist()
        self.bounds = list(itertools.pairwise(bounds))
        self.total = bounds[-1]
        self.sums: np.ndarray | None = None  # int64, allocated on the first fold
        #: the first error of a fold, this rank's error at the next reduce
        self.error: str | None = None
        self.clear()

    def clear(self) -> None:
        """Forget the window's folds (after a reduce that went ahead)."""
        n = len(self.sizes)
        self.quantum: list[int | None] = [None] * n
        self.top = [-_BIAS] * n
        self.count = [0] * n
        self.folded = [False] * n
        self.overflow = [False] * n
        self.special: dict[int, np.ndarray] = {}
        self.pending: dict[int, tuple[np.ndarray, int | None, bool]] = {}
        self.error = None
        if self.sums is not None:
            self.sums[...] = 0

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
        x = _float32(values)
        e, special = _exponent(x)
        self.folded[i] = True
        if special:
            x = self._keep_special(i, x)
        if e is None or self.overflow[i]:
            return
        q = e - BITS
        now = self.quantum[i]
        target = q if now is None else min(now, q)
        if _span(max(self.top[i], e), target, self.count[i] + 1) > LIMIT:
            self.overflow[i] = True
            return
        self._add(i, x, e, target)
        self.top[i] = max(self.top[i], e)
        self.count[i] += 1

    def measure(self, i: int, values: Any) -> None:
        """Take the facts of slot ``i``'s last micro-batch, to be added by :meth:`finish` (nothing added yet)."""
        x = _float32(values)
        e, special = _exponent(x)
        self.pending[i] = (x, e, special)

    def word(self, i: int) -> int:
        """Slot ``i``'s word of the window record: its folds and what was measured."""
        q, top, count, overflow = self.quantum[i], self.top[i], self.count[i], self.overflow[i]
        special = i in self.special
        if i in self.pending:
            _, e, special_last = self.pending[i]
            special |= special_last
            if e is not None:
                q = e - BITS if q is None else min(q, e - BITS)
                top, count = max(top, e), count + 1
        return encode(q, top, count, special, overflow)

    def present(self, i: int) -> bool:
        """Whether slot ``i`` was folded or measured in this window."""
        return self.folded[i] or i in self.pending

    def finish(self, facts: Sequence[Facts]) -> None:
        """Shift every slot to its agreed quantum and add what was measured (local; after the agreement)."""
        for i, f in enumerate(facts):
            last = self.pending.get(i)
            if last is not None and last[2]:
                self._keep_special(i, last[0])
            if f.quantum is None:
                continue
            now = self.quantum[i]
            if now is not None and now > f.quantum:
                s = self.slot(i)
                np.left_shift(s, now - f.quantum, out=s)
            self.quantum[i] = f.quantum
            if last is not None and last[1] is not None:
                x = last[0] if not last[2] else np.where(np.isfinite(last[0]), last[0], np.float32(0))
                self._add(i, x, last[1], f.quantum)
        self.pending = {}

    def _add(self, i: int, x: np.ndarray, e: int, target: int) -> None:
        s = self.slot(i)
        now = self.quantum[i]
        if now is not None and now > target:
            np.left_shift(s, now - target, out=s)
        ints = _integers(x.reshape(-1), e)
        shift = e - BITS - target
        if shift:
            np.left_shift(ints, shift, out=ints)
        s += ints
        self.quantum[i] = target

    def _keep_special(self, i: int, x: np.ndarray) -> np.ndarray:
        """Add the values of ``x`` that are not finite to slot ``i``'s float32 specials; ``x`` with them zeroed."""
        bad = ~np.isfinite(x.reshape(-1))
        kept = self.special.get(i)
        if kept is None:
            kept = self.special[i] = np.zeros(self.sizes[i], np.float32)
        kept[bad] += x.reshape(-1)[bad]
        return np.where(bad, np.float32(0), x.reshape(-1))


def _float32(values: Any) -> np.ndarray:
    """A float32 view or copy of a host array (16-bit values upcast, exactly)."""
    x = np.asarray(values)
    return x if x.dtype == np.float32 else x.astype(np.float32)


def result(sums: np.ndarray, quantum: int | None, global_weight: int, out: np.ndarray) -> None:
    """Write ``sums * 2**quantum / global_weight`` into ``out`` (its own dtype), rounded once to float64 then to ``out``'s."""
    if quantum is None:
        out[...] = 0
        return
    value = np.ldexp(sums.astype(np.float64), quantum)
    value /= float(global_weight)
    out[...] = value.astype(np.float32).reshape(out.shape) if out.dtype != np.float64 else value.reshape(out.shape)
