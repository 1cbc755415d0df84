"""Reduction buckets that start summing while backward runs (host float32; any adapter can use them).

A session's trainable slots are laid out, in an order every rank agreed on
(roughly the reverse of the forward, as gradients become ready), in one
float32 *send* buffer, cut into buckets of at most ``bucket`` values (a slot
larger than that is a bucket of its own), each summed in calls of at most
``chunk`` values. The
adapter fills a slot's part of the send buffer and calls :meth:`Buckets.ready`;
when every slot of the next bucket in line is ready, the bucket's
non-blocking Allreduce starts, into a separate *receive* buffer, so that the
caller's gradients are never written by the network. Buckets start strictly
in order, so every rank issues the same collectives in the same order,
however its backward went: :meth:`Buckets.flush` starts whatever is left
(slots the backward did not reach are filled then, with zeros where a rank
has no gradient; a window that raises sends them as they are and throws the
sums away). Progress needs no thread: every :meth:`ready` tests the oldest
requests in flight once (MPI progresses them inside the test, on the calling
thread, and returns at once) and hands queued calls to MPI, at most
:data:`DEPTH` at a time. :meth:`Buckets.finish` then sums what no rank had
handed to MPI with blocking calls, faster in MPICH.

With ``thread=True`` (the same on every rank: blocking and non-blocking
collectives do not match) a daemon *communication thread* sums the buckets
instead: :meth:`ready` only queues complete buckets and wakes it; it runs
each call as a blocking Allreduce (faster in MPICH than non-blocking ones)
and sleeps on a condition variable when nothing is queued, so it takes a
core only while it sums. Its first call of every window sums the weights
the ranks gave before backward (:meth:`Buckets.expect`); where every rank
gave one and none is 0, it also divides each chunk by their sum as soon as
the chunk is summed, so that the division is no longer left for after
backward. It needs ``MPI_THREAD_MULTIPLE``. An exception in it that MPI
raised ends the job (``fatal``, from the session: :func:`mpidp.guard.fatal`;
the other ranks could not finish the call); any other one is recorded in
:attr:`Buckets.failure` and the calling thread sums what the thread left,
blocking, so that the window's collectives still match.

Neither mode sums the last bucket during backward, the *tail*: what
backward finishes last is summed after it anyway, and the out-of-place
calls (the caller's gradients are never written before the window is
agreed) cost MPICH an extra copy. Once the window is agreed, :meth:`Buckets.finish_tail`
sums the tail in place, where the adapter's gradients lie, and divides it
(:attr:`Buckets.fixed` marks its slots). :data:`TAPER` keeps it small where
the first layers are small.

The buckets use a communicator of their own, so the window's agreement (on
the session's communicator) may run while they are in flight. Every window
starts every bucket exactly once, on every rank, whatever happens: a window
that raises, and ``close``, flush and wait first.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .comm import Communicator
from .errors import CollectiveError

__all__ = ["DEPTH", "TAPER", "Buckets", "layout"]

#: Non-blocking calls in flight at once. MPICH 5.0.2 (PyPI wheel, shared memory, 2 ranks) sums 120 MB
#: in 1 MiB Iallreduce calls 2-3x slower with every call started at once than with 1-2 in flight
#: (docs/performance.md, "Overlap with backward"; its blocking Allreduce is faster still).
DEPTH = 2

#: what the communication thread's calls are called (the buckets' watchdog reports it)
THREAD_OPERATION = "reduce: Allreduce (communication thread)"
#: the thread's first call of every window, before the first bucket's: the weights known before backward
WEIGHTS = (-1, -1)


#: The last bucket holds at most ``bucket // TAPER`` values, each bucket before it at most twice the one
#: after it, up to ``bucket``: what backward finishes last (the first layers) is summed after backward, so it
#: is kept small (``benchmarks/overlap_timeline.py``: with even buckets the last one held a fifth of the ResNet
#: stand-in's gradient). DDP tapers the other end (a small first bucket), so that the first call starts early.
TAPER = 16


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
    """The reduction buckets of one session: send and receive buffers, and the window's requests.

    ``comm`` is the buckets' own communicator (a duplicate); ``watched`` is
    the session's, whose watchdog sees :meth:`wait` and :meth:`redo`.
    ``thread``: a communication thread sums the buckets (module docstring;
    the caller watches ``comm``'s blocking calls and calls :meth:`close`);
    ``fatal(error)`` ends the job when MPI fails inside it.
    """

    def __init__(
        self, comm: Communicator, watched: Communicator, sizes: Sequence[int], order: Sequence[int], bucket: int, chunk: int,
        thread: bool = False, fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.comm = comm
        self.threaded = thread
        #: what ends the job when MPI fails inside the thread (:func:`mpidp.guard.fatal`, given by the session)
        self._fatal = fatal
        #: guards the queue, :attr:`failure` and the thread's state; the thread waits on it for work
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False  # the thread is in a call (still at the head of the queue)
        self._called = False  # ... and MPI has finished that call (what an exception after it must not repeat)
        self._stop = False
        #: what the communication thread raised (not MPI: the calls could still finish), until taken
        self.failure: str | None = None
        #: this rank's weight for the coming window, if known before its backward (:meth:`expect`)
        self.expected: int | None = None
        #: the global weight the thread divided this window's sums by (None: not divided), until the next window
        self.divided: int | None = None
        self._weights = np.zeros(3, np.int64)  # this rank's (weight, weight == 0, weight unknown); their sums
        self._global = np.zeros(3, np.int64)
        self.watched = watched
        offset, self._slots, self._calls = layout(sizes, order, bucket, chunk)
        total = sum(sizes)
        self.send = np.zeros(total, np.float32)
        self.recv = np.zeros(total, np.float32)
        #: the last bucket is the *tail*, summed after the agreement, in place (module docstring)
        self._tail = max(0, len(self._slots) - 1)
        #: where the tail's slots always live (its gradients are summed and divided there), and where the tail starts
        self._home = self.send
        self._split = sum(sizes[s] for k in range(self._tail) for s in self._slots[k])
        #: per slot, whether it is in the tail: after a successful window its sum, divided, is in its send part
        self.fixed = [False] * len(sizes)
        for k in range(self._tail, len(self._slots)):
            for s in self._slots[k]:
                self.fixed[s] = True
        #: per slot, its part of the send buffer (what this rank contributes) and of the receive buffer (the sum);
        #: one and the same view for a slot of the tail
        self.views = [self.send[o : o + n] for o, n in zip(offset, sizes)]
        self.sums = [v if fixed else self.recv[o : o + n] for v, o, n, fixed in zip(self.views, offset, sizes, self.fixed)]
        self._bucket = [0] * len(sizes)
        for k, members in enumerate(self._slots):
            for s in members:
                self._bucket[s] = k
        #: calls of started buckets not yet handed to MPI, and the requests in flight (at most ``depth``), oldest first
        self._pending: deque[tuple[int, int]] = deque()
        self._flight: deque[Any] = deque()
        self.depth = DEPTH
        self.reset()

    def __len__(self) -> int:
        return len(self._slots)

    def reset(self) -> None:
        """Start a new window: no slot ready, no bucket started (none may be in flight)."""
        self._ready = bytearray(len(self._bucket))
        self._left = [len(m) for m in self._slots]
        self._next = 0
        #: calls handed to MPI (started non-blocking) in this window
        self._handed = 0
        #: a slot was made ready twice in this window (a second backward while its bucket could be in flight)
        self.stale = False

    @property
    def handed(self) -> int:
        """Calls handed to MPI in this window (local)."""
        return self._handed

    @property
    def started(self) -> int:
        """Buckets started (queued or summing) in this window."""
        return self._next

    def ready(self, slot: int) -> None:
        """Slot ``slot``'s send part is filled: queue every bucket now complete, in order, and progress the calls."""
        if self._ready[slot]:
            self.stale = True
            return
        self._ready[slot] = 1
        k = self._bucket[slot]
        self._left[k] -= 1
        if k == self._next and self._left[k] == 0:
            while self._next < len(self._slots) and self._left[self._next] == 0:
                self._queue(self._next)
        self.progress()

    def _queue(self, k: int) -> None:
        if not self.threaded:
            if k < self._tail:
                self._pending.extend(self._calls[k])
            self._next = k + 1
            return
        with self._cond:
            if k == 0:  # a window starts: its first call sums the weights known before backward (every rank, every window)
                self.divided = None
                self._pending.append(WEIGHTS)
            if k < self._tail:
                self._pending.extend(self._calls[k])
            self._next = k + 1
            if self._thread is None and self.failure is None:
                self._thread = threading.Thread(target=self._serve, name="mpidp-communication", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _serve(self) -> None:
        """The communication thread: sum queued calls in order with blocking Allreduce, sleep when none is queued."""
        cond, pending = self._cond, self._pending
        while True:
            with cond:
                while not pending and not self._stop:
                    cond.wait()
                if not pending:
                    self._thread = None
                    return
                lo, hi = pending[0]
                self._busy = True
                self._called = False
                cond.notify_all()  # for handoff()
            try:
                self._run(lo, hi, THREAD_OPERATION)
            except CollectiveError as e:  # MPI failed inside the call: the other ranks cannot finish it
                if self._fatal is not None:
                    self._fatal(e)
                raise
            except BaseException as e:  # noqa: BLE001 - this rank's error at the next reduce; the caller sums the rest
                sys.stderr.write(f"mpidp: the communication thread failed on rank {self.comm.rank}; the next reduce raises:\n")
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
                with cond:
                    self.failure = f"the communication thread failed: {type(e).__name__}: {e}"
                    if self._called:  # MPI had it: the caller must not call it again (its division is lost, as is the window)
                        pending.popleft()
                    self._busy = False
                    self._thread = None
                    cond.notify_all()
                return
            with cond:
                pending.popleft()
                self._handed += 1
                self._busy = False
                cond.notify_all()

    def _run(self, lo: int, hi: int, operation: str) -> None:
        """One blocking call of the thread's queue: the weights (:data:`WEIGHTS`) or a chunk, divided if the weights allow."""
        if lo < 0:
            w, self.expected = self.expected, None
            self._weights[:] = (w or 0, w == 0, w is None)
            self.comm.Allreduce_into(self._weights, self._global, operation)
            self._called = True
            total, zeros, unknown = (int(v) for v in self._global)
            # every rank knew its weight and none is 0 (a rank of weight 0 counts as zeros: not this sum)
            self.divided = total if total > 0 and not zeros and not unknown else None
            return
        self.comm.Allreduce_into(self.send[lo:hi], self.recv[lo:hi], operation)
        self._called = True
        if self.divided is not None:  # as the adapters divide after the sums: float32 by float32, the same bits
            np.divide(self.recv[lo:hi], np.float32(self.divided), out=self.recv[lo:hi])

    def expect(self, weight: int) -> None:
        """This rank's weight for the window whose first bucket is not queued yet (threaded: the thread then divides).

        Every rank's weight known and none 0: the thread sums the weights
        first and divides each chunk by their sum right after summing it
        (:attr:`divided`). Local; a weight given too late (the window's first
        bucket already queued) waits for the next window.
        """
        self.expected = int(weight)

    def swap(self) -> None:
        """Exchange the send and receive buffers (local; between windows): the adapter keeps the divided sums as gradients.

        The tail stays where it is (its view is both a send and a receive view).
        """
        self.send, self.recv = self.recv, self.send
        self.views, self.sums = self.sums, self.views

    def zero(self) -> None:
        """Zero what this rank contributes: the send buffer before the tail, and the tail (local)."""
        self.send[: self._split] = 0
        self._home[self._split :] = 0

    def finish_tail(self, weight: int, operation: str) -> None:
        """Sum the tail in place, chunk by chunk, and divide each chunk by ``weight`` (collective; after a successful agreement).

        Blocking Allreduce calls on the session's communicator; a division
        by ``float32(weight)`` right after each call, as the plain path's.
        """
        home, w = self._home, np.float32(weight)
        for calls in self._calls[self._tail :]:
            for lo, hi in calls:
                self.watched.Allreduce(home[lo:hi], operation)
                np.divide(home[lo:hi], w, out=home[lo:hi])

    def handoff(self) -> None:
        """Sleep until the communication thread has begun every queued call (local; nothing without a thread).

        The calling thread then holds the GIL without delaying the thread's
        last call: that call runs in MPI, which releases the GIL.
        """
        if not self.threaded:
            return
        cond, pending = self._cond, self._pending
        with cond:
            while self._thread is not None and (len(pending) > 1 or (pending and not self._busy)):
                cond.wait()

    def _join(self, operation: str) -> None:
        """Wait until the thread has summed every queued call; sum what a failed thread left, here (blocking)."""
        cond, pending = self._cond, self._pending
        with cond:
            while (pending or self._busy) and self._thread is not None:
                cond.wait()
            left = list(pending)
            pending.clear()
        for lo, hi in left:  # the thread failed before MPI had these: the other ranks' calls still match
            self._run(lo, hi, operation)

    def take_failure(self) -> str | None:
        """What the thread raised since the last call, cleared: the thread starts again with the next bucket (local)."""
        with self._cond:
            failure, self.failure = self.failure, None
        return failure

    def close(self) -> None:
        """Stop and join the communication thread, if any (local; after the last window is finished)."""
        with self._cond:
            self._stop = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def progress(self) -> None:
        """Test the oldest calls in flight once each, and start queued calls in their place (local, never waits)."""
        if self.threaded:
            return
        flight = self._flight
        while flight and self.comm.done(flight[0]):
            flight.popleft()
        self._fill_flight()

    def _fill_flight(self) -> None:
        while self._pending and len(self._flight) < self.depth:
            self._start(*self._pending.popleft())

    def _start(self, lo: int, hi: int) -> None:
        self._flight.append(self.comm.Iallreduce(self.send[lo:hi], self.recv[lo:hi], "reduce: Iallreduce"))
        self._handed += 1

    def flush(self, fill: Callable[[int], None] | None) -> None:
        """Queue every bucket not started yet; ``fill(slot)`` first fills each slot not ready (None: as it is)."""
        for k in range(self._next, len(self._slots)):
            for s in self._slots[k]:
                if not self._ready[s] and fill is not None:
                    fill(s)
                self._ready[s] = 1
            self._left[k] = 0
            self._queue(k)

    def wait(self, operation: str) -> None:
        """Hand every queued call to MPI, ``depth`` at a time, and finish them (watched by the session's watchdog).

        Threaded: wait until the thread has summed them.
        """
        if self.threaded:
            self._join(operation)
            return
        self._fill_flight()
        flight = self._flight
        while flight:
            self.watched.wait([flight.popleft()], operation)
            self._fill_flight()

    def finish(self, handed: int, operation: str) -> None:
        """Finish the window's calls: non-blocking up to call ``handed``, blocking after it (collective; after :meth:`flush`).

        ``handed`` is the most calls any rank handed to MPI during backward
        (:attr:`handed`, agreed): every rank starts that many non-blocking,
        as collectives must match, and sums the rest with blocking Allreduce
        calls on the session's communicator, which MPICH runs faster than
        non-blocking ones (:data:`DEPTH`). Threaded: ``handed`` is not
        needed; the thread sums every call.
        """
        if self.threaded:
            self._join(operation)
            return
        pending = self._pending
        while self._handed < handed:
            self._start(*pending.popleft())
        self._pending = deque()
        self.wait(operation)
        for lo, hi in pending:
            self.watched.Allreduce_into(self.send[lo:hi], self.recv[lo:hi], operation)

    def drain(self, operation: str) -> None:
        """End the window whatever it held: start what is left as it is, wait, reset (collective).

        The sums are thrown away, and nothing of the send buffer is written
        (an adapter's gradients may live there).
        """
        self.flush(None)
        self.wait(operation)
        self.reset()

    def redo(self, zero: bool, weight: int, operation: str) -> None:
        """Sum every bucket again with blocking calls, this rank's contribution zeroed if ``zero`` (collective).

        For windows in which a rank turned out to have weight 0: its
        gradients were already on their way, but count as zeros. The sums
        are left undivided (:attr:`divided` None), but for the tail's, which
        :meth:`finish_tail` divides by ``weight``.
        """
        if zero:
            self.zero()
        self.divided = None
        for calls in self._calls[: self._tail]:
            for lo, hi in calls:
                self.watched.Allreduce_into(self.send[lo:hi], self.recv[lo:hi], operation)
        self.finish_tail(weight, operation)
