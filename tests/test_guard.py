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
    """What the watchdog reads of a communicator: the operation a rank is in, and since when."""

    rank = 2
    operation: str | None = None
    since = 0.0


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
