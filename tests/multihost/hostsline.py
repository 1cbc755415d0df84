"""pytest plugin of scripts/test-multihost: print ``hosts: <each rank's host>`` before the summary.

Loaded with ``-p hostsline`` (tests/multihost on PYTHONPATH). The names are
gathered once, collectively, when the session starts, and rank 0 prints them
in the terminal summary, so a run's output says where its ranks ran.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

_hosts: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _hosts[:] = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MPI.COMM_WORLD.Get_rank() == 0:
        terminalreporter.write_line(f"hosts: {' '.join(_hosts)}")
