"""Who sums an overlapped window's bucket calls: one interface, one implementation per mode, chosen once.

:class:`NonBlocking` (``overlap="hooks"``): every :meth:`~Progress.poll`
(the gradient hooks call it) tests the oldest requests in flight once (MPI
progresses them inside the test, on the calling thread, and returns at once)
and hands queued calls to MPI as non-blocking Iallreduce, at most
:data:`DEPTH` at a time. After the window's agreement
:meth:`~Progress.finish` starts as many as any rank handed to MPI (they must
match) and sums the rest with blocking calls, faster in MPICH.

:class:`CommThread` (``overlap="thread"``): a daemon *communication thread*
runs each queued call as a blocking Allreduce (faster in MPICH than
non-blocking ones) and sleeps on a condition variable when nothing is
queued, so it takes a core only while it sums. Calls queued with a divisor
(the global weight, agreed before backward) are divided right after they are
summed. :meth:`~Progress.settle` waits, before the window's agreement, until
every call is summed: the other order (exchange while the last buckets sum)
had both threads of a rank spinning in MPI at once, and the agreement's
polling took the core the last bucket needed (``benchmarks/overlap_timeline.py``).
It needs ``MPI_THREAD_MULTIPLE``. An exception in it that MPI raised ends
the job (``fatal``: the other ranks could not finish the call); any other one
is this rank's error at the agreement (:meth:`~Progress.settle` returns it),
and the calling thread sums what the thread left, so that the collectives
still match.

A bucket of the exact reduction is a :class:`Job` instead of calls (its
ranks agree on its scales, then sum integers): the thread runs it with
blocking calls like a call; the hooks never hand it to MPI, it runs with
blocking calls in order once the window is finished or drained.

Both run the calls on a communicator of their own (the window's agreement
on the session's communicator may run while they are in flight); what the
caller waits in is watched on ``watched``, the session's.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveError
from .buckets import Call, divide

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["DEPTH", "CommThread", "Job", "NonBlocking", "Progress"]

#: Non-blocking calls in flight at once. MPICH 5.0.2 (PyPI wheel, shared memory, 2 ranks) sums 120 MB
#: in 1 MiB Iallreduce calls 2-3x slower with every call started at once than with 1-2 in flight
#: (docs/performance.md, "Overlap with backward"; its blocking Allreduce is faster still).
DEPTH = 2

#: what the communication thread's calls are called (the buckets' watchdog reports it)
THREAD_OPERATION = "reduce: Allreduce (communication thread)"


class Job:
    """A bucket's work of more than one call, in order, with blocking calls (:mod:`mpidp.overlap.exact_jobs`).

    :meth:`run` may be called again after it raised (not an MPI error): it
    goes on from the first call it had not made, so that every rank makes
    each call once.
    """

    def run(self, comm: Communicator, operation: str) -> None:
        raise NotImplementedError


#: what an engine is queued: a bucket's calls, or its job
Work = Call | Job


class Progress:
    """The progress-engine interface: queue calls, poll, settle before the agreement, finish after it, close."""

    #: the overlap mode this engine serves ("hooks" or "thread")
    mode = ""

    def __init__(self, comm: Communicator, watched: Communicator) -> None:
        self.comm = comm
        self.watched = watched
        #: calls handed to MPI as non-blocking in this window (what every rank must start alike)
        self.handed = 0
        #: the divisor applied to this window's sums as they came (None: left to the owner)
        self.divided: int | None = None

    def queue(self, calls: Sequence[Work], divisor: int | None) -> None:
        """Queue one bucket's calls (or its job), in order (local); ``divisor``: the agreed global weight, if the engine may divide."""
        raise NotImplementedError

    def poll(self) -> None:
        """Make progress without waiting (local; called by every gradient hook)."""

    def handoff(self) -> None:
        """Let the engine begin what is queued before the caller's own work (local)."""

    def settle(self, operation: str) -> str | None:
        """Finish what may be finished before the window's agreement; return this rank's error, if any."""
        return None

    def quiet(self) -> None:
        """Wait until nothing queued runs on its own any more (local; failures are left for :meth:`settle`)."""

    def finish(self, handed: int, operation: str) -> None:
        """Finish every queued call after a successful agreement; ``handed`` is the most any rank handed to MPI."""

    def hand(self) -> None:
        """Hand every queued call to MPI now, without waiting (local; another operation interrupts the window)."""

    def drain(self, operation: str) -> None:
        """Finish every queued call of a refused window, sums thrown away (every rank queued the same)."""

    def reset(self) -> None:
        """Start a new window (nothing in flight)."""
        self.handed = 0
        self.divided = None

    def close(self) -> None:
        """Stop whatever runs on its own (local; after the last window is finished)."""


