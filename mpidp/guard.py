"""Abort the MPI job on an uncaught exception; the collective watchdog; close at exit (MPI through :mod:`mpidp.comm`)."""

from __future__ import annotations

import atexit
import faulthandler
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import comm as _mpi
from .comm import Communicator

__all__ = [
    "DEFAULT_TIMEOUT", "Watchdog", "close_at_exit", "fatal", "forget_at_exit", "install_abort_hook", "resolve_timeout", "timeout_from_env",
    "where_every_rank_is",
]

#: the watchdog's seconds when neither ``timeout=`` nor ``MPIDP_TIMEOUT`` says otherwise: 30 minutes,
#: torch.distributed's default collective timeout, so that no hang is silent by default
DEFAULT_TIMEOUT = 1800.0

_installed = False
#: whether the installed hook aborts: set by every initialize (the latest one's ``abort_on_exception`` wins)
_enabled = True


#: pause between printing an uncaught exception and MPI_Abort
_FORWARD_SECONDS = 0.3


def install_abort_hook(rank: int, enabled: bool = True) -> None:
    """Make an uncaught exception on this rank abort the whole MPI job (or, with ``enabled=False``, not).

    Chains to the hook already installed (which prints the traceback), then
    calls ``MPI_Abort`` so that the other ranks do not wait forever in a
    collective. Installed once per process; every call sets whether it aborts.
    Python does not pass ``SystemExit`` to the hook, nor exceptions of other
    threads: ``python -m mpi4py`` covers the first.
    """
    global _installed, _enabled
    _enabled = enabled
    if _installed or not enabled:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not _enabled:
            previous(kind, value, tb)
            return
        sys.stderr.write(f"mpidp: uncaught {kind.__name__} on rank {rank}; aborting the MPI job\n")
        try:
            previous(kind, value, tb)
        finally:
            sys.stderr.flush()
            # let the launcher forward the traceback before the abort tears the job down (mpiexec
            # drops what it has not read yet); measured: without it the tail is lost now and then
            time.sleep(_FORWARD_SECONDS)
            _mpi.abort(1)

    sys.excepthook = hook
    _installed = True


#: how to close each session not closed yet, in the order they were made (the same on every rank: initialize is collective)
_open: dict[int, Callable[[], None]] = {}
_exit_registered = False
#: the process the sessions belong to: a forked child (a data-loader worker) closes nothing
_owner = os.getpid()


def close_at_exit(session: Any, close: Callable[[], None]) -> None:
    """Call ``close`` when the interpreter exits, if the program has not closed ``session`` (local; the close is collective).

    The close agrees with the other ranks like every other: a rank that
    ends its script while another waits in a ``reduce`` it skipped is one
    ContractError on every rank at once, not a wait for the watchdog. The
    hook is a Python ``atexit`` function: Python runs those before the
    C-level exit functions, among them mpi4py's ``MPI_Finalize``. The
    session is held (strongly: every rank must close the same sessions)
    until :func:`forget_at_exit` says it is closed.
    """
    global _exit_registered, _owner
    _open[id(session)] = close
    _owner = os.getpid()
    if not _exit_registered:
        atexit.register(_close_at_exit)
        _exit_registered = True


def forget_at_exit(session: Any) -> None:
    """The session is closed: nothing to do at exit (local)."""
    _open.pop(id(session), None)


def _close_at_exit() -> None:
    """Close every session still open, the newest first (collective); an error aborts the job, as an uncaught one would."""
    sessions = list(_open.values())[::-1]
    _open.clear()
    if not sessions or os.getpid() != _owner or _mpi.finalized():  # a forked child; MPI finalized by the program
        return
    first: Exception | None = None
    for close in sessions:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - the others are closed still; the first is raised below
            rank = _mpi.world().rank
            sys.stderr.write(f"mpidp: closing a session left open at exit failed on rank {rank}: {type(e).__name__}: {e}\n")
            sys.stderr.flush()
            first = first or e
    if first is None:
        return
    if _installed and _enabled:  # as for an uncaught exception: the job fails, whatever the other ranks do next
        sys.stderr.write(f"mpidp: aborting the MPI job from rank {_mpi.world().rank}\n")
        sys.stderr.flush()
        time.sleep(_FORWARD_SECONDS)
        _mpi.abort(1)
    raise first


