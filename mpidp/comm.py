"""The only module that calls MPI on the host: pickled records, small fixed buffers, Bcast, Allreduce, reduce-scatter.

Lowercase methods move pickled objects; capitalised ones move buffers.
Every method of :class:`Communicator` is collective: every rank of the
communicator must call it. Which device buffers may reach MPI, and when,
is :mod:`mpidp.cuda`'s decision; this module hands over what it is given.
The module functions (:func:`duplicate`, :func:`world`, :func:`abort`)
are how the rest of mpidp reaches MPI otherwise.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .errors import CollectiveError, ContractError

__all__ = ["Communicator", "MPIComm", "World", "abort", "duplicate", "finalized", "free_cores", "loads", "thread_multiple", "world"]

#: the user's communicator type, for the other modules' annotations (they import no mpi4py)
MPIComm = MPI.Comm


class _PlainUnpickler(pickle.Unpickler):
    """Admit plain data only: no class, no function, no global of any kind."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def loads(data: bytes) -> Any:
    """Decode a pickle that holds only plain data (tuples, lists, dicts, str, numbers)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


class Communicator:
    """A private duplicate of the user's communicator; library traffic never matches user traffic.

    :attr:`operation` names the collective this rank is in (None when none)
    and :attr:`since` when it entered it: the collective watchdog reads them
    to see where a rank waits. ``arm``, if given, is called with the new
    object before the Dup, the session's first collective, so that a
    watchdog it starts watches the Dup too.

    Each collective wrapper below repeats the same enter / call / fail /
    leave shape on purpose: cProfile books mpi4py's (unprofiled C) call in
    the calling Python frame, so one wrapper per collective is what lets
    ``benchmarks/probes/window_profile.py`` name the collective ("comm.py(Allreduce)");
    one shared helper would book every collective under its own name.
    """

    def __init__(self, comm: MPI.Comm, arm: Callable[[Communicator], object] | None = None) -> None:
        self.comm: MPI.Comm = MPI.COMM_NULL
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.operation: str | None = None  # the collective this rank is in, if any
        self.since = 0.0
        if arm is not None:
            arm(self)
        self._enter("initialize: MPI_Comm_dup")
        try:
            self.comm = comm.Dup()
        except MPI.Exception as e:  # pragma: no cover - MPI failure
            raise CollectiveError(f"MPI_Comm_dup failed: {e}") from e
        finally:
            self.operation = None
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)

    def close(self) -> None:
        """Free the duplicate communicator (collective; watched like every other)."""
        if self.comm != MPI.COMM_NULL:
            self._enter("close: MPI_Comm_free")
            try:
                self.comm.Free()
            finally:
                self.operation = None

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

    def Allgather_in_place(self, buf: np.ndarray, operation: str = "Allgather") -> None:
        """Give every rank every rank's share of host byte buffer ``buf`` (``size`` equal shares, rank order)."""
        self._enter(operation)
        try:
            self.comm.Allgather(MPI.IN_PLACE, buf)
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


def duplicate(comm: MPIComm | None, arm: Callable[[Communicator], object] | None = None) -> Communicator:
    """Duplicate the user's mpi4py communicator (None: ``COMM_WORLD``); collective on it.

    ``arm`` is called with the :class:`Communicator` before the Dup (see
    there). Raises TypeError, locally, when ``comm`` is not an mpi4py
    communicator.
    """
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    return Communicator(comm, arm)


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
