"""The contract between an optimizer and checkpoints: what it saves, what it reads back, how it loads (pure).

Every optimizer a checkpoint holds serves this one contract: mpidp's
sharded optimizers (:class:`mpidp.optim.ShardedOptimizer`, and through it
the torch ones), and the adapter of a replicated ``torch.optim`` optimizer
(:class:`mpidp.torch.checkpoint.TorchOptimizerState`). A checkpoint
(:mod:`mpidp.checkpoint`) uses it in these steps, and in no other way::

    save  1. manifest["optimizer"] = {"kind": kind, "description": describe()}
          2. each rank writes pieces(rank, size): runs of logical tensors
             "state/<state name>/<parameter>", shaped like the parameter
    load  3. the manifest's kind must equal kind (else the load is refused)
          4. wants(description) -> the runs this rank reads (ValueError: refused)
          5. the runs are read and checked, every rank agrees that all went well
          6. prepare(description, values) -> commit (ValueError: refused; nothing changed)
          7. every rank agrees that every rank prepared, then commit() (cannot fail)

Nothing live changes before step 7, so a refused load leaves the
optimizer as it was, on every rank. One key scheme serves every kind:
``state/<state name>/<parameter>`` holds float32 elements of the parameter's
shape, in C order; which runs a rank writes (its owned slice, or its share
of a replicated state) and which it reads (its slice at the new world size,
or the whole) is the optimizer's business.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["OptimizerState", "Piece", "Run", "state_key"]


class Piece(NamedTuple):
    """A run of a logical tensor that this rank writes: elements ``[lo, lo + len(data))`` in C order."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    lo: int
    data: np.ndarray  # 1-D, the tensor's dtype


class Run(NamedTuple):
    """A run of a logical tensor that this rank reads: ``key`` must be ``dtype`` of ``shape`` in the checkpoint."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    lo: int
    hi: int
    out: np.ndarray | None = None  # where to read it (1-D, contiguous, hi - lo elements of dtype); None: a new array


def state_key(state: str, parameter: str) -> str:
    """The key of one optimizer state of one parameter: ``state/<state>/<parameter>``."""
    return f"state/{state}/{parameter}"


class OptimizerState(abc.ABC):
    """What an optimizer gives a checkpoint and takes back from one (the module's steps 1-7)."""

    #: the optimizer's kind: a checkpoint loads only into the same kind
    kind: str = ""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """The JSON-able description a checkpoint keeps: hyperparameters, groups, step counts, scalars (local)."""

    @abc.abstractmethod
    def pieces(self, rank: int, size: int) -> list[Piece]:
        """The runs of state this rank writes, of a checkpoint written by ``size`` ranks (local)."""

    @abc.abstractmethod
    def wants(self, description: Mapping[str, Any]) -> list[Run]:
        """The runs this rank reads to load a checkpoint whose description is ``description``; ValueError if it cannot (local)."""

    @abc.abstractmethod
    def prepare(self, description: Mapping[str, Any], values: Sequence[np.ndarray]) -> Callable[[], None]:
        """Check what was read (``values``: one array per run of :meth:`wants`) and return the commit (local).

        Raises ValueError naming what does not fit; changes nothing itself.
        The commit it returns writes the loaded state and cannot fail.
        """
