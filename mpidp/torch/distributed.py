"""A torch.distributed backend over MPI: ``import mpidp.torch.distributed`` registers ``"mpidp"``.

Under ``mpiexec`` or ``srun``, ``torch.distributed.init_process_group("mpidp")``
needs nothing else: where the torchrun variables are unset, the ``env://``
rendezvous takes the rank, world size and the store's address from MPI
(:func:`torchrun_environment`, collective) and sets them. Every collective
of :class:`ProcessGroupMPIDP` agrees on what every rank calls before it moves
a byte (:mod:`mpidp.torch.collectives`), then runs to its end on the calling
thread: the :class:`~torch.distributed.Work` it returns is complete, its
future set. Point-to-point ``send`` and ``recv`` start MPI's non-blocking
calls and finish in ``wait``. A rank that waits in one call longer than the
group's timeout is the collective watchdog's report, then an abort.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import guard
from ..comm import Communicator, duplicate
from ..comm import world as mpi_world
from .collectives import (
    Done,
    Pending,
    Record,
    Staged,
    agree,
    apart,
    byte_counts,
    byte_view,
    finish,
    flat_bytes,
    mpi_op,
    op_name,
    op_problem,
    reduce_in_place,
    same_dtype,
    scatter_bytes,
    value_view,
)

__all__ = ["BACKEND", "ProcessGroupMPIDP", "torchrun_environment"]

#: the backend's name for ``init_process_group``
BACKEND = "mpidp"
#: the torchrun variables the ``env://`` rendezvous and the scripts it starts read
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: torch's rendezvous module (``torch.distributed.rendezvous`` is also a function's name)
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
#: what this process keeps alive: the default group's communicator (sub-groups are made from it), the store it serves
_held: dict[str, Any] = {}


#: torch's stubs type ProcessGroup's C++ overloads; the methods below are the ones its Python trampoline calls
_ProcessGroup: Any = dist.ProcessGroup


class ProcessGroupMPIDP(_ProcessGroup):
    """The ``"mpidp"`` process group: torch.distributed's collectives on one duplicated MPI communicator.

    Made by ``init_process_group("mpidp")`` and ``new_group(..., backend="mpidp")``,
    not by hand. ``comm`` is its communicator, ``timeout`` the watchdog's
    seconds (0: none).
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.sequence = 0  # collectives called so far, the same on every rank
        self._group_name = ""
        self._watchdog = guard.Watchdog(comm, timeout) if timeout > 0 else None

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def shutdown(self) -> None:
        """Stop the watchdog and free the communicator (every rank of the group calls it: destroy_process_group)."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if _held.get("world") is self.comm:
            _held.pop("world")
        self.comm.close()

    def abort(self) -> None:
        self.shutdown()

    #: operations (collective and point-to-point) of every mpidp group of this process so far (``--report``)
    carried = 0

    def _agree(self, record: Record) -> np.ndarray:
        self.sequence += 1
        ProcessGroupMPIDP.carried += 1
        return agree(self.comm, record, self.sequence)

    # ------------------------------------------------------------------ reductions

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._allreduce(tensors, op_name(opts.reduceOp) if opts is not None else "sum")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._allreduce(tensors, op_name(opts.reduceOp) if opts is not None else "sum")

    def _allreduce(self, tensors: list[torch.Tensor], op: str) -> dist.Work:
        dtype = tensors[0].dtype if tensors else None
        record = Record("allreduce", self.comm.size, dtype, op, sum(t.numel() for t in tensors), tensors=len(tensors))
        same_dtype(record, tensors, dtype)
        if dtype is not None:
            record.refuse(op_problem(op, dtype))
        self._agree(record)
        staged = [Staged(t) for t in tensors]
        if len(staged) == 1:
            reduce_in_place(self.comm, op, staged[0].host)
        elif staged:
            flat = torch.cat([s.host.reshape(-1) for s in staged])
            reduce_in_place(self.comm, op, flat)
            for s, part in zip(staged, flat.split([s.host.numel() for s in staged])):
                s.host.copy_(part.view(s.host.shape))
        for s in staged:
            s.back()
        return Done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        op, root = op_name(opts.reduceOp), int(opts.rootRank)
        (t,) = tensors
        record = Record("reduce", self.comm.size, t.dtype, op, t.numel(), root=root)
        record.refuse(op_problem(op, t.dtype) or self._root_problem(root))
        self._agree(record)
        staged = Staged(t)
        array, values = value_view(staged.host)
        mine = self.comm.rank == root
        self.comm.Call("Reduce", "MPI.IN_PLACE" if mine else array, array if mine else None, mpi_op(op, t.dtype), root)
        if mine:
            finish(op, values, self.comm.size)
            staged.host.copy_(values.view(staged.host.shape))
            staged.back()
        return Done(tensors)

    def _root_problem(self, root: int) -> str:
        return "" if 0 <= root < self.comm.size else f"root rank {root} is not in a group of {self.comm.size}"

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        op, size = op_name(opts.reduceOp), self.comm.size
        (out,), (parts,) = outputs, inputs
        record = Record("reduce_scatter", size, out.dtype, op, out.numel())
        record.moves([p.numel() for p in parts], [out.numel()] * size)
        same_dtype(record, parts, out.dtype)
        record.refuse(op_problem(op, out.dtype))
        records = self._agree(record)
        send, _ = value_view(torch.cat([Staged(p).host.reshape(-1) for p in parts]) if parts else out.new_empty(0))
        self._reduce_scatter(op, out, send, [int(c) for c in records[:, 3]])
        return Done(outputs)

    def _reduce_scatter(self, op: str, out: torch.Tensor, send: np.ndarray, counts: list[int]) -> None:
        staged = Staged(out, read=False)
        recv, values = value_view(staged.host)
        self.comm.Call("Reduce_scatter", apart(send, recv), recv, counts, mpi_op(op, out.dtype))
        finish(op, values, self.comm.size)
        if values.data_ptr() != staged.host.data_ptr():
            staged.host.copy_(values.view(staged.host.shape))
        staged.back()

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        op, size = op_name(opts.reduceOp), self.comm.size
        record = Record("reduce_scatter", size, output.dtype, op, output.numel())
        record.moves([input.numel() // size] * size, [output.numel()] * size)
        if input.numel() != size * output.numel() or input.dtype != output.dtype:
            record.refuse(f"the input ({input.numel()} {input.dtype}) must hold {size} times the output ({output.numel()} {output.dtype})")
        record.refuse(op_problem(op, output.dtype))
        self._agree(record)
        send, _ = value_view(Staged(input).host)
        self._reduce_scatter(op, output, send, [output.numel()] * size)
        return Done([output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return Done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ------------------------------------------------------------------ moves of bytes

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        root = int(opts.rootRank)
        dtype = tensors[0].dtype if tensors else None
        record = Record("broadcast", self.comm.size, dtype, "", sum(t.numel() for t in tensors), root=root, tensors=len(tensors))
        same_dtype(record, tensors, dtype)
        record.refuse(self._root_problem(root))
        self._agree(record)
        if len(tensors) == 1:
            staged = Staged(tensors[0], read=self.comm.rank == root)
            self.comm.Bcast(byte_view(staged.host), root, "torch.distributed: broadcast")
            staged.back()
        elif tensors:
            buf = flat_bytes(tensors) if self.comm.rank == root else np.empty(sum(t.numel() * t.element_size() for t in tensors), np.uint8)
            self.comm.Bcast(buf, root, "torch.distributed: broadcast")
            scatter_bytes(buf, tensors)
        return Done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        (t,), (outs,) = inputs, outputs
        size = self.comm.size
        record = Record("allgather", size, t.dtype, "", t.numel())
        record.moves([t.numel()] * size, [o.numel() for o in outs])
        same_dtype(record, outs, t.dtype)
        records = self._agree(record)
        counts, displs = byte_counts(records, 3, t.element_size())
        buf = np.empty(sum(counts), dtype=np.uint8)
        self.comm.Call("Allgatherv", byte_view(Staged(t).host), [buf, (counts, displs)])  # buf: a fresh buffer
        scatter_bytes(buf, outs)
        return Done(outs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        size = self.comm.size
        record = Record("allgather", size, input.dtype, "", input.numel())
        record.moves([input.numel()] * size, [output.numel() // size] * size)
        if output.numel() != size * input.numel() or input.dtype != output.dtype:
            record.refuse(f"the output ({output.numel()} {output.dtype}) must hold {size} times the input ({input.numel()} {input.dtype})")
        self._agree(record)
        staged = Staged(output, read=False)
        recv = byte_view(staged.host)
        self.comm.Call("Allgather", apart(byte_view(Staged(input).host), recv), recv)
        staged.back()
        return Done([output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return Done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for outs, t in zip(outputs, inputs):
            self.allgather([outs], [t], opts)
        return Done([o for outs in outputs for o in outs])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        root, size = int(opts.rootRank), self.comm.size
        (t,) = inputs
        mine = self.comm.rank == root
        outs = outputs[0] if mine and outputs else []
        record = Record("gather", size, t.dtype, "", t.numel(), root=root)
        record.moves([t.numel() if j == root else 0 for j in range(size)], [o.numel() for o in outs] if mine else [0] * size)
        same_dtype(record, outs, t.dtype)
        record.refuse(self._root_problem(root))
        records = self._agree(record)
        counts, displs = byte_counts(records, 3, t.element_size())
        buf = np.empty(sum(counts) if mine else 0, dtype=np.uint8)
        self.comm.Call("Gatherv", byte_view(Staged(t).host), [buf, (counts, displs)] if mine else None, root)
        scatter_bytes(buf, outs)
        return Done(outs if mine else [])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        root, size = int(opts.rootRank), self.comm.size
        (out,) = outputs
        mine = self.comm.rank == root
        parts = inputs[0] if mine and inputs else []
        record = Record("scatter", size, out.dtype, "", out.numel(), root=root)
        record.moves([p.numel() for p in parts] if mine else [0] * size, [out.numel() if j == root else 0 for j in range(size)])
        same_dtype(record, parts, out.dtype)
        record.refuse(self._root_problem(root))
        records = self._agree(record)
        counts, displs = byte_counts(records, 3, out.element_size())
        staged = Staged(out, read=False)
        self.comm.Call("Scatterv", [flat_bytes(parts), (counts, displs)] if mine else None, byte_view(staged.host), root)
        staged.back()
        return Done(outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        size = self.comm.size
        dtype = inputs[0].dtype if inputs else None
        record = Record("alltoall", size, dtype, "", sum(t.numel() for t in inputs))
        record.moves([t.numel() for t in inputs], [t.numel() for t in outputs])
        same_dtype(record, [*inputs, *outputs], dtype)
        self._agree(record)
        item = inputs[0].element_size() if inputs else 1
        recv = np.empty(sum(t.numel() for t in outputs) * item, dtype=np.uint8)
        self._alltoallv(flat_bytes(inputs), recv, [t.numel() for t in inputs], [t.numel() for t in outputs], item)
        scatter_bytes(recv, outputs)
        return Done(outputs)

    def _alltoallv(self, send: np.ndarray, recv: np.ndarray, sends: list[int], recvs: list[int], item: int) -> None:
        sc, rc = [n * item for n in sends], [n * item for n in recvs]
        sd, rd = [int(d) for d in np.cumsum([0, *sc[:-1]])], [int(d) for d in np.cumsum([0, *rc[:-1]])]
        self.comm.Call("Alltoallv", [send, (sc, sd)], [recv, (rc, rd)])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      opts: Any = None) -> dist.Work:
        size = self.comm.size
        record = Record("alltoall", size, input.dtype, "", input.numel())
        sends, recvs = self._splits(record, input, input_splits), self._splits(record, output, output_splits)
        record.moves(sends, recvs)
        same_dtype(record, [output], input.dtype)
        self._agree(record)
        staged = Staged(output, read=False)
        recv = byte_view(staged.host)
        self._alltoallv(apart(byte_view(Staged(input).host), recv), recv, sends, recvs, input.element_size())
        staged.back()
        return Done([output])

    all_to_all_single = alltoall_base

    def _splits(self, record: Record, t: torch.Tensor, splits: Sequence[int]) -> list[int]:
        """Values per rank from ``splits`` (rows of dim 0; empty: equal rows), refusing splits that do not fit ``t``."""
        size, rows = self.comm.size, (t.shape[0] if t.dim() else 1)
        row = t.numel() // rows if rows else 0
        splits = list(splits) or ([rows // size] * size if rows % size == 0 else [])
        if len(splits) != size or sum(splits) != rows or min(splits) < 0:
            record.refuse(f"split sizes {list(splits)} do not divide the {rows} rows of a tensor of shape {tuple(t.shape)} among {size} ranks")
            return [0] * size
        return [int(s) * row for s in splits]

    def barrier(self, opts: Any = None) -> dist.Work:
        self._agree(Record("barrier", self.comm.size))  # the exchange itself: no rank leaves before every rank came
        return Done([])

    # ------------------------------------------------------------------ point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        ProcessGroupMPIDP.carried += 1
        (t,) = tensors
        staged = Staged(t)
        request = self.comm.Call("Isend", byte_view(staged.host), dst, tag)
        return Pending(self.comm, request, f"torch.distributed: send to rank {dst}", lambda: None, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        ProcessGroupMPIDP.carried += 1
        (t,) = tensors
        staged = Staged(t, read=False)
        request = self.comm.Call("Irecv", byte_view(staged.host), src, tag)
        return Pending(self.comm, request, f"torch.distributed: recv from rank {src}", staged.back, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        raise NotImplementedError("the mpidp backend receives from a named rank only: recv(tensor, src=...)")

    def _start_coalescing(self, device: torch.device) -> None:
        """Nothing to gather: each operation inside the coalescing manager has run by the time it returns."""

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        return Done([])


# ---------------------------------------------------------------------- making groups, the rendezvous


def _create(options: Any, backend_options: Any = None) -> ProcessGroupMPIDP:
    """Make the group ``options`` describe (torch's extended creator API; collective on the group's ranks)."""
    ranks = [int(r) for r in options.global_ranks_in_group]
    timeout = options.timeout.total_seconds() if options.timeout is not None else 0.0
    if not ranks or ranks == list(range(mpi_world().size)):  # the default group, or one of every rank: all of COMM_WORLD
        comm = duplicate(None)
        if (comm.rank, comm.size) != (options.group_rank, options.group_size):
            comm.close()
            raise ValueError(
                f"the mpidp backend takes rank and world size from MPI (rank {comm.rank} of {comm.size}); "
                f"init_process_group was given rank {options.group_rank} of {options.group_size}"
            )
        if not ranks:
            _held["world"] = comm
        return ProcessGroupMPIDP(comm, timeout)
    world = _held.get("world")
    if world is None:  # only the group's ranks are here: no collective over COMM_WORLD can run now
        raise ValueError(f"an mpidp group of ranks {ranks} needs the default group to be mpidp's: init_process_group('mpidp')")
    everyone = world.Call("Get_group")
    members = everyone.Incl(ranks)
    try:
        raw = world.Call("Create_group", members)
    finally:
        members.Free()
        everyone.Free()
    try:
        return ProcessGroupMPIDP(duplicate(raw), timeout)
    finally:
        raw.Free()


def torchrun_environment(port: int = 0) -> dict[str, str]:
    """The torchrun variables of this process, from MPI, with the store's address (collective on ``COMM_WORLD``).

    Rank 0 serves a TCPStore (multi-tenant: ``env://`` on rank 0 reuses it)
    on ``port`` (0: a free one), kept alive for the process. Ranks on the
    same host as rank 0 reach it at 127.0.0.1, the others at its host name.
    ``LOCAL_RANK`` counts the ranks of this host before this one.
    """
    comm = duplicate(None)
    try:
        if comm.rank == 0 and "store" not in _held:
            _held["store"] = dist.TCPStore("0.0.0.0", port, comm.size, True, wait_for_workers=False, multi_tenant=True)
        served = int(_held["store"].port) if comm.rank == 0 else 0
        places = comm.allgather_obj((socket.gethostname(), served), "torch.distributed: the store's address")
    finally:
        comm.close()
    host, port = places[0]
    mine = places[comm.rank][0]
    local = [r for r, (h, _) in enumerate(places) if h == mine]
    return {
        "RANK": str(comm.rank), "WORLD_SIZE": str(comm.size), "LOCAL_RANK": str(local.index(comm.rank)),
        "LOCAL_WORLD_SIZE": str(len(local)), "MASTER_ADDR": "127.0.0.1" if mine == host else host, "MASTER_PORT": str(port),
    }


def _env_from_mpi(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """torch's ``env://`` handler, with the torchrun variables taken from MPI where any is unset (collective then)."""

    def handler(url: str, timeout: timedelta = _rendezvous.default_pg_timeout, **kwargs: Any) -> Iterator[Any]:
        needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if "?" not in url and not all(os.environ.get(k) for k in needed):
            found = torchrun_environment()
            os.environ.update({k: found[k] for k in needed})
            for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                os.environ.setdefault(key, found[key])
        return original(url, timeout=timeout, **kwargs)

    handler.mpidp = True  # type: ignore[attr-defined]
    return handler


def register() -> None:
    """Register the ``"mpidp"`` backend for CPU and CUDA tensors and the MPI fallback of ``env://`` (local; once)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = _rendezvous._rendezvous_handlers
    if not getattr(handlers["env"], "mpidp", False):
        handlers["env"] = _env_from_mpi(handlers["env"])


register()
