"""The only module that calls MPI: pickled records, small fixed buffers, Bcast, Allreduce.

Lowercase methods move pickled objects; capitalised ones move buffers.
Every method is collective: every rank of the communicator must call it.
"""

from __future__ import annotations

import io
import pickle
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from . import arrays
from .errors import CollectiveError, ContractError

__all__ = ["Communicator", "loads"]


class _PlainUnpickler(pickle.Unpickler):
    """Admit plain data only: no class, no function, no global of any kind."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def loads(data: bytes) -> Any:
    """Decode a pickle that holds only plain data (tuples, lists, dicts, str, numbers)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


class Communicator:
    """A private duplicate of the user's communicator; library traffic never matches user traffic.

    ``watch`` is an optional callable ``watch(operation)`` returning a context
    manager; the collective watchdog uses it to see where a rank waits.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        try:
            self.comm = comm.Dup()
        except MPI.Exception as e:  # pragma: no cover - MPI failure
            raise CollectiveError(f"MPI_Comm_dup failed: {e}") from e
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.operation: str | None = None  # the collective this rank is in, if any
        self.since = 0.0
        self.cuda_aware = False
        #: two chunk-sized buffers of pinned host memory, to stage device buffers through
        self.pinned: tuple[np.ndarray, np.ndarray] | None = None

    def use_device(self, cuda_aware: bool, chunk_bytes: int) -> None:
        """Prepare for device buffers: hand them to MPI directly, or stage them through pinned host memory.

        Call it with the arrays' device current. Not CUDA-aware: allocates
        :attr:`pinned` (the reduce pipeline uses both, :meth:`Bcast` the first).
        """
        self.cuda_aware = cuda_aware
        if not cuda_aware and self.pinned is None:
            import cupy

            memory = cupy.cuda.alloc_pinned_memory(2 * chunk_bytes)
            both = np.frombuffer(memory, dtype=np.uint8, count=2 * chunk_bytes)
            self.pinned = (both[:chunk_bytes], both[chunk_bytes:])

    def _device(self, buf: Any, move: Any) -> None:
        """Run ``move(buffer)`` on device array ``buf``: directly, or through the pinned host stage.

        CuPy's current stream is synchronised first, and the callers have
        waited for PyTorch's (:meth:`Bcast` here, ``reduce`` once per window),
        so MPI never reads memory a kernel is still writing; a device
        pointer never reaches an MPI that is not
        CUDA-aware. The copy back from the pinned stage is waited for before
        the stage is reused or the result handed back.
        """
        import cupy

        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        if self.cuda_aware:
            move(buf)
            return
        assert self.pinned is not None, "use_device() was not called"
        host = self.pinned[0][: buf.nbytes].view(buf.dtype)
        buf.get(out=host)
        move(host)
        buf.set(host)
        stream.synchronize()

    def close(self) -> None:
        """Free the duplicate communicator (collective)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

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
        """Gather one small fixed-size uint64 record per rank into a ``(size, n)`` array."""
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
        """Broadcast host or device array ``buf`` from ``root`` in place."""
        self._enter(operation)
        try:
            if isinstance(buf, np.ndarray):
                self.comm.Bcast(buf, root)
            else:
                arrays.wait_for_torch()  # (reduce waits for torch's stream once per window, before its checks)
                self._device(buf, lambda b: self.comm.Bcast(b, root))
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Allreduce(self, buf: Any, operation: str = "Allreduce") -> None:
        """Sum a float32 buffer (host or device) over all ranks in place."""
        self._enter(operation)
        try:
            if isinstance(buf, np.ndarray):
                self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            else:
                self._device(buf, lambda b: self.comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM))
        except MPI.Exception as e:
            raise self._fail(operation, e) from e
        finally:
            self.operation = None

    def Abort(self, code: int = 1) -> None:
        """Abort every process of the job (not only this communicator's)."""
        MPI.COMM_WORLD.Abort(code)