def fatal(rank: int, where: str, error: BaseException) -> None:
    """Print ``error``'s traceback and abort the MPI job: a thread of mpidp failed where the collectives cannot finish.

    Unlike :func:`install_abort_hook`, whatever ``abort_on_exception`` says:
    the other ranks would otherwise wait in a collective this rank never ends.
    """
    sys.stderr.write(f"mpidp: {where} failed on rank {rank}; aborting the MPI job\n")
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    time.sleep(_FORWARD_SECONDS)  # as in the abort hook: let the launcher forward the traceback
    _mpi.abort(1)


def timeout_from_env() -> float | None:
    """Read ``MPIDP_TIMEOUT`` (seconds; unset or empty: :data:`DEFAULT_TIMEOUT`; 0: off, None; negative or NaN: an error)."""
    raw = os.environ.get("MPIDP_TIMEOUT", "1800").strip()  # DEFAULT_TIMEOUT, as docs/environment.md says
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"MPIDP_TIMEOUT must be a non-negative number of seconds, got {raw!r}") from e
    if not value >= 0:  # NaN too
        raise ValueError(f"MPIDP_TIMEOUT must be a non-negative number of seconds, got {raw!r}")
    return value if value > 0 else None


def resolve_timeout(timeout: object) -> float | None:
    """The watchdog's seconds from ``timeout=`` (None: ``MPIDP_TIMEOUT``, by default 1800); None when off (0).

    Raises ValueError naming the bad value: a negative number, NaN, or not a number.
    """
    if timeout is None:
        return timeout_from_env()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:  # NaN too
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    try:
        value = float(timeout)
    except OverflowError:  # an int beyond any float: as good as no limit
        value = math.inf
    return value if value > 0 else None


class Watchdog:
    """Abort the job when this rank waits in one mpidp collective longer than ``timeout``.

    Before aborting it prints the operation, the rank, where every rank of
    the job is (the session and operation each is in, asked of the other
    ranks' watchdogs) and every thread's stack to stderr, then waits a
    moment so that every other waiting rank prints its report too. Runs as
    a daemon thread that reads two fields of the communicator and, with
    ``MPI_THREAD_MULTIPLE``, answers the other ranks' watchdogs once per
    poll, so the collective path pays nothing but a timestamp.
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self.comm = comm
        self.timeout = timeout
        self._asks = _mpi.thread_multiple()  # the question where every rank is needs MPI from this thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpidp-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = max(0.01, min(1.0, self.timeout / 4))
        while not self._stop.wait(poll):
            if self._asks:
                self._answer()
            operation, since = self.comm.operation, self.comm.since
            if operation is None:
                continue
            waited = time.monotonic() - since
            if waited < self.timeout or self.comm.operation != operation:
                continue
            sys.stderr.write(
                f"mpidp watchdog: rank {self.comm.rank} has waited {waited:.1f} s in {operation} "
                f"(timeout {self.timeout:g} s); aborting the MPI job.\n"
            )
            sys.stderr.flush()
            grace = min(2.0, self.timeout / 2)  # for the other ranks' answers, then for their own reports
            start = time.monotonic()
            sys.stderr.write(where_every_rank_is(self.comm, self._ask(grace), grace) + "mpidp watchdog: stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            # let the other waiting ranks print their own report before the job goes down
            time.sleep(max(0.5 * grace, grace - (time.monotonic() - start)))
            _mpi.abort(1)

    def _answer(self) -> None:
        """Tell the ranks that asked where this one is (never raises: a failure here only leaves them unanswered)."""
        try:
            self.comm.answer_where()
        except Exception:  # noqa: BLE001, S110 - the watchdog must go on watching
            pass

    def _ask(self, seconds: float) -> list[str | None]:
        """Every rank's place (this one's at least), asked of the others for ``seconds`` where MPI allows it."""
        note = " (MPI has no MPI_THREAD_MULTIPLE: the others were not asked)"
        if self._asks:
            try:
                return self.comm.ask_where(seconds)
            except Exception as e:  # noqa: BLE001 - the report goes on without the others' answers
                note = f" (asking the others failed: {type(e).__name__}: {e})"
        places: list[str | None] = [None] * self.comm.size
        places[self.comm.rank] = self.comm.where() + note
        return places


def where_every_rank_is(comm: Communicator, places: list[str | None], seconds: float) -> str:
    """The watchdog's lines naming where every rank is, from ``places`` (None: no answer within ``seconds``)."""
    lines = [f"mpidp watchdog: where every rank is (rank {comm.rank} asked; each rank's sessions and the operation each is in):\n"]
    for rank, place in enumerate(places):
        if place is None:
            place = f"no answer within {seconds:g} s (its watchdog is off, or its process holds the interpreter or is gone)"
        lines.append(f"mpidp watchdog:   rank {rank}: {place}\n")
    return "".join(lines)
