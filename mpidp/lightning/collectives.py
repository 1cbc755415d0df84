"""What Lightning asks of a strategy's ranks, over MPI: the cluster environment, barrier, broadcast, all_gather, reduce.

:class:`MPIDPEnvironment` takes ranks from the MPI communicator (``mpiexec``,
``srun``): no ``MASTER_ADDR``, no port, no rendezvous. :class:`Collectives`
runs Lightning's collectives on mpidp's ``"mpidp"`` process group
(:class:`mpidp.torch.distributed.ProcessGroupMPIDP`) over a duplicate of the
strategy's communicator, called directly: no default ``torch.distributed``
group is made, so Lightning's loops add no collective of their own per batch
(they broadcast a SIGTERM flag each batch where one exists). Every
collective agrees on what each rank calls before it moves a byte, so a rank
that logs another shape or skips a call is one ContractError on every rank.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

from ..comm import Communicator, MPIComm, world
from ..errors import ContractError
from ..torch.distributed import ProcessGroupMPIDP

__all__ = ["Collectives", "MPIDPEnvironment", "StrategyCollectives", "agree"]


class MPIDPEnvironment(ClusterEnvironment):
    """Lightning's cluster environment of an MPI job: rank and world size of ``comm`` (default ``COMM_WORLD``).

    Local to build: rank and size come from the communicator at once; the
    local and node ranks from :meth:`learn_hosts`, which the strategies call
    in ``setup_environment``. The processes are
    made by the launcher (``mpiexec``, ``srun``), never by Lightning.
    """

    def __init__(self, comm: MPIComm | None = None) -> None:
        self.comm = comm
        here = world() if comm is None else None
        self._rank = here.rank if here is not None else comm.Get_rank()  # type: ignore[union-attr]
        self._size = here.size if here is not None else comm.Get_size()  # type: ignore[union-attr]
        self._local = 0
        self._node = 0

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # no rendezvous: ranks meet in MPI

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return world().size > 1

    def world_size(self) -> int:
        return self._size

    def set_world_size(self, size: int) -> None:
        if size != self._size:
            raise ValueError(f"the world size comes from MPI ({self._size} ranks); Lightning asked for {size}")

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._rank:
            raise ValueError(f"the rank comes from MPI (rank {self._rank}); Lightning asked for rank {rank}")

    def local_rank(self) -> int:
        return self._local

    def node_rank(self) -> int:
        return self._node

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Nothing to check: ``devices`` and ``num_nodes`` do not decide the world, the launcher does (local)."""

    def learn_hosts(self, comm: Communicator) -> None:
        """Learn this rank's local rank (among its host's ranks) and node rank (its host's place) (collective)."""
        hosts = comm.allgather_obj(socket.gethostname(), "lightning: the ranks' hosts")
        mine = hosts[comm.rank]
        self._local = [h for h in hosts[: comm.rank] if h == mine].__len__()
        self._node = list(dict.fromkeys(hosts)).index(mine)


def agree(comm: Communicator, error: str | None, what: str) -> None:
    """Raise the same ContractError on every rank if any rank has an ``error`` (collective; ``what``: the step, for the message)."""
    errors = comm.allgather_obj(error, f"lightning: {what}")
    found = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    if len(errors) > 1 and errors[0] and errors.count(errors[0]) == len(errors):
        found = f"every rank: {errors[0]}"
    if found:
        raise ContractError(f"MPIDPStrategy, {what}: {found}")


_OPS = {"mean": "sum", "avg": "sum", "sum": "sum", "max": "max", "min": "min", "product": "product"}


def _op(reduce_op: Any) -> tuple[str, bool]:
    """(torch's op name, whether to divide by the world size) of Lightning's ``reduce_op`` (a string or a ReduceOp)."""
    if reduce_op is None:
        return "sum", True
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product",
                dist.ReduceOp.AVG: "avg"}.get(reduce_op, str(reduce_op))
    if name not in _OPS:
        raise ValueError(f"reduce_op must be one of {sorted(_OPS)} or a torch ReduceOp of them, got {reduce_op!r}")
    return _OPS[name], name in ("mean", "avg")


class Collectives:
    """Lightning's barrier, broadcast, all_gather and reduce on the ranks of ``comm`` (each method collective).

    ``timeout``: the watchdog's seconds for one call (0: none).
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self.group = ProcessGroupMPIDP(comm, timeout)
        self.rank, self.size = comm.rank, comm.size

    def barrier(self) -> None:
        """Wait until every rank has come (collective)."""
        self.group.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled; tensors too) on every rank (collective)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        self.group.broadcast([n], _options(dist.BroadcastOptions(), rootRank=src))
        buf = payload if self.rank == src else torch.empty(int(n.item()), dtype=torch.uint8)
        self.group.broadcast([buf], _options(dist.BroadcastOptions(), rootRank=src))
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, on every rank (collective; ``tensor`` untouched)."""
        if sync_grads:
            raise ValueError("all_gather(sync_grads=True) is not supported by MPIDPStrategy: gather without gradients")
        t = tensor.detach().contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([outs], [t])
        return torch.stack(outs).to(tensor.device)

    def reduce(self, tensor: torch.Tensor, reduce_op: Any = "mean") -> torch.Tensor:
        """``tensor`` reduced over the ranks: a new tensor, ``tensor`` untouched (collective); mean: the sum over the world size, in floating point."""
        op, mean = _op(reduce_op)
        t = tensor.detach().clone()
        if mean and not t.is_floating_point():
            t = t.to(torch.get_default_dtype())
        self.group.allreduce([t], _options(dist.AllreduceOptions(), reduceOp=getattr(dist.ReduceOp, op.upper())))
        return t / self.size if mean else t

    def close(self) -> None:
        """Free the communicator (collective)."""
        self.group.shutdown()


class StrategyCollectives:
    """The collective methods both strategies give Lightning, over their ``_collectives`` (None until
    ``setup_environment``: then a world of one). Put before Lightning's base class; each strategy names its reduce
    (the Trainer's ``reduce``, Fabric's ``all_reduce``) and calls :meth:`_reduce_tensor`."""

    _collectives: Collectives | None

    def barrier(self, name: str | None = None) -> None:
        if self._collectives is not None:
            self._collectives.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._collectives is None else self._collectives.broadcast(obj, src)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        assert self._collectives is not None, "all_gather before setup_environment"
        return self._collectives.all_gather(tensor, sync_grads)

    def _reduce_tensor(self, tensor: Any, reduce_op: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or self._collectives is None:
            return tensor
        return self._collectives.reduce(tensor, reduce_op)


def _options(options: Any, **values: Any) -> Any:
    for key, value in values.items():
        setattr(options, key, value)
    return options
