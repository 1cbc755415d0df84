"""mpidp.guard: the abort hook and the collective watchdog (pure: MPI's abort replaced by a recorder).

The real thing, in real jobs, is tests/test_faults.py.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from mpidp import guard


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record what would have aborted the job."""
    seen: list[int] = []
    monkeypatch.setattr(guard._mpi, "abort", seen.append)
    monkeypatch.setattr(guard, "_FORWARD_SECONDS", 0)
    return seen


@pytest.mark.parametrize(("value", "seconds"), [(None, 1800.0), (0, None), (2, 2.0), (0.5, 0.5), (10**400, float("inf"))])
def test_resolve_timeout(value: Any, seconds: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPIDP_TIMEOUT", raising=False)
    assert guard.resolve_timeout(value) == seconds


@pytest.mark.parametrize("value", [-1, float("nan"), "3", True])
def test_resolve_timeout_names_a_bad_value(value: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a non-negative number of seconds"):
        guard.resolve_timeout(value)


@pytest.mark.parametrize(("raw", "seconds"), [("", 1800.0), (" ", 1800.0), (" 0 ", None), ("0.0", None), ("2.5", 2.5)])
def test_timeout_from_env(raw: str, seconds: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIDP_TIMEOUT", raw)
    assert guard.timeout_from_env() == seconds


#: MPIDP_TIMEOUT that turns the watchdog off (a name: the docs check reads literal defaults)
OFF = "0"


def test_the_watchdog_is_on_by_default_for_30_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hang is silent by default: unset, the limit is torch.distributed's default collective timeout."""
    monkeypatch.delenv("MPIDP_TIMEOUT", raising=False)
    assert guard.timeout_from_env() == guard.DEFAULT_TIMEOUT == 1800
    assert guard.resolve_timeout(None) == 1800
    monkeypatch.setenv("MPIDP_TIMEOUT", OFF)
    assert guard.resolve_timeout(None) is None
    assert guard.resolve_timeout(0) is None


@pytest.mark.parametrize("raw", ["-1", "nan", "soon"])
def test_timeout_from_env_names_a_bad_value(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIDP_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"MPIDP_TIMEOUT must be a non-negative number of seconds, got '{raw}'"):
        guard.timeout_from_env()


def test_the_abort_hook_prints_then_aborts_and_can_be_turned_off(
    aborts: list[int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    printed: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(kind))
    monkeypatch.setattr(guard, "_installed", False)
    guard.install_abort_hook(3)
    sys.excepthook(KeyError, KeyError("x"), None)
    assert printed == [KeyError] and aborts == [1]  # the previous hook first, then the abort
    assert "mpidp: uncaught KeyError on rank 3; aborting the MPI job" in capsys.readouterr().err
    guard.install_abort_hook(3, enabled=False)  # the latest session decides
    sys.excepthook(ValueError, ValueError("y"), None)
    assert printed == [KeyError, ValueError] and aborts == [1]


class Waiting:
    """What the watchdog reads of a communicator: the operation a rank is in, and since when; where the others are."""

    rank = 2
    size = 4
    operation: str | None = None
    since = 0.0
    answered = 0

    def where(self) -> str:
        return f"session 1: {self.operation}"

    def answer_where(self) -> None:
        self.answered += 1

    def ask_where(self, seconds: float) -> list[str | None]:
        return ["session 2 ('critic'): close: agreement, for 3.0 s", "in no mpidp collective", self.where(), None]


def test_the_watchdog_aborts_a_rank_that_waits_too_long(aborts: list[int], capfd: pytest.CaptureFixture[str]) -> None:
    comm = Waiting()
    dog = guard.Watchdog(comm, 0.05)  # type: ignore[arg-type]
    try:
        time.sleep(0.2)
        assert aborts == []  # in no collective: nothing to watch
        comm.since, comm.operation = time.monotonic(), "reduce (window 4): exchange"
        deadline = time.monotonic() + 10
        while not aborts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert aborts[:1] == [1]
        err = capfd.readouterr().err
        assert "mpidp watchdog: rank 2 has waited" in err and "in reduce (window 4): exchange" in err
        assert comm.answered > 0 or not guard._mpi.thread_multiple()  # it answered the others' watchdogs meanwhile
        if guard._mpi.thread_multiple():  # every rank's place, as the others answered
            assert "mpidp watchdog:   rank 0: session 2 ('critic'): close: agreement, for 3.0 s" in err
            assert "mpidp watchdog:   rank 1: in no mpidp collective" in err
            assert "mpidp watchdog:   rank 2: session 1: reduce (window 4): exchange" in err
            assert "mpidp watchdog:   rank 3: no answer within 0.025 s" in err
        assert err.index("where every rank is") < err.index("stacks:")
    finally:
        comm.operation = None
        dog.close()
        dog._thread.join(timeout=10)  # before the real abort is put back


def test_a_closed_watchdog_stops_its_thread() -> None:
    dog = guard.Watchdog(Waiting(), 0.04)  # type: ignore[arg-type]
    dog.close()
    dog._thread.join(timeout=5)
    assert not dog._thread.is_alive()
    assert not any(t.name == "mpidp-watchdog" and t is dog._thread for t in threading.enumerate())


# ------------------------------------------------------------- close at exit


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch, aborts: list[int]) -> list[str]:
    """An empty table of open sessions, restored afterwards; the MPI calls of the exit hook replaced."""
    monkeypatch.setattr(guard, "_open", {})
    monkeypatch.setattr(guard, "_exit_registered", True)  # the real process's hook stays as it is
    monkeypatch.setattr(guard._mpi, "finalized", lambda: False)
    monkeypatch.setattr(guard._mpi, "world", lambda: guard._mpi.World(1, 2, "test"))
    return []


class Session:
    def __init__(self, name: str, closed: list[str], fails: bool = False) -> None:
        self.name, self.closed, self.fails = name, closed, fails
        guard.close_at_exit(self, self.close)

    def close(self) -> None:
        self.closed.append(self.name)
        guard.forget_at_exit(self)
        if self.fails:
            raise guard._mpi.ContractError(f"{self.name} met a rank in reduce")


def test_sessions_left_open_are_closed_at_exit_newest_first(sessions: list[str], aborts: list[int]) -> None:
    a, b, c = Session("a", sessions), Session("b", sessions), Session("c", sessions)
    b.close()  # closed by the program: not again at exit
    guard._close_at_exit()
    assert sessions == ["b", "c", "a"] and not guard._open and not aborts
    assert [a, c]  # (held until then: every rank must close the same sessions)


def test_an_error_at_exit_closes_the_others_then_aborts_as_an_uncaught_one_would(
    sessions: list[str], aborts: list[int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(guard, "_installed", True)
    monkeypatch.setattr(guard, "_enabled", True)
    Session("a", sessions), Session("b", sessions, fails=True)
    with pytest.raises(guard._mpi.ContractError):  # (the real abort does not return)
        guard._close_at_exit()
    assert sessions == ["b", "a"] and aborts == [1]
    err = capsys.readouterr().err
    assert "mpidp: closing a session left open at exit failed on rank 1: ContractError: b met a rank in reduce" in err
    assert "mpidp: aborting the MPI job from rank 1" in err


def test_without_the_abort_hook_an_error_at_exit_is_raised(sessions: list[str], aborts: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "_enabled", False)
    Session("a", sessions, fails=True), Session("b", sessions)
    with pytest.raises(guard._mpi.ContractError, match="a met a rank in reduce"):  # atexit prints it
        guard._close_at_exit()
    assert sessions == ["b", "a"] and not aborts


def test_nothing_is_closed_at_exit_once_mpi_is_finalized(sessions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard._mpi, "finalized", lambda: True)
    Session("a", sessions)
    guard._close_at_exit()
    assert sessions == [] and not guard._open


def test_a_forked_child_closes_nothing_at_exit(sessions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A data-loader worker forked from a rank inherits the exit hook, and must not call MPI."""
    Session("a", sessions)
    monkeypatch.setattr(guard, "_owner", guard._owner + 1)
    guard._close_at_exit()
    assert sessions == []
