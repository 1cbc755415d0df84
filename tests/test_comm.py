"""The communicator module: restricted unpickling, private duplicate, MPI failures as CollectiveError."""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest
from mpi4py import MPI

from mpidp import CollectiveError
from mpidp.comm import Communicator, duplicate, loads, world

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport


def test_loads_admits_plain_data() -> None:
    value = ((("w", (3, 4), "float32", True, 0),), 0, 4096, None, {"a": [1.5, b"x"]})
    assert loads(pickle.dumps(value)) == value


@pytest.mark.parametrize("obj", [collections.OrderedDict(a=1), np.float32(1), print])
def test_loads_refuses_any_global(obj: object) -> None:
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        loads(pickle.dumps(obj))


@pytest.fixture(params=["self", "world"])
def either(request: pytest.FixtureRequest) -> MPI.Comm:
    """The same test on COMM_SELF (a world of one on every rank) and on COMM_WORLD."""
    return MPI.COMM_SELF if request.param == "self" else MPI.COMM_WORLD


def test_allgather_obj_and_buffers(either: MPI.Comm) -> None:
    comm = either
    c = Communicator(comm)
    try:
        assert c.comm != comm and c.comm.Compare(comm) == MPI.CONGRUENT
        assert c.allgather_obj(("rank", c.rank, "x" * c.rank)) == [("rank", r, "x" * r) for r in range(c.size)]
        table = c.Allgather(np.array([c.rank, 7], np.uint64), "test")
        assert table.tolist() == [[r, 7] for r in range(c.size)]
        buf = np.full(10, c.rank + 1, np.float32)
        c.Allreduce(buf)
        assert (buf == sum(range(1, c.size + 1))).all()
    finally:
        c.close()


def test_mpi_failure_is_a_collective_error_with_the_mpi_cause(either: MPI.Comm) -> None:
    c = Communicator(either)
    try:
        with pytest.raises(CollectiveError, match="Bcast failed on rank") as info:
            c.Bcast(np.zeros(3, np.float32), root=c.size + 5)  # an invalid root, caught by MPI on every rank
        assert isinstance(info.value.__cause__, MPI.Exception)
    finally:
        c.close()


def test_duplicate_refuses_what_is_not_a_communicator() -> None:
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator, got list"):
        duplicate([])  # type: ignore[arg-type]


def test_world_reports_this_process() -> None:
    w = world()
    assert (w.rank, w.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()) and w.library



def test_the_dup_and_the_free_are_watched(either: MPI.Comm) -> None:
    """A watchdog armed by ``arm`` sees the Dup (the session's first collective) and the Free, like every collective."""
    seen: list[tuple[str, object]] = []
    made: list[Communicator] = []

    class Watched:  # the user's communicator, telling what the Communicator says it is in
        def __getattr__(self, name: str) -> object:
            return getattr(either, name)

        def Dup(self) -> MPI.Comm:
            seen.append(("Dup", made[0].operation))
            return either.Dup()

    def arm(c: Communicator) -> None:
        made.append(c)
        seen.append(("armed", c.comm == MPI.COMM_NULL))  # before the Dup

    c = Communicator(Watched(), arm)  # type: ignore[arg-type]
    real = c.comm

    class Freed:
        def __ne__(self, other: object) -> bool:
            return bool(real != other)

        def Free(self) -> None:
            seen.append(("Free", c.operation))
            real.Free()

    c.comm = Freed()  # type: ignore[assignment]
    c.close()
    assert seen == [("armed", True), ("Dup", "initialize: MPI_Comm_dup"), ("Free", "close: MPI_Comm_free")]
    assert c.operation is None