class NonBlocking(Progress):
    """``overlap="hooks"``: non-blocking calls handed to MPI from the hooks, at most :data:`DEPTH` at once."""

    mode = "hooks"

    def __init__(self, comm: Communicator, watched: Communicator) -> None:
        super().__init__(comm, watched)
        self._pending: deque[Work] = deque()
        self._flight: deque[Any] = deque()
        self.depth = DEPTH

    def queue(self, calls: Sequence[Work], divisor: int | None) -> None:
        self._pending.extend(calls)

    def poll(self) -> None:
        """Test the oldest calls in flight once each, and start queued calls in their place (never waits)."""
        flight = self._flight
        while flight and self.comm.done(flight[0]):
            flight.popleft()
        self._fill()

    def _fill(self, limit: int | None = None) -> None:
        """Hand queued calls to MPI, up to :attr:`depth` in flight (``limit``: up to that many in all); never a job."""
        while self._pending and not isinstance(self._pending[0], Job):
            if (len(self._flight) >= self.depth) if limit is None else (self.handed >= limit):
                return
            send, recv = self._pending.popleft()  # type: ignore[misc]
            self._flight.append(self.comm.Iallreduce(send, recv, "reduce: Iallreduce"))
            self.handed += 1

    def _wait(self, operation: str) -> None:
        """Finish everything queued, in order: calls handed as they fit, a job with blocking calls when it is next.

        Jobs run on the engine's own communicator: a refused window is
        drained there, and the session's may be closed by then.
        """
        while True:
            self._fill()
            if self._flight:
                self.watched.wait([self._flight.popleft()], operation)
            elif self._pending:  # a job
                self._pending.popleft().run(self.comm, operation)  # type: ignore[union-attr]
            else:
                return

    def finish(self, handed: int, operation: str) -> None:
        """Start non-blocking up to call ``handed`` (as every rank does), then the rest with blocking calls."""
        self._fill(limit=handed)
        pending, self._pending = self._pending, deque()
        self._wait(operation)
        for work in pending:  # after the agreement, on the session's communicator: watched
            if isinstance(work, Job):
                work.run(self.watched, operation)
            else:
                self.watched.Allreduce_into(*work, operation)

    def hand(self) -> None:
        self._fill(limit=1 << 62)

    def drain(self, operation: str) -> None:
        self._wait(operation)


class CommThread(Progress):
    """``overlap="thread"``: a communication thread sums queued calls with blocking Allreduce."""

    mode = "thread"

    def __init__(self, comm: Communicator, watched: Communicator, fatal: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(comm, watched)
        #: what ends the job when MPI fails inside the thread (:func:`mpidp.guard.fatal`, given by the owner)
        self._fatal = fatal
        #: guards the queue, :attr:`failure` and the thread's state; the thread waits on it for work
        self._cond = threading.Condition()
        self._pending: deque[tuple[Work, int | None]] = deque()
        self._thread: threading.Thread | None = None
        self._busy = False  # the thread is in a call (still at the head of the queue)
        self._called = False  # ... and MPI has finished that call (what an exception after it must not repeat)
        self._stop = False
        #: what the thread raised (not MPI: the calls could still finish), until taken
        self.failure: str | None = None

    def queue(self, calls: Sequence[Work], divisor: int | None) -> None:
        with self._cond:
            self.divided = divisor
            self._pending.extend((work, divisor) for work in calls)
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
                call = pending[0]
                self._busy, self._called = True, False
                cond.notify_all()  # for handoff()
            try:
                self._run(call, THREAD_OPERATION)
            except CollectiveError as e:  # MPI failed inside the call: the other ranks cannot finish it
                if self._fatal is not None:
                    self._fatal(e)
                raise
            except BaseException as e:  # noqa: BLE001 - this rank's error at the next agreement; the caller sums the rest
                self._failed(e)
                return
            with cond:
                pending.popleft()
                self._busy = False
                cond.notify_all()

    def _failed(self, e: BaseException) -> None:
        sys.stderr.write(f"mpidp: the communication thread failed on rank {self.comm.rank}; the next reduce raises:\n")
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        with self._cond:
            self.failure = f"the communication thread failed: {type(e).__name__}: {e}"
            if self._called:  # MPI had it: the caller must not call it again (its division is lost, as is the window)
                self._pending.popleft()
            self._busy = False
            self._thread = None
            self._cond.notify_all()

    def _run(self, call: tuple[Work, int | None], operation: str) -> None:
        """One blocking call, divided right after it where the window's divisor is known; or a job (resumable)."""
        work, divisor = call
        if isinstance(work, Job):
            work.run(self.comm, operation)
            return
        send, recv = work
        self.comm.Allreduce_into(send, recv, operation)
        self._called = True
        if divisor is not None:
            divide(recv, divisor)

    def handoff(self) -> None:
        """Sleep until the thread has begun every queued call: its last call then runs in MPI, which releases the GIL."""
        cond, pending = self._cond, self._pending
        with cond:
            while self._thread is not None and (len(pending) > 1 or (pending and not self._busy)):
                cond.wait()

    def quiet(self) -> None:
        """Wait until the thread has run every queued call or job, or stopped (it reads the send buffer and the folds)."""
        with self._cond:
            while (self._pending or self._busy) and self._thread is not None:
                self._cond.wait()

    def settle(self, operation: str) -> str | None:
        """Wait until the thread has summed every queued call; sum what a failed thread left, here; its failure."""
        cond, pending = self._cond, self._pending
        with cond:
            while (pending or self._busy) and self._thread is not None:
                cond.wait()
            left = list(pending)
            pending.clear()
            failure, self.failure = self.failure, None
        for call in left:  # the thread failed before MPI had these: the other ranks' calls still match
            self._run(call, operation)
        return failure

    def drain(self, operation: str) -> None:
        self.settle(operation)

    def close(self) -> None:
        """Stop and join the communication thread, if any."""
        with self._cond:
            self._stop = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()
