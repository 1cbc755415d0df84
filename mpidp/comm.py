"""The only module that calls MPI on the host: pickled records, small fixed buffers, Bcast, Allreduce, reduce-scatter.

Lowercase methods move pickled objects; capitalised ones move buffers.
Every method of :class:`Communicator` is collective: every rank of the
communicator must call it. Which device buffers may reach MPI, and when,
is :mod:`mpidp.cuda`'s decision; this module hands over what it is given.
The module functions (:func:`duplicate`, :func:`world`, :func:`abort`)
are how the rest of mpidp reaches MPI otherwise.

Every session over the same ranks in the same order (the same group: one
user communicator, or several with that group) belongs to one :class:`Job`,
which holds one more duplicate shared by those sessions: each session's
agreement (:meth:`Communicator.Exchange`) runs on it, so that a rank in one
session's operation meets a rank in another's in the same call instead of
waiting in a different communicator. Its point-to-point traffic answers the
watchdog's question where every rank is (:meth:`Communicator.ask_where`).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .errors import CollectiveError, ContractError

__all__ = ["Communicator", "Job", "MPIComm", "World", "abort", "duplicate", "finalized", "free_cores", "loads", "thread_multiple", "world"]

#: the user's communicator type, for the other modules' annotations (they import no mpi4py)
MPIComm = MPI.Comm


class _PlainUnpickler(pickle.Unpickler):
    """Admit plain data only: no class, no function, no global of any kind."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def loads(data: bytes) -> Any:
    """Decode a pickle that holds only plain data (tuples, lists, dicts, str, numbers)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


#: point-to-point tags of the job's communicator: the watchdog's question and the answers
_WHERE, _HERE = 1, 2


class Job:
    """What every session over one group of ranks shares: the duplicate their agreements run on, their numbers, names, frame width.

    Made by the first session over the group (a Dup, collective), freed when
    the last one closes; every rank makes and frees it alike, as sessions
    are made and closed collectively. ``width`` is the frame width of the
    widest session made so far: every session's records are that wide, so
    that records of different sessions still match in MPI.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.group = comm.Get_group()
        self.made = 0  # sessions numbered so far (1, 2, ...: the order they were made in, the same on every rank)
        self.width = 0
        #: the open sessions' communicators by number (what the watchdog's answer reads)
        self.members: dict[int, Communicator] = {}
        self.lock = threading.RLock()  # the watchdogs' point-to-point traffic against the Free

    def label(self, number: int) -> str:
        """``session 2`` or ``session 2 ('critic')``, as every rank names session ``number`` (local)."""
        member = self.members.get(number)
        return member.label if member is not None else f"session {number}"


#: the jobs of this process, one per group of ranks (every rank of a group holds the same)
_jobs: list[Job] = []


def _join(comm: MPI.Comm) -> Job:
    """The job of ``comm``'s group, made now (Dup: collective on ``comm``) where this process has none (every rank alike)."""
    group = comm.Get_group()
    try:
        for job in _jobs:
            if MPI.Group.Compare(job.group, group) == MPI.IDENT:
                return job
    finally:
        group.Free()
    job = Job(comm.Dup())
    job.comm.Set_errhandler(MPI.ERRORS_RETURN)
    _jobs.append(job)
    return job


