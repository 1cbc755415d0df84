"""An in-process stand-in for mpidp.comm.Communicator: one rank of a world whose other ranks are scripted.

``Table(rank, others)`` plays rank ``rank``; ``others`` holds what every
rank sends (this rank's entry is replaced by what it passes), for
``Allgather`` (fixed frames) and ``allgather_obj`` (pickled records, and
the error texts a frame exchange fetches; ``Exchange``, the job's frames,
is ``Allgather`` too). ``session`` is the number of the session this rank
agrees for; ``names`` how every rank names the job's sessions. Every object goes through the
same restricted unpickler as MPI traffic. Lets the consensus room be tested
in one process, once per simulated rank, with no MPI.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from mpidp.comm import loads


class Table:
    def __init__(
        self, rank: int, frames: list[np.ndarray] | None = None, objects: list[list[Any]] | None = None,
        session: int = 0, names: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.session = session
        self.width = 0
        self.names = names or {}
        self.size = len(frames if frames is not None else (objects or [[]])[0])
        self.frames = frames
        self.objects = list(objects or [])  # one list per allgather_obj call, in call order
        self.calls: list[str] = []
        self.operation: str | None = None
        self.since = 0.0

    def Allgather(self, record: np.ndarray, operation: str) -> np.ndarray:
        assert self.frames is not None
        self.calls.append(operation)
        rows = [record.copy() if r == self.rank else f for r, f in enumerate(self.frames)]
        return np.stack(rows)

    def Exchange(self, record: np.ndarray, operation: str) -> np.ndarray:
        return self.Allgather(record, operation)

    def sessions(self) -> Any:
        return lambda n: self.names.get(n, f"session {n}")

    def allgather_obj(self, obj: Any, operation: str = "allgather_obj") -> list[Any]:
        self.calls.append(operation)
        sent = self.objects.pop(0)
        sent = [obj if r == self.rank else o for r, o in enumerate(sent)]
        return [loads(pickle.dumps(o)) for o in sent]
