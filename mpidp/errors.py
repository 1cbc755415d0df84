"""Exceptions raised by mpidp."""

from __future__ import annotations

__all__ = ["CollectiveError", "ContractError", "DataParallelError"]


class DataParallelError(Exception):
    """Base class of every error mpidp raises on purpose."""


class ContractError(DataParallelError):
    """A training contract was violated; raised with the same message on every rank.

    Raised before any parameter or gradient byte moves, so the caller's
    arrays are exactly as they were.
    """


class CollectiveError(DataParallelError):
    """MPI itself failed; the ``mpi4py.MPI.Exception`` is the ``__cause__``."""