class Communicator:
    """A private duplicate of the user's communicator; library traffic never matches user traffic.

    :attr:`operation` names the collective this rank is in (None when none)
    and :attr:`since` when it entered it: the collective watchdog reads them
    to see where a rank waits. ``arm``, if given, is called with the new
    object before the Dup, the session's first collective, so that a
    watchdog it starts watches the Dup too. ``announce``, if given, makes it
    a session of the job of ``comm``'s group (:class:`Job`): numbered
    (:attr:`session`), it is called before the Dup, to agree on the job's
    communicator that every rank is making this session; a raise leaves the
    job as it was.

    Each collective wrapper below repeats the same enter / call / fail /
    leave shape on purpose: cProfile books mpi4py's (unprofiled C) call in
    the calling Python frame, so one wrapper per collective is what lets
    ``benchmarks/probes/window_profile.py`` name the collective ("comm.py(Allreduce)");
    one shared helper would book every collective under its own name.
    """

    def __init__(
        self, comm: MPI.Comm, arm: Callable[[Communicator], object] | None = None,
        announce: Callable[[Communicator], object] | None = None,
    ) -> None:
        self.comm: MPI.Comm = MPI.COMM_NULL
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.operation: str | None = None  # the collective this rank is in, if any
        self.since = 0.0
        #: the job this session belongs to (None: a communicator of its own, agreeing on itself)
        self.job: Job | None = None
        self.session = 0  # its number in the job (0: none)
        self.label = ""  # how every rank names its session (``session 2 ('critic')``; empty: no job)
        #: how the session that owns it closes without agreeing (a rank closes it while this one is elsewhere)
        self.closer: Callable[[], None] | None = None
        if arm is not None:
            arm(self)
        self._enter("initialize: MPI_Comm_dup")
        try:
            if announce is not None:
                self._join(comm, announce)
            self._enter("initialize: MPI_Comm_dup")
            self.comm = comm.Dup()
        except MPI.Exception as e:  # pragma: no cover - MPI failure
            self._leave()
            raise CollectiveError(f"MPI_Comm_dup failed: {e}") from e
        finally:
            self.operation = None
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)

    def _join(self, comm: MPI.Comm, announce: Callable[[Communicator], object]) -> None:
        """Become the next session of ``comm``'s job, then ``announce`` it there (collective; nothing held if it raises)."""
        self.job = _join(comm)
        with self.job.lock:
            self.job.made += 1
            self.session = self.job.made
            self.label = f"session {self.session}"
            self.job.members[self.session] = self
        try:
            announce(self)
        except BaseException:  # the ranks elsewhere never numbered it: neither does this one
            if self.job.made == self.session:
                self.job.made -= 1
            self._leave()
            raise

    def _leave(self) -> None:
        """Leave the job; the last session to leave frees its communicator (every rank alike)."""
        job, self.job = self.job, None
        if job is None:
            return
        with job.lock:
            job.members.pop(self.session, None)
            if job.members or job.comm == MPI.COMM_NULL:
                return
            _jobs.remove(job)
            job.group.Free()
            try:
                job.comm.Free()
            finally:
                job.comm = MPI.COMM_NULL

    @property
    def width(self) -> int:
        """The frame width every session of the job uses (0: no job; local)."""
        return 0 if self.job is None else self.job.width

    def widen(self, width: int) -> None:
        """Make the job's frames at least ``width`` words (after an agreement: every rank alike; local)."""
        if self.job is not None:
            self.job.width = max(self.job.width, width)

    def sessions(self) -> Callable[[int], str]:
        """How every rank names a session of the job by its number (local)."""
        job = self.job
        return (lambda n: f"session {n}") if job is None else job.label

    def close(self) -> None:
        """Free the duplicate communicator and leave the job (collective; watched like every other)."""
        if self.comm == MPI.COMM_NULL and self.job is None:
            return
        self._enter("close: MPI_Comm_free")
        try:
            if self.comm != MPI.COMM_NULL:
                self.comm.Free()
            self._leave()
        finally:
            self.operation = None

    # ------------------------------------------------ where every rank is (the watchdog's question)

    def where(self) -> str:
        """Where this rank is: the operation each session of the job is in here, with its wait (local)."""
        job = self.job
        members = [self] if job is None else list(job.members.values())
        now = time.monotonic()
        places = [(m.label, m.operation, now - m.since) for m in members]  # (read while the main thread goes on)
        busy = [f"{label}: {op}, for {waited:.1f} s" if label else f"{op}, for {waited:.1f} s" for label, op, waited in places if op is not None]
        return "; ".join(busy) if busy else "in no mpidp collective (in its own code, or waiting outside mpidp)"

    def answer_where(self) -> None:
        """Answer every rank that asked where this one is (local: point-to-point on the job's communicator; never waits)."""
        job = self.job
        if job is None:
            return
        with job.lock:
            if job.comm == MPI.COMM_NULL:
                return
            status = MPI.Status()
            while job.comm.Iprobe(MPI.ANY_SOURCE, _WHERE, status):
                asker = status.Get_source()
                job.comm.Recv([bytearray(1), MPI.BYTE], asker, _WHERE)
                job.comm.Send([self.where().encode(), MPI.BYTE], asker, _HERE)

    def ask_where(self, seconds: float) -> list[str | None]:
        """Ask every other rank of the job where it is; their answers within ``seconds`` (None: none came), this rank's own.

        Point-to-point on the job's communicator, answered by the other ranks'
        watchdogs (:meth:`answer_where`) while their main threads wait
        anywhere; needs ``MPI_THREAD_MULTIPLE``. Without a job: only this
        rank's. A question left unanswered stays unmatched: the watchdog
        that asks aborts the job next.
        """
        out: list[str | None] = [None] * self.size
        out[self.rank] = self.where()
        job = self.job
        if job is None or not thread_multiple():
            return out
        with job.lock:
            if job.comm == MPI.COMM_NULL:
                return out
            others = [r for r in range(self.size) if r != self.rank]
            for r in others:  # one byte: sent at once (eagerly), whatever the other rank does
                job.comm.Send([bytearray(1), MPI.BYTE], r, _WHERE)
            deadline = time.monotonic() + seconds
            waiting = set(others)
            status = MPI.Status()
            while waiting and time.monotonic() < deadline:
                self.answer_where()  # theirs may be asking too
                if not job.comm.Iprobe(MPI.ANY_SOURCE, _HERE, status):
                    time.sleep(0.01)
                    continue
                source, data = status.Get_source(), bytearray(status.Get_count(MPI.BYTE))
                job.comm.Recv([data, MPI.BYTE], source, _HERE)
                out[source] = data.decode(errors="replace")
                waiting.discard(source)
        return out

    def _enter(self, operation: str) -> None:
        self.since = time.monotonic()
        self.operation = operation

    def _fail(self, operation: str, e: MPI.Exception) -> CollectiveError:
        return CollectiveError(f"{operation} failed on rank {self.rank}: {e.Get_error_string()}")

    def allgather_obj(self, obj: Any, operation: str = "allgather_obj") -> list[Any]:
        """Gather one plain-data object from every rank, on every rank."""
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        counts = np.empty(self.size, dtype=np.int64)
        self._enter(operation)
        try:
            self.comm.Allgather(np.array([payload.size], dtype=np.int64), counts)
            displs = np.zeros(self.size, dtype=np.int64)
            np.cumsum(counts[:-1], out=displs[1:])
            out = np.empty(int(counts.sum()), dtype=np.uint8)
            self.comm.Allgatherv(payload, [out, (counts, displs), MPI.BYTE])
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None
        try:
            return [loads(out[d : d + c].tobytes()) for d, c in zip(displs, counts)]
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ContractError(f"a rank sent a record that is not plain data: {e}") from e

    def Allgather(self, record: np.ndarray, operation: str) -> np.ndarray:
        """Gather one small fixed-size record per rank into a ``(size, n)`` array."""
        out = np.empty((self.size, record.size), dtype=record.dtype)
        self._enter(operation)
        try:
            self.comm.Allgather(record, out)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None
        return out

    def Exchange(self, record: np.ndarray, operation: str) -> np.ndarray:
        """:meth:`Allgather` on the job's communicator, which every session of the job agrees on (watched as this one's)."""
        out = np.empty((self.size, record.size), dtype=record.dtype)
        comm = self.comm if self.job is None else self.job.comm
        self._enter(operation)
        try:
            comm.Allgather(record, out)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None
        return out

    def Bcast(self, buf: Any, root: int, operation: str = "Bcast") -> None:
        """Broadcast buffer ``buf`` from ``root`` in place (host memory, or device memory MPI may read)."""
        self._enter(operation)
        try:
            self.comm.Bcast(buf, root)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Reduce_scatter_block(self, send: np.ndarray, recv: np.ndarray, operation: str = "Reduce_scatter_block") -> None:
        """Sum float32 host ``send`` (``size`` equal shares) over all ranks; this rank's share lands in ``recv``."""
        self._enter(operation)
        try:
            self.comm.Reduce_scatter_block(send, recv, MPI.SUM)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Alltoall(self, send: np.ndarray, recv: np.ndarray, operation: str = "Alltoall") -> None:
        """Rank ``j``'s share of host ``send`` (``size`` equal shares) to rank ``j``; ``recv`` gets every rank's share for this one, in rank order."""
        self._enter(operation)
        try:
            self.comm.Alltoall(send, recv)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Allgather_in_place(self, buf: np.ndarray, operation: str = "Allgather") -> None:
        """Give every rank every rank's share of host byte buffer ``buf`` (``size`` equal shares, rank order)."""
        self._enter(operation)
        try:
            self.comm.Allgather(MPI.IN_PLACE, buf)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Allgatherv_in_place(self, buf: np.ndarray, counts: list[int], displs: list[int], operation: str = "Allgatherv") -> None:
        """Give every rank every rank's bytes of host uint8 ``buf``: rank ``j``'s ``counts[j]`` bytes at ``displs[j]``."""
        self._enter(operation)
        try:
            self.comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs), MPI.BYTE])
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Allreduce(self, buf: Any, operation: str = "Allreduce") -> None:
        """Sum float32 buffer ``buf`` over all ranks in place (host memory, or device memory MPI may read)."""
        self._enter(operation)
        try:
            self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Allreduce_into(self, send: np.ndarray, recv: np.ndarray, operation: str = "Allreduce") -> None:
        """Sum host buffer ``send`` (float32, or int64 for weights) over all ranks into ``recv``."""
        self._enter(operation)
        try:
            self.comm.Allreduce(send, recv, MPI.SUM)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Iallreduce(self, send: np.ndarray, recv: np.ndarray, operation: str = "Iallreduce") -> MPI.Request:
        """Start summing float32 host buffer ``send`` over all ranks into ``recv``; finish it with :meth:`wait`."""
        try:
            return self.comm.Iallreduce(send, recv, MPI.SUM)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e

    def done(self, request: MPI.Request, operation: str = "Test") -> bool:
        """Progress MPI once and say whether ``request`` (of any communicator) is complete; never waits (local)."""
        try:
            return bool(request.Test())
        except MPI.Exception as e:
            raise self._fail(operation, e) from e

    def wait(self, requests: list[MPI.Request], operation: str) -> None:
        """Finish ``requests`` (of any communicator), seen by this communicator's watchdog as ``operation``."""
        self._enter(operation)
        try:
            MPI.Request.Waitall(requests)
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Call(self, name: str, *args: Any) -> Any:
        """Call the duplicate's mpi4py method ``name`` (``"Alltoallv"``, ``"Isend"``) on ``args``; ``"MPI.SUM"`` stands for ``MPI.SUM``."""
        args = tuple(getattr(MPI, a[4:]) if isinstance(a, str) and a.startswith("MPI.") else a for a in args)
        self._enter(name)
        try:
            return getattr(self.comm, name)(*args)
        except MPI.Exception as e:
            raise self._fail(name, e) from e
        finally:
            self.operation = None


