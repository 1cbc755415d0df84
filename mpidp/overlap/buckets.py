"""Pure bucket state of an overlapped window: layout, ready marks, send/receive/tail views (no MPI, no threads).

A session's trainable slots are laid out, in an order every rank agreed on
(roughly the reverse of the forward, as gradients become ready), in one
float32 *send* buffer, cut into buckets of at most ``bucket`` values (a slot
larger than that is a bucket of its own), each summed in calls of at most
``chunk`` values, from the send buffer into a *receive* buffer of the same
layout, so that the caller's gradients are never written by the network.
The last bucket is the *tail*: what backward finishes last is summed after
the window's agreement, in place in the send buffer, where the adapter's
gradients lie (:attr:`Buckets.fixed` marks its slots). :data:`TAPER` keeps
it small where the first layers are small.

Two buffers take turns as send and receive (:meth:`Buckets.swap`); the tail
always lives in the first. :class:`mpidp.overlap.owner.Overlapped` owns one
:class:`Buckets` and is the only user of its members.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import casts

__all__ = ["TAPER", "Buckets", "divide", "layout"]

#: The last bucket holds at most ``bucket // TAPER`` values, each bucket before it at most twice the one
#: after it, up to ``bucket``: what backward finishes last (the first layers) is summed after backward, so it
#: is kept small (``benchmarks/overlap_timeline.py``: with even buckets the last one held a fifth of the ResNet
#: stand-in's gradient). DDP tapers the other end (a small first bucket), so that the first call starts early.
TAPER = 16

#: one call of a bucket: (this rank's values, where their sum over the ranks goes)
Call = tuple[np.ndarray, np.ndarray]


def divide(values: np.ndarray, weight: int, out: np.ndarray | None = None) -> None:
    """Divide summed float32 ``values`` by the global ``weight`` into ``out`` (default: in place), as the plain path does.

    The overlapped window's only division by the global weight, through the
    session's one (:func:`mpidp.casts.divide`): the plain path's bits.
    """
    casts.divide(values, weight, values if out is None else out)


def layout(
    sizes: Sequence[int], order: Sequence[int], bucket: int, chunk: int, taper: int = TAPER
) -> tuple[list[int], list[list[int]], list[list[tuple[int, int]]]]:
    """Where each slot lies in the send buffer, and the buckets (slots, calls) in the order they start (pure).

    ``order`` lists the slots in the order their gradients are expected.
    Buckets are cut from the end of ``order``: the last one closes before
    the slot that would take it over ``bucket // taper`` values, each one
    before it over twice the one after it, up to ``bucket`` (a slot larger
    than that is a bucket of its own). A call never exceeds ``chunk`` values.
    """
    bucket, chunk = max(1, bucket), max(1, chunk)
    cap = max(1, bucket // max(1, taper))
    groups: list[list[int]] = []  # from the last bucket back
    filled = cap  # no open bucket
    for s in reversed(order):
        n = sizes[s]
        if filled + n > cap or not groups:
            if groups:
                cap = min(bucket, 2 * cap)
            groups.append([])
            filled = 0
        groups[-1].append(s)
        filled += n
    slots = [members[::-1] for members in reversed(groups)]
    offset = [0] * len(sizes)
    at = 0
    for members in slots:
        for s in members:
            offset[s] = at
            at += sizes[s]
    calls: list[list[tuple[int, int]]] = []
    for members in slots:
        lo = offset[members[0]]
        hi = offset[members[-1]] + sizes[members[-1]]
        calls.append([(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)] if hi > lo else [])
    return offset, slots, calls


class Buckets:
    """The buffers, views and ready marks of one session's buckets (pure; one window at a time)."""

    def __init__(self, sizes: Sequence[int], order: Sequence[int], bucket: int, chunk: int, taper: int = TAPER) -> None:
        offset, self._slots, self._calls = layout(sizes, order, bucket, chunk, taper)
        #: per slot, where it lies in either buffer; per bucket, its slots in that order
        self.offset, self.members = offset, self._slots
        total = sum(sizes)
        self._buffers = (np.zeros(total, np.float32), np.zeros(total, np.float32))
        #: which buffer is the send buffer now (0 or 1); the tail always lives in buffer 0
        self.side = 0
        #: index of the tail (the last bucket); every bucket before it is summed before the agreement
        self.tail = max(0, len(self._slots) - 1)
        self._split = sum(sizes[s] for k in range(self.tail) for s in self._slots[k])
        #: per slot, whether it is in the tail (summed and divided in place, in buffer 0)
        self.fixed = [False] * len(sizes)
        for k in range(self.tail, len(self._slots)):
            for s in self._slots[k]:
                self.fixed[s] = True
        home = [self._buffers[0][o : o + n] for o, n in zip(offset, sizes)]
        other = [v if fixed else self._buffers[1][o : o + n] for v, o, n, fixed in zip(home, offset, sizes, self.fixed)]
        #: per buffer, each slot's view (a tail slot's is the same array in both)
        self.slot_views = (home, other)
        self._bucket = [0] * len(sizes)
        for k, members in enumerate(self._slots):
            for s in members:
                self._bucket[s] = k
        self.reset()

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def send(self) -> np.ndarray:
        return self._buffers[self.side]

    @property
    def recv(self) -> np.ndarray:
        return self._buffers[1 - self.side]

    def reset(self) -> None:
        """Start a new window: no slot ready, no bucket complete."""
        self._ready = bytearray(len(self._bucket))
        self._left = [len(m) for m in self._slots]
        #: buckets complete, in order: every slot of buckets ``[0, complete)`` is ready
        self.complete = 0
        #: slots made ready more than once in this window (their buckets may have left with older values)
        self.again: set[int] = set()

    @property
    def touched(self) -> bool:
        """Whether a slot is ready in this window."""
        return any(self._ready)

    def ready(self, slot: int) -> None:
        """Mark ``slot`` ready; a slot marked twice is remembered in :attr:`again`."""
        if self._ready[slot]:
            self.again.add(slot)
            return
        self._ready[slot] = 1
        k = self._bucket[slot]
        self._left[k] -= 1
        while self.complete < len(self._slots) and self._left[self.complete] == 0:
            self.complete += 1

    def unready(self) -> list[int]:
        """The slots not marked ready in this window, in bucket order."""
        return [s for members in self._slots[self.complete :] for s in members if not self._ready[s]]

    def rest(self) -> None:
        """Mark every slot ready: every bucket is complete (what backward did not reach is sent as it is)."""
        for s in range(len(self._ready)):
            self._ready[s] = 1
        self._left = [0] * len(self._slots)
        self.complete = len(self._slots)

    def calls(self, k: int) -> list[Call]:
        """Bucket ``k``'s calls as (send, receive) views of the current buffers."""
        send, recv = self.send, self.recv
        return [(send[lo:hi], recv[lo:hi]) for lo, hi in self._calls[k]]

    def tail_views(self) -> list[np.ndarray]:
        """The tail's calls as views of buffer 0, each summed and divided in place."""
        home = self._buffers[0]
        return [home[lo:hi] for calls in self._calls[self.tail :] for lo, hi in calls]

    def head(self) -> tuple[np.ndarray, np.ndarray]:
        """Every bucket before the tail, as one (send, receive) pair of views."""
        return self.send[: self._split], self.recv[: self._split]

    def swap(self) -> None:
        """Exchange the send and receive buffers (between windows); the tail stays where it is."""
        self.side = 1 - self.side

    def zero(self) -> None:
        """Zero what this rank contributes: the send buffer before the tail, and the tail."""
        self.send[: self._split] = 0
        self._buffers[0][self._split :] = 0
