"""The sharded step's float32 movement: gradients reduce-scattered to their owners, updated slices gathered (collective).

Rounds of ``chunk`` float32 values per rank: in round ``k`` rank ``j``'s
block of the send buffer holds the flat elements ``[b[j] + k c, b[j] + (k + 1) c)``
of its slice (zeros past its end), so one Reduce_scatter_block gives each
owner the sum of its next ``c`` elements; the gather runs the same rounds
backwards with an Allgather. Every rank calls the same collectives: the cut
and the chunk are agreed facts. The bytes are those of the Allreduce path
(a float32 reduce-scatter and a float32 allgather of the flat storage),
plus at most one padded block per rank and round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .cut import Cut

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["gather", "rounds", "scatter"]

#: ``fill(lo, hi, out)``: write flat elements ``[lo, hi)`` into float32 ``out``; ``write(lo, hi, values)``: take them
Fill = Callable[[int, int, np.ndarray], None]


def rounds(cut: Cut, chunk: int) -> tuple[int, int]:
    """The values per rank and round, and the number of rounds (both equal on every rank)."""
    c = max(1, chunk // cut.size)
    share = max(b - a for a, b in zip(cut.bounds, cut.bounds[1:]))
    return c, -(-share // c)


def scatter(comm: Communicator, cut: Cut, chunk: int, fill: Fill, out: np.ndarray, operation: str) -> None:
    """Sum every rank's flat gradient (read through ``fill``) into ``out``, this rank's slice (collective)."""
    c, n = rounds(cut, chunk)
    send = np.empty(cut.size * c, np.float32)
    recv = np.empty(c, np.float32)
    mine = cut.hi - cut.lo
    for k in range(n):
        send[...] = 0
        for j in range(cut.size):
            lo = cut.bounds[j] + k * c
            hi = min(lo + c, cut.bounds[j + 1])
            if hi > lo:
                fill(lo, hi, send[j * c : j * c + hi - lo])
        here = out[k * c : min((k + 1) * c, mine)]
        if cut.size > 1:
            comm.Reduce_scatter_block(send, recv, f"{operation}: Reduce_scatter_block")
            here[...] = recv[: here.size]
        else:
            here[...] = send[: here.size]


def gather(comm: Communicator, cut: Cut, chunk: int, fill: Fill, write: Fill, operation: str) -> None:
    """Give every rank every owner's updated values: ``fill`` reads this rank's, ``write`` takes the others' (collective)."""
    if cut.size == 1:
        return
    c, n = rounds(cut, chunk)
    buf = np.zeros(cut.size * c, np.float32)
    for k in range(n):
        lo = cut.lo + k * c
        hi = min(lo + c, cut.hi)
        if hi > lo:
            fill(lo, hi, buf[cut.rank * c : cut.rank * c + hi - lo])
        comm.Allgather_in_place(buf, f"{operation}: Allgather")
        for j in range(cut.size):
            lo = cut.bounds[j] + k * c
            hi = min(lo + c, cut.bounds[j + 1])
            if hi > lo and j != cut.rank:
                write(lo, hi, buf[j * c : j * c + hi - lo])