def duplicate(
    comm: MPIComm | None, arm: Callable[[Communicator], object] | None = None, announce: Callable[[Communicator], object] | None = None
) -> Communicator:
    """Duplicate the user's mpi4py communicator (None: ``COMM_WORLD``); collective on it.

    ``arm`` is called with the :class:`Communicator` before the Dup (see
    there). With ``announce`` the communicator is a session of the job of
    ``comm``'s group (made now where there is none): ``announce`` is called
    with it, numbered, before the Dup, to tell the job's other sessions (a
    session's first agreement). Raises TypeError, locally, when ``comm`` is
    not an mpi4py communicator.
    """
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    return Communicator(comm, arm, announce)


class World(NamedTuple):
    """What the launch checks need to know about the job (local; no communication)."""

    rank: int  # in COMM_WORLD
    size: int  # of COMM_WORLD
    library: str  # MPI_Get_library_version


def world() -> World:
    """This process's place in ``COMM_WORLD`` and the MPI library's version (local)."""
    return World(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), MPI.Get_library_version())


def thread_multiple() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default; local)."""
    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def free_cores(comm: Communicator, threads: int) -> bool:
    """Whether this node has a core for a communication thread per rank besides ``threads`` computing ones (collective).

    True when the cores this process may run on are at least the ranks of
    ``comm`` on this node (``MPI_COMM_TYPE_SHARED``) times ``threads + 1``.
    """
    comm._enter("reduction_buckets: ranks on this node")
    try:
        node = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            ranks = node.Get_size()
        finally:
            node.Free()
    except MPI.Exception as e:
        raise comm._fail("MPI_Comm_split_type", e) from e
    finally:
        comm.operation = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores >= ranks * (threads + 1)


def finalized() -> bool:
    """Whether MPI has been finalized already (then no communicator can be used or freed; local)."""
    return bool(MPI.Is_finalized())


def abort(code: int = 1) -> None:
    """Abort every process of the job (``COMM_WORLD``), if MPI is running; else return."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
