"""Reduction buckets that start summing while backward runs (host float32; any adapter can use them).

A session's trainable slots are laid out, in an order every rank agreed on
(roughly the reverse of the forward, as gradients become ready), in one
float32 *send* buffer, cut into buckets of at most ``chunk`` values (a slot
larger than that is a bucket of its own, summed in chunk-sized calls). The
adapter fills a slot's part of the send buffer and calls :meth:`Buckets.ready`;
when every slot of the next bucket in line is ready, the bucket's
non-blocking Allreduce starts, into a separate *receive* buffer, so that the
caller's gradients are never written by the network. Buckets start strictly
in order, so every rank issues the same collectives in the same order,
however its backward went: :meth:`Buckets.flush` starts whatever is left
(slots the backward did not reach are filled then, with zeros where a rank
has no gradient). Progress needs no thread: every :meth:`ready` tests the
requests in flight once (MPI progresses them inside the test, on the calling
thread, and returns at once), and :meth:`Buckets.wait` finishes them.

The buckets use a communicator of their own, so the window's agreement (on
the session's communicator) may run while they are in flight. Every window
starts every bucket exactly once, on every rank, whatever happens: a window
that raises, and ``close``, flush and wait first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .comm import Communicator

__all__ = ["Buckets", "layout"]


def layout(sizes: Sequence[int], order: Sequence[int], chunk: int) -> tuple[list[int], list[list[int]], list[list[tuple[int, int]]]]:
    """Where each slot lies in the send buffer, and the buckets (slots, calls) in the order they start (pure).

    ``order`` lists the slots in the order their gradients are expected;
    a bucket closes before the slot that would take it over ``chunk``
    values, and a call never exceeds ``chunk`` values.
    """
    chunk = max(1, chunk)
    offset = [0] * len(sizes)
    slots: list[list[int]] = []
    calls: list[list[tuple[int, int]]] = []
    filled = chunk  # no open bucket
    at = 0
    for s in order:
        n = sizes[s]
        offset[s] = at
        if filled + n > chunk:
            slots.append([])
            calls.append([])
            filled = 0
        slots[-1].append(s)
        filled += n
        at += n
    total = at
    for k, members in enumerate(slots):
        lo = offset[members[0]]
        hi = offset[members[-1]] + sizes[members[-1]]
        calls[k] = [(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)] if hi > lo else []
    assert at == total
    return offset, slots, calls


class Buckets:
    """The reduction buckets of one session: send and receive buffers, and the window's requests.

    ``comm`` is the buckets' own communicator (a duplicate); ``watched`` is
    the session's, whose watchdog sees :meth:`wait` and :meth:`redo`.
    """

    def __init__(self, comm: Communicator, watched: Communicator, sizes: Sequence[int], order: Sequence[int], chunk: int) -> None:
        self.comm = comm
        self.watched = watched
        offset, self._slots, self._calls = layout(sizes, order, chunk)
        total = sum(sizes)
        self.send = np.zeros(total, np.float32)
        self.recv = np.zeros(total, np.float32)
        #: per slot, its part of the send buffer (what this rank contributes) and of the receive buffer (the sum)
        self.views = [self.send[o : o + n] for o, n in zip(offset, sizes)]
        self.sums = [self.recv[o : o + n] for o, n in zip(offset, sizes)]
        self._bucket = [0] * len(sizes)
        for k, members in enumerate(self._slots):
            for s in members:
                self._bucket[s] = k
        self._requests: list[Any] = []
        self.reset()

    def __len__(self) -> int:
        return len(self._slots)

    def reset(self) -> None:
        """Start a new window: no slot ready, no bucket started (none may be in flight)."""
        self._ready = bytearray(len(self._bucket))
        self._left = [len(m) for m in self._slots]
        self._next = 0
        #: a slot was made ready twice in this window (a second backward while its bucket could be in flight)
        self.stale = False

    @property
    def started(self) -> int:
        """Buckets started in this window."""
        return self._next

    def ready(self, slot: int) -> None:
        """Slot ``slot``'s send part is filled: start every bucket now complete, in order, and progress those in flight."""
        if self._ready[slot]:
            self.stale = True
            return
        self._ready[slot] = 1
        k = self._bucket[slot]
        self._left[k] -= 1
        if k == self._next and self._left[k] == 0:
            self._start_ready()
        if self._requests:
            self.comm.test(self._requests)

    def _start_ready(self) -> None:
        while self._next < len(self._slots) and self._left[self._next] == 0:
            self._start(self._next)

    def _start(self, k: int) -> None:
        for lo, hi in self._calls[k]:
            self._requests.append(self.comm.Iallreduce(self.send[lo:hi], self.recv[lo:hi], "reduce: Iallreduce"))
        self._next = k + 1

    def flush(self, fill: Callable[[int], None] | None) -> None:
        """Start every bucket not started yet; ``fill(slot)`` first fills each slot not ready (None: zeros)."""
        for k in range(self._next, len(self._slots)):
            for s in self._slots[k]:
                if not self._ready[s]:
                    if fill is None:
                        self.views[s][...] = 0
                    else:
                        fill(s)
                    self._ready[s] = 1
            self._left[k] = 0
            self._start(k)

    def wait(self, operation: str) -> None:
        """Finish every request in flight (watched by the session's watchdog)."""
        requests, self._requests = self._requests, []
        self.watched.wait(requests, operation)

    def drain(self, operation: str) -> None:
        """End the window whatever it held: start what is left with zeros, wait, reset (collective)."""
        self.flush(None)
        self.wait(operation)
        self.reset()

    def redo(self, zero: bool, operation: str) -> None:
        """Sum every bucket again with blocking calls, this rank's contribution zeroed if ``zero`` (collective).

        For windows in which a rank turned out to have weight 0: its
        gradients were already on their way, but count as zeros.
        """
        if zero:
            self.send[...] = 0
        for k in range(len(self._slots)):
            self._start(k)
        self.wait(operation)
