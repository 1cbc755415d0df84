"""The torch.distributed backend's moves: each collective's agreement record, then one MPI call on host views of the tensors.

Every collective first exchanges one small fixed record per rank (an
``Allgather`` of ``8 + 2 * size`` int64 words: what the rank calls, its op,
dtype, counts, root and any local problem). Every rank reads every rank's
record and reaches the same verdict: go on, or raise the same
:class:`~mpidp.errors.ContractError` naming the ranks that differ. Only then
do bytes move, so a rank that calls another collective or passes another
shape is an error on every rank instead of a hang or a corrupted buffer.
Reductions of float16 and bfloat16 run in float32 (MPI has no 16-bit float
sum) and round once; ``AVG`` divides the sum. Tensors on a device are staged
through host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..comm import Communicator
from ..errors import ContractError

__all__ = [
    "KINDS",
    "Done",
    "Pending",
    "Record",
    "Staged",
    "agree",
    "byte_counts",
    "byte_view",
    "finish",
    "flat_bytes",
    "mpi_op",
    "op_name",
    "op_problem",
    "reduce_in_place",
    "same_dtype",
    "scatter_bytes",
    "value_view",
]

#: the collectives a record names (the number is what goes on the wire)
KINDS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier", "gather", "scatter", "reduce")
#: every dtype the backend moves, by its number on the wire
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
#: torch's reduce ops by their RedOpType number, and the MPI op each becomes (AVG: a SUM, then a division)
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_MPI_OPS = {"sum": "MPI.SUM", "avg": "MPI.SUM", "product": "MPI.PROD", "min": "MPI.MIN", "max": "MPI.MAX",
            "band": "MPI.BAND", "bor": "MPI.BOR", "bxor": "MPI.BXOR"}
#: logical ops for bool: torch's NCCL and Gloo treat a bool sum as "any"
_BOOL_OPS = {"sum": "MPI.LOR", "max": "MPI.LOR", "bor": "MPI.LOR", "min": "MPI.LAND", "product": "MPI.LAND",
             "band": "MPI.LAND", "bxor": "MPI.LXOR"}
_HEADER = 8  # kind, op, dtype, count, root, problem, sequence, tensors


def op_name(op: Any) -> str:
    """``"sum"``, ``"avg"``, ... for a torch ``ReduceOp`` (local)."""
    return OPS[int(op.op)] if hasattr(op, "op") else OPS[int(op)]


def op_problem(op: str, dtype: torch.dtype) -> str:
    """Why ``op`` cannot reduce ``dtype`` (empty: it can; local)."""
    if op not in _MPI_OPS:
        return f"reduce op {op.upper()} is not supported by the mpidp backend (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)"
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        return f"reduce op AVG needs a floating-point tensor, got {dtype} (as with Gloo: SUM, then divide)"
    if dtype == torch.bool:
        return "" if op in _BOOL_OPS else f"reduce op {op.upper()} is not defined for bool tensors"
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        return f"reduce op {op.upper()} needs an integer tensor, got {dtype}"
    if op in ("min", "max") and dtype.is_complex:
        return f"reduce op {op.upper()} is not defined for complex tensors"
    return ""


class Staged:
    """A contiguous host tensor holding ``tensor``'s values; :meth:`back` copies it into ``tensor`` where it is a copy."""

    def __init__(self, tensor: torch.Tensor, read: bool = True) -> None:
        self.tensor = tensor
        t = tensor.detach()
        self.copy = t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg()
        if not self.copy:
            self.host = t
        elif read:
            self.host = t.to("cpu", memory_format=torch.contiguous_format).resolve_conj().resolve_neg().contiguous()
        else:
            self.host = torch.empty(t.shape, dtype=t.dtype)

    def back(self) -> None:
        if self.copy:
            with torch.no_grad():
                self.tensor.copy_(self.host)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous host tensor ``t`` as a uint8 array sharing its memory (local)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def apart(send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """``send``, or a copy of it where it lies in ``recv`` (FSDP gathers from a slice of the output; MPI refuses aliases)."""
    return send.copy() if np.may_share_memory(send, recv) else send


def value_view(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """(NumPy view MPI can reduce, the tensor behind it): float32 copies of 16-bit floats, else ``t`` itself (local)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        wide = t.reshape(-1).float()
        return wide.numpy(), wide
    flat = t.reshape(-1)
    return flat.numpy(), flat


def mpi_op(op: str, dtype: torch.dtype) -> str:
    """The MPI op (``"MPI.SUM"``) that reduces ``dtype`` as torch's ``op`` does (local; checked by :func:`op_problem`)."""
    return _BOOL_OPS[op] if dtype == torch.bool else _MPI_OPS[op]


def finish(op: str, values: torch.Tensor, size: int) -> None:
    """Divide a sum by ``size`` for AVG (floating-point values: :func:`op_problem` refuses the others; local)."""
    if op == "avg":
        values.div_(size)


def reduce_in_place(comm: Communicator, op: str, t: torch.Tensor) -> None:
    """Reduce contiguous host tensor ``t`` over every rank in place (collective, agreed before)."""
    array, values = value_view(t)
    comm.Call("Allreduce", "MPI.IN_PLACE", array, mpi_op(op, t.dtype))
    finish(op, values, comm.size)
    if values.data_ptr() != t.data_ptr():
        t.copy_(values.view(t.shape))


class Record:
    """One rank's agreement record: what it calls, with what; :func:`agree` exchanges it."""

    def __init__(self, kind: str, size: int, dtype: torch.dtype | None = None, op: str = "", count: int = 0,
                 root: int = 0, tensors: int = 1) -> None:
        self.kind, self.size = kind, size
        self.words = np.zeros(_HEADER + 2 * size, dtype=np.int64)
        code = DTYPES.index(dtype) if dtype in DTYPES else -1
        self.words[:5] = (KINDS.index(kind), OPS.index(op) if op else -1, code, count, root)
        self.words[7] = tensors
        self.problem = "" if dtype is None or code >= 0 else f"dtype {dtype} is not supported by the mpidp backend"
        self.matrix = False  # whether sends and recvs below say who sends what to whom

    def moves(self, sends: Sequence[int], recvs: Sequence[int]) -> Record:
        """Set the values this rank sends to each rank and expects from each (checked against theirs)."""
        if len(sends) != self.size or len(recvs) != self.size:
            self.refuse(f"expected {self.size} send and receive counts, got {len(sends)} and {len(recvs)}")
            return self
        self.words[_HEADER : _HEADER + self.size] = sends
        self.words[_HEADER + self.size :] = recvs
        self.matrix = True
        return self

    def refuse(self, problem: str) -> None:
        """Record a local problem: every rank raises it after the exchange (the first one recorded wins)."""
        self.problem = self.problem or problem


def _describe(words: np.ndarray) -> str:
    kind, op, dtype, count, root = (int(w) for w in words[:5])
    parts = [OPS[op].upper()] if op >= 0 else []
    parts += [str(DTYPES[dtype]).removeprefix("torch.")] if dtype >= 0 else []
    parts += [f"{count} values"] if KINDS[kind] in ("allreduce", "broadcast", "reduce") else []
    parts += [f"root {root}"] if KINDS[kind] in ("broadcast", "gather", "scatter", "reduce") else []
    parts += [f"{int(words[7])} tensors"] if words[7] != 1 else []
    return f"{KINDS[kind]}({', '.join(parts)})"


def _verdict(records: np.ndarray, size: int) -> str:
    """What every rank finds wrong with the exchanged records (empty: nothing), the same text on every rank."""
    first = records[0]
    same = (0, 1, 2, 4, 6, 7) if KINDS[int(first[0])] not in ("allreduce", "broadcast", "reduce") else (0, 1, 2, 3, 4, 6, 7)
    differ = [r for r in range(size) if any(records[r][i] != first[i] for i in same)]
    if differ:
        calls = "; ".join(f"rank {r}: {_describe(records[r])}" for r in [0, *differ][:8])
        return f"ranks call different collectives or pass different inputs ({calls})"
    if KINDS[int(first[0])] in ("allreduce", "broadcast", "reduce", "barrier"):
        return ""
    sends, recvs = records[:, _HEADER : _HEADER + size], records[:, _HEADER + size :]
    for r in range(size):
        for j in range(size):
            if sends[r, j] != recvs[j, r]:
                return (f"rank {r} sends {sends[r, j]} values to rank {j}, which expects {recvs[j, r]} "
                        f"in {_describe(first)}: the tensor sizes do not match")
    return ""


def agree(comm: Communicator, record: Record, sequence: int) -> np.ndarray:
    """Exchange ``record`` with every rank; raise the same ContractError everywhere unless all fit (collective).

    Returns every rank's record words, ``(size, 8 + 2 * size)``: the counts of
    the other ranks that uneven collectives need. The problems' text is
    exchanged only when a rank recorded one.
    """
    record.words[5] = 1 if record.problem else 0
    record.words[6] = sequence
    records = comm.Allgather(record.words, f"torch.distributed #{sequence}: {_describe(record.words)}")
    if records[:, 5].any():
        problems = comm.allgather_obj(record.problem, "torch.distributed: the problems")
        found = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise ContractError(f"mpidp backend, collective #{sequence}: {found}")
    verdict = _verdict(records, comm.size)
    if verdict:
        raise ContractError(f"mpidp backend, collective #{sequence}: {verdict}")
    return records


class Done(dist.Work):
    """A finished operation: its future holds ``result``."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self.result_ = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self.result_

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self.result_)
        return future


class Pending(Done):
    """A started point-to-point operation: ``wait`` finishes its MPI request, then ``then`` (copies out of staging)."""

    def __init__(self, comm: Communicator, request: Any, what: str, then: Callable[[], None], result: list[torch.Tensor]) -> None:
        super().__init__(result)
        self.comm, self.request, self.what, self.then = comm, request, what, then
        self.finished = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.finished:
            self.comm.wait([self.request], self.what)
            self.finished = True
            self.then()
        return True

    def is_completed(self) -> bool:
        if not self.finished and self.comm.done(self.request):
            self.wait()
        return self.finished

    def get_future(self) -> torch.futures.Future:
        self.wait()  # its future is complete once the request is: wait for it here
        return super().get_future()


def byte_counts(records: np.ndarray, column: int, itemsize: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements from the records' ``column`` (every rank's count of values)."""
    counts = [int(c) * itemsize for c in records[:, column]]
    return counts, [int(d) for d in np.cumsum([0, *counts[:-1]])]


def flat_bytes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The bytes of ``tensors`` one after another (a fresh host buffer)."""
    parts = [byte_view(Staged(t).host) for t in tensors]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)


def scatter_bytes(buf: np.ndarray, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive bytes of ``buf`` into ``tensors``."""
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        part = torch.from_numpy(buf[at : at + n]).view(t.dtype).view(t.shape)
        with torch.no_grad():
            t.copy_(part)
        at += n


def same_dtype(record: Record, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> None:
    """Refuse, in ``record``, tensors of another dtype than ``dtype`` (local)."""
    if any(t.dtype != dtype for t in tensors):
        record.refuse(f"every tensor must be {dtype}, got {sorted({str(t.dtype) for t in tensors})}")
