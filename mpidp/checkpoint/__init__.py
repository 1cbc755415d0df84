"""Checkpoints any world size resumes: each rank writes its own slices (safetensors), any world size reads them.

``save(dp, folder, params, optimizer=..., extras=...)`` and ``load(dp,
folder, params, optimizer=...)`` are collective; :func:`latest` finds the
newest complete checkpoint, :func:`consolidate` turns one into whole
arrays without MPI (``python -m mpidp.checkpoint export``), and
:class:`StopSignal` turns a batch system's warning signal into a stop that
every rank agrees on at a window boundary.
"""

from .collective import consolidate, latest
from .state import load, save
from .stop import StopSignal

__all__ = ["StopSignal", "consolidate", "latest", "load", "save"]
