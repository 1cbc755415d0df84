"""The owner of an overlapped window: bucket order, communicator, progress engine, and the window's steps.

An adapter (:mod:`mpidp.torch.overlap`) fills a slot's part of the send
buffer as backward finishes its gradient and calls :meth:`Overlapped.ready`:
complete buckets are handed, strictly in order, to the progress engine
(:mod:`mpidp.overlap.progress`, chosen once at creation), so that every rank issues
the same calls in the same order however its backward went. Before the
window's first bucket call the ranks exchange one small record
(:class:`mpidp.records.Open`, with the weights given before backward): a
rank in another mpidp operation meets it in its own exchange, so the others
raise the same ContractError instead of waiting for its part of a bucket.
:meth:`Overlapped.reduce` then reads in one order: flush what backward left,
check locally, finish what may be finished before the agreement, agree once,
sum the tail in place, and leave ``sum / global_weight`` in the send views.

In an exact session (``exact=True``) a bucket is a job of
:mod:`mpidp.overlap.exact_jobs` instead of float32 calls, the last bucket too:
its ranks agree on its scales and sum integers before the window's
agreement; afterwards the sums are converted into the send views, or the
window is reduced again on the plain exact path where they cannot stand.

A slot finished twice in a window (a parameter used twice under reentrant
checkpointing, a second backward outside ``no_sync``) and a gradient the
adapter reports changed after its hook are summed again after backward:
the window's record carries a mark, so every rank sums every bucket again
with blocking calls whenever one rank asks, and the results are the plain
path's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import comm as _mpi
from .. import guard, records
from ..core import DataParallel
from ..errors import CollectiveError, ContractError
from .buckets import Buckets, divide
from .exact_jobs import ExactBuckets
from .progress import CommThread, NonBlocking, Progress, Work

__all__ = ["Outcome", "Overlapped", "Session"]

#: the session an owner serves (adapters name it through this room only)
Session = DataParallel

MODES = ("hooks", "thread", "auto")


class Outcome(NamedTuple):
    """What a successful overlapped window agreed on: the global weight and which slots are present."""

    global_weight: int
    present: list[bool]


class Overlapped:
    """One session's overlapped windows: the bucket state, the progress engine and the window's order (collective steps)."""

    def __init__(
        self, session: DataParallel, state: Buckets, engine: Progress, watchdog: guard.Watchdog | None, exact: ExactBuckets | None = None
    ) -> None:
        self.session = session
        self._state = state
        self._engine = engine
        self._watchdog = watchdog
        #: an exact session's bucket sums (None: float32 calls); every bucket, the last included, is then a job before the agreement
        self._exact = exact
        self._last = len(state) if exact is not None else state.tail
        self._expected: int | None = None
        self._closed = False
        #: the global weight the engine divided the last window's sums by as they came (None: divided after them)
        self.divided: int | None = None
        self._broken: CollectiveError | None = None
        self._refused: str | None = None  # what every rank learned at the open, raised by this rank's reduce
        self._divisor: int | None = None  # the global weight the engine may divide by (agreed at the open)
        self._reset()

    @classmethod
    def create(cls, session: DataParallel, order: Sequence[int], bucket_bytes: int, progress: str, threads: int) -> Overlapped | None:
        """Agree on root's bucket order and the progress mode, then make the buckets (collective).

        ``progress`` (the same on every rank): ``"hooks"``, ``"thread"`` or
        ``"auto"``: where every rank's node has a core free besides
        ``threads`` computing threads per rank, the thread (every rank has
        ``MPI_THREAD_MULTIPLE``) or else the hooks; where some rank has none,
        no overlap at all (None: the plain path, as nothing can run beside
        backward there and the hooks only slow it). Raises ContractError on
        every rank for a session on a device, ranks asking for different
        modes, or a thread MPI cannot serve.
        """
        facts = session.facts()
        comm = facts.comm
        free = _mpi.free_cores(comm, threads)  # collective: every rank, whatever it asks for
        mine = [[int(i) for i in order], progress, _mpi.thread_multiple(), free]
        rows = comm.allgather_obj(mine, "reduction_buckets: order and progress")
        thread = _choose(rows, facts.root, len(facts.sizes), facts.device, progress)
        if thread is None:
            return None
        own = _mpi.duplicate(comm.comm)
        state = Buckets(facts.sizes, rows[facts.root][0], bucket_bytes // 4, facts.chunk_bytes // 4)
        sums = None if facts.exact is None else ExactBuckets(facts.exact.acc, state.members, state.offset, facts.chunk_bytes // 8)
        if not thread:
            return cls(session, state, NonBlocking(own, comm), None, sums)
        engine = CommThread(own, comm, lambda e: guard.fatal(own.rank, "the communication thread's Allreduce", e))
        watchdog = None if facts.timeout is None else guard.Watchdog(own, facts.timeout)  # the thread's calls, watched
        return cls(session, state, engine, watchdog, sums)

    # ------------------------------------------------------------ accessors

    @property
    def mode(self) -> str:
        """The progress mode chosen at creation: ``"hooks"`` or ``"thread"`` (local)."""
        return self._engine.mode

    @property
    def side(self) -> int:
        """Which of the two buffers is the send buffer now (0 or 1; local)."""
        return self._state.side

    def views(self, side: int) -> list[np.ndarray]:
        """Buffer ``side``'s view of every slot (a tail slot's is the same array in both; local)."""
        return self._state.slot_views[side]

    def unready(self) -> list[int]:
        """The slots backward did not finish in this window: the adapter fills them before :meth:`reduce` (local)."""
        return self._state.unready()

    def began(self) -> bool:
        """Whether this rank's window has begun: a slot is ready (local)."""
        return self._state.touched

    def opened(self) -> bool:
        """Whether this rank's window is open: its open exchange is done, buckets may be in flight (local)."""
        return self._opened

    def owed(self) -> bool:
        """Whether ranks opened this window to close: this rank finishes its buckets before it agrees (local)."""
        return self._owed

    def started(self) -> tuple[int, int]:
        """(buckets complete, buckets) of this window (local)."""
        return self._state.complete, len(self._state)

    # ------------------------------------------------------------ backward

    def ready(self, slot: int) -> None:
        """Slot ``slot``'s send part is filled: hand every bucket now complete to the engine, in order (never raises MPI errors)."""
        self._state.ready(slot)
        self._advance()
        self._engine.poll()

    def expect(self, weight: int) -> None:
        """This rank's weight for the window whose first bucket is not queued yet (local; see DataParallel.expect_weight)."""
        self._expected = int(weight)

    def _advance(self) -> None:
        """Queue the complete buckets before the tail (exact: every one), opening the window before the first one."""
        while self._queued < min(self._state.complete, self._last) and self._refused is None:
            if not self._opened and self._open(closing=False) is None:
                return
            self._queue_next(self._divisor)

    def _queue_next(self, divisor: int | None) -> None:
        """Hand the next bucket to the engine: its calls, or (exact) its job."""
        k = self._queued
        work: Sequence[Work] = self._state.calls(k) if self._exact is None else [self._exact.job(k, self.views(self._state.side))]
        self._engine.queue(work, divisor if self._exact is None else None)
        self._queued += 1

    def _open(self, closing: bool) -> list[list[int]] | None:
        """Exchange the window's :class:`~mpidp.records.Open` record (collective on the session's communicator).

        Returns the rows, or None where the window is refused (this rank's
        next reduce raises what every rank learned) or MPI failed.
        """
        self._opened = True
        weight, self._expected = self._expected, None
        words = (0 if weight is None else weight + 1, int(closing))
        operation = f"reduce (window {self.session.window + 1}): open"
        try:
            rows: list[list[int]] = self.session.agree_record(records.OPEN, words, None, operation)
        except ContractError as e:
            self._refused = str(e)
            return None
        except CollectiveError as e:
            self._broken = e
            self._refused = str(e)
            return None
        closers = records.Open.closing(rows)
        if closers and not closing:  # ranks opened it to close: this rank finishes its buckets with them, then agrees
            self._refused = f"rank {closers[0]} opened this window to close the session"
            self._owed = True
            return None
        self._divisor = records.Open.divisor(rows)
        return rows

    # ------------------------------------------------------------ the window

    def reduce(
        self, grads: Mapping[str, Any], weight: Any, policy: Any, step: Any, error: str | None, changed: Mapping[int, np.ndarray | None]
    ) -> Outcome:
        """Flush, check locally, finish what is in flight, agree once, sum the tail in place, leave the results (collective).

        ``grads`` are this rank's gradients for the core's checks (nothing
        writes them); ``error`` the adapter's local error; ``changed`` the
        slots whose gradient changed after their hook, with the float32
        values to send (None: already in the send view). Afterwards each
        present slot's ``sum / global_weight`` is in its send view
        (``views(side)``). Raises ContractError on every rank alike, with
        every bucket finished and the sums thrown away; CollectiveError if MPI
        fails (the session is then broken).
        """
        operation = f"reduce (window {self.session.window + 1})"
        try:
            self._flush()  # queue what backward left (the window opens here if no bucket did)
            checked = self.session.check_window(grads, weight, policy, error, step=step)
            late = self._engine.settle(operation)  # the thread's calls all summed before the exchange
            agreed = self._agree(checked, late, bool(changed), operation)
            if self._exact is not None:
                self._exact_results(agreed, operation)
            else:
                self._results(agreed.global_weight, self._finish(agreed, changed, operation))
            return Outcome(agreed.global_weight, agreed.present(len(self._state.fixed)))
        except CollectiveError as e:
            self._broken = e
            self.session.fail(e)
            raise
        finally:
            self._reset()

    def handoff(self) -> None:
        """Let the engine begin what is queued before the caller's own work (local; the thread's last bucket)."""
        self._engine.handoff()

    def quiet(self) -> None:
        """Wait until no bucket is being read by the engine (local): before the folds or the send buffer change (``fold``)."""
        self._engine.quiet()

    def _flush(self) -> None:
        if self._closed:
            raise ContractError("this DataParallel is closed")
        if self._broken is not None:
            raise self._broken
        self._state.rest()
        self._advance()
        self._engine.handoff()

    def _agree(self, checked: Any, late: str | None, changed: bool, operation: str) -> Any:
        """The window's one agreement, its EXTRA word the calls handed to MPI and the redo mark (collective)."""
        if self._owed:  # ranks opened this window to close: finish its buckets with theirs, then meet their close
            self._drain(operation)
            return self.session.agree_window(checked, late, 0)
        if self._refused is not None:  # every rank learned it at the open: none exchanges again
            raise ContractError(self._refused)
        redo = changed or bool(self._state.again)
        try:
            return self.session.agree_window(checked, late, self._engine.handed << 1 | redo)
        except ContractError:
            self._drain(operation)
            raise

    def _finish(self, agreed: Any, changed: Mapping[int, np.ndarray | None], operation: str) -> bool:
        """Finish the calls, take changed gradients in, sum the tail (or everything again); whether it summed again."""
        self._engine.finish(max(w >> 1 for w in agreed.extra), f"{operation}: Iallreduce")
        send = self._state.slot_views[self._state.side]
        for slot, values in changed.items():
            if values is not None:
                send[slot][...] = values
        divided = self._engine.divided
        redo = agreed.zero_weight or any(w & 1 for w in agreed.extra) or (divided is not None and divided != agreed.global_weight)
        if redo:  # gradients that left during backward do not hold: sum every bucket again
            if agreed.weight == 0:
                self._state.zero()  # a rank of weight 0 counts as zeros
            for k in range(self._state.tail):
                for s, r in self._state.calls(k):
                    self._engine.watched.Allreduce_into(s, r, operation)
        for values in self._state.tail_views():
            self._engine.watched.Allreduce(values, operation)
            divide(values, agreed.global_weight)
        return redo

    def _exact_results(self, agreed: Any, operation: str) -> None:
        """Finish the jobs; convert their sums into the send views, or reduce again on the plain exact path (collective).

        Again where a rank had weight 0 or asked (a gradient changed after
        its bucket left) or a bucket's facts are not the window's: every
        rank decides on agreed facts alike.
        """
        sums = self._exact
        assert sums is not None
        self._engine.finish(max(w >> 1 for w in agreed.extra), f"{operation}: exact buckets")
        self.divided = None
        views = self.views(self._state.side)
        present = agreed.present(len(views))
        redo = agreed.zero_weight or any(w & 1 for w in agreed.extra)
        if redo or not sums.results(agreed.exact, agreed.global_weight, present, views):
            self.session.reduce_exact(agreed, [v if here else None for v, here in zip(views, present)], operation)
        else:
            sums.acc.clear()

    def _results(self, global_weight: int, redo: bool) -> None:
        """Leave every slot's ``sum / global_weight`` in its send view: the engine's own division, or one here."""
        self.divided = None if redo else self._engine.divided
        if self.divided is not None:
            self._state.swap()  # the sums, divided as they came, become the send buffer the adapter reads
            return
        send, recv = self._state.head()
        divide(recv, global_weight, out=send)

    def _drain(self, operation: str) -> None:
        """End a refused window: hand every bucket not queued yet as it is and finish them, sums thrown away (collective)."""
        self._state.rest()
        while self._queued < self._last:
            self._queue_next(None)
        self._engine.drain(f"{operation}: Iallreduce")

    def interrupt(self) -> None:
        """Another mpidp operation comes while this rank's window is open: hand its buckets to MPI as they are (local).

        The window ends at :meth:`resume`, after that operation's exchange,
        its sums thrown away: the other ranks, in the same operation or in
        ``reduce`` (an error everywhere), then find every call matched. The
        gradients stay where they are; the next ``reduce`` sends them again.
        """
        if self._closed or not self._opened or self._refused is not None:
            return
        self._state.rest()
        while self._queued < self._last:
            self._queue_next(None)
        self._engine.hand()
        self._interrupted = True

    def resume(self) -> None:
        """After the interrupting operation's exchange: finish the interrupted window's calls, start a new window (collective)."""
        if self._interrupted:
            try:
                self._engine.drain(f"reduce (window {self.session.window + 1}): interrupted")
            finally:
                self._reset()

    def _reset(self) -> None:
        self._state.reset()
        self._engine.reset()
        if self._exact is not None:
            self._exact.reset()
        self._queued = 0  # buckets handed to the engine in this window
        self._opened = False
        self._refused = None
        self._owed = False  # the window was refused but the other ranks drain it: so must this one
        self._interrupted = False  # another operation came while the window was open (:meth:`interrupt`)
        self._divisor = None

    def zero(self) -> None:
        """Zero what this rank contributes to the next window (local)."""
        self._state.zero()

    def close(self) -> None:
        """Finish a window any rank began, stop the engine, free the buckets' communicator (collective; idempotent).

        A rank that began no window opens one to close: the others learn it,
        and every rank starts every bucket of a window some rank began.
        """
        if self._closed:
            return
        self._closed = True
        refused: ContractError | None = None
        try:
            if self._broken is None and self._last > 0:  # a bucket can start before the agreement (exact: even a sole one)
                if self._opened:  # this rank's buckets are in flight: every rank finishes them (the buckets' communicator)
                    if self._refused is None or self._owed:
                        self._drain("close")
                elif not self.session.closed:  # no window here: open one to close, so that the others learn it
                    rows = self._open(closing=True)
                    if rows is not None and len(records.Open.closing(rows)) < len(rows):  # a rank opened it in backward
                        self._drain("close")
                    elif rows is None and self._broken is None:
                        refused = ContractError(self._refused)
        finally:
            self._engine.close()
            if self._watchdog is not None:
                self._watchdog.close()
            self._engine.comm.close()
        if refused is not None:
            raise refused


def _choose(rows: list[Any], root: int, slots: int, device: str, progress: str) -> bool | None:
    """Whether the agreed rows make a communication thread (False: the hooks; None: no overlap, ``"auto"`` without a
    core to spare on some rank); ContractError (every rank alike) where they cannot."""
    if sorted(rows[root][0]) != list(range(slots)):
        raise ContractError(f"root's bucket order is not a permutation of the {slots} reduction slots")
    if device != "cpu":
        raise ContractError(f"reduction buckets hold host memory; this session's device is {device}")
    asked = sorted({str(r[1]) for r in rows})
    if len(asked) > 1:
        raise ContractError(f"ranks ask for different overlap progress modes: {', '.join(asked)}")
    unable = [r for r, row in enumerate(rows) if not row[2]]
    if progress == "thread" and unable:
        raise ContractError(
            f"overlap='thread' needs MPI_THREAD_MULTIPLE, which MPI did not provide on rank(s) {', '.join(map(str, unable))}"
        )
    if progress == "auto" and not all(row[3] for row in rows):
        return None
    return progress == "thread" or (progress == "auto" and not unable)
