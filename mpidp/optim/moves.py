"""The sharded step's movement: gradients reduce-scattered to their owners as float32, updated slices gathered as bytes (collective).

The scatter runs in rounds of ``chunk`` float32 values per rank: in round
``k`` rank ``j``'s block of the send buffer holds the flat elements
``[b[j] + k c, b[j] + (k + 1) c)`` of its slice (zeros past its end), so one
Reduce_scatter_block gives each owner the sum of its next ``c`` elements:
the bytes of the Allreduce path's float32 reduce-scatter, plus at most one
padded block per rank and round.

The gather moves the parameters' own bytes (2 per bfloat16 or float16
element, 4 per float32): the flat byte storage is every slot's bytes back
to back, and rank ``j``'s slice of elements is one contiguous byte range
``[B[j], B[j + 1])`` of it (:func:`mpidp.cut.byte_bounds`). In round
``k`` rank ``j`` sends bytes ``[B[j] + k c, B[j] + (k + 1) c)`` of its range
(``c``: the chunk's bytes per rank), and one Allgatherv gives every rank
every owner's round, unpadded: the gather moves each parameter's bytes once.
Every rank calls the same collectives: the cut, the dtypes and the chunk
are agreed facts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..cut import Cut

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["gather", "rounds", "scatter"]

#: ``fill(lo, hi, out)``: write flat elements (or bytes) ``[lo, hi)`` into ``out``; ``write(lo, hi, values)``: take them
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


def gather(comm: Communicator, spans: Sequence[int], rank: int, chunk_bytes: int, fill: Fill, write: Fill, operation: str) -> None:
    """Give every rank every owner's updated bytes (collective).

    ``spans``: the ``size + 1`` byte bounds of the slices in the flat byte
    storage; ``fill(lo, hi, out)`` reads this rank's bytes ``[lo, hi)`` into
    uint8 ``out``, ``write(lo, hi, values)`` takes another owner's.
    """
    size = len(spans) - 1
    if size == 1:
        return
    c = max(1, chunk_bytes // size)
    n = max(-(-(b - a) // c) for a, b in itertools.pairwise(spans))
    buf = np.empty(size * c, np.uint8)
    for k in range(n):
        lows = [spans[j] + k * c for j in range(size)]
        counts = [max(0, min(c, spans[j + 1] - lows[j])) for j in range(size)]
        displs = [sum(counts[:j]) for j in range(size)]
        if counts[rank]:
            fill(lows[rank], lows[rank] + counts[rank], buf[displs[rank] : displs[rank] + counts[rank]])
        comm.Allgatherv_in_place(buf, counts, displs, f"{operation}: Allgatherv")
        for j in range(size):
            if counts[j] and j != rank:
                write(lows[j], lows[j] + counts[j], buf[displs[j] : displs[j] + counts[j]])
