"""The cut: the flat trainable storage in ``world_size`` contiguous slices, and the pieces of a flat range (pure).

The flat storage is every trainable tie group's values, in
:attr:`mpidp.DataParallel.trainable` order, back to back. Rank ``r`` owns
``[total * r // size, total * (r + 1) // size)``: the shares differ by at
most one element, and the cut depends on nothing but the sizes and the
world size. A cut may fall inside a tensor.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Cut", "Piece", "bounds", "byte_bounds", "pieces", "starts"]


def bounds(total: int, size: int) -> tuple[int, ...]:
    """The ``size + 1`` slice boundaries of ``total`` flat elements: rank ``r`` owns ``[b[r], b[r + 1])``."""
    return tuple(total * r // size for r in range(size + 1))


def starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each slot starts in the flat storage (``len(sizes) + 1`` values, the total last)."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return tuple(out)


def byte_bounds(begin: Sequence[int], bytes_begin: Sequence[int], itemsizes: Sequence[int], cuts: Sequence[int]) -> tuple[int, ...]:
    """Where each flat element of ``cuts`` falls in the flat byte storage (each slot's bytes back to back, ``bytes_begin``).

    ``begin``: :func:`starts` of the element counts; ``bytes_begin``: of the
    byte counts; ``itemsizes``: each slot's. A slice ``[cuts[r], cuts[r + 1])``
    of elements is the byte range between the two results, contiguous too.
    """
    out = []
    for e in cuts:
        i = min(bisect.bisect_right(begin, e) - 1, len(itemsizes) - 1)
        out.append(bytes_begin[i] + (e - begin[i]) * itemsizes[i] if itemsizes else 0)
    return tuple(out)


class Piece(NamedTuple):
    """The part of one slot inside a flat range: slot ``slot``'s elements ``[a, b)``, at ``offset`` in the range."""

    slot: int
    a: int
    b: int
    offset: int


def pieces(begin: Sequence[int], lo: int, hi: int) -> list[Piece]:
    """The non-empty pieces of flat range ``[lo, hi)``, slot by slot (``begin``: :func:`starts`)."""
    out: list[Piece] = []
    if hi <= lo:
        return out
    i = bisect.bisect_right(begin, lo) - 1
    while i < len(begin) - 1 and begin[i] < hi:
        a, b = max(lo, begin[i]), min(hi, begin[i + 1])
        if b > a:
            out.append(Piece(i, a - begin[i], b - begin[i], a - lo))
        i += 1
    return out


class Cut(NamedTuple):
    """One session's cut: slot starts, slice bounds, this rank and the world size."""

    begin: tuple[int, ...]
    bounds: tuple[int, ...]
    rank: int
    size: int

    @classmethod
    def of(cls, sizes: Sequence[int], rank: int, size: int) -> Cut:
        """The cut of slots of ``sizes`` among ``size`` ranks, seen by ``rank``."""
        begin = starts(sizes)
        return cls(begin, bounds(begin[-1], size), rank, size)

    @property
    def lo(self) -> int:
        """Where this rank's slice starts in the flat storage."""
        return self.bounds[self.rank]

    @property
    def hi(self) -> int:
        """Where this rank's slice ends."""
        return self.bounds[self.rank + 1]

    def mine(self) -> list[Piece]:
        """This rank's pieces (offsets within its slice)."""
        return pieces(self.begin, self.lo, self.hi)
