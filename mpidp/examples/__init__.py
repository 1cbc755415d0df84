"""Runnable examples: ``mpiexec -n 4 python -m mpi4py -m mpidp.examples.<name>``."""

from __future__ import annotations

import argparse
import contextlib
import io

from mpi4py import MPI


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line on every rank; only rank 0 of the world prints ``--help`` or an error.

    Every rank parses the same arguments, so every rank stops at the same point, none waits for the others: after
    ``--help`` each exits with 0; after an error rank 0 exits with argparse's status 2 (under ``python -m mpi4py``
    that aborts the job with status 2) and the other ranks quietly with 0, so that the job prints the message once,
    not once per rank (each aborting rank would add a line of its own).
    """
    if MPI.COMM_WORLD.Get_rank() == 0:
        return parser.parse_args(argv)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        raise SystemExit(0) from None
