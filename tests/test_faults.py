"""Faults in a real job: plain ``mpiexec -n 4 python script.py`` never hangs.

Each case starts its own 4-rank job in a subprocess with a hard timeout, so
these tests run in the serial session only (a world of one).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env
from mpi4py import MPI

SCRIPT = Path(__file__).with_name("faults") / "train.py"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")


def job(mode: str, *, timeout: float = 60, **env: str) -> tuple[int, str, float]:
    """Run the fault script on 4 ranks; return (exit code, output, seconds from the fault to the end)."""
    start = time.time()
    p = subprocess.run(
        [MPIEXEC, "-n", "4", sys.executable, str(SCRIPT), mode],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        env=clean_env(**env),
    )
    end = time.time()
    # mpiexec may join two ranks' lines ("... at 1796397172.629rank 1: done"): take the time itself
    fault = [float(t) for t in re.findall(r"rank \d+: [^\n]*? at (\d+\.\d{3})", p.stdout)]
    return p.returncode, p.stdout, end - (fault[0] if fault else start)


def test_a_clean_job_exits_zero() -> None:
    code, out, _ = job("ok")
    assert code == 0, out
    assert out.count("done") == 4


def test_uncaught_exception_on_one_rank_aborts_the_job() -> None:
    code, out, after = job("raise")
    assert code != 0, out
    assert "mpidp: uncaught RuntimeError on rank 2; aborting the MPI job" in out
    assert "boom outside mpidp" in out  # that rank's traceback
    assert after <= 5, f"the job took {after:.1f} s to end after the exception"


def test_a_rank_killed_mid_training_ends_the_job() -> None:
    code, out, after = job("kill")
    assert code != 0, out
    assert "done" not in out
    assert after <= 10, f"the job took {after:.1f} s to end after the kill"


def test_watchdog_aborts_a_rank_that_skipped_a_reduce() -> None:
    code, out, after = job("skip", MPIDP_TIMEOUT="3")
    assert code != 0, out
    for rank in (0, 1, 2):  # every waiting rank reports where it waits
        assert re.search(rf"mpidp watchdog: rank {rank} has waited [\d.]+ s in reduce \(window 6\): exchange", out), out
    assert "Thread" in out and "train.py" in out  # the stacks
    assert after <= 3 + 5, f"the job took {after:.1f} s to end after the skip"
    # where every rank is, as the other ranks' watchdogs answered (rank 3 waits in the user's own barrier)
    assert re.search(r"mpidp watchdog:   rank 0: session 1: reduce \(window 6\): exchange, for [\d.]+ s", out), out
    assert "mpidp watchdog:   rank 3: in no mpidp collective" in out, out


#: the text every rank raises when rank 0 and the others call two sessions in different orders
SESSIONS = (
    "ContractError: ranks are in different mpidp sessions: rank 0 in {0} of session {1}, rank 1 in {2} of session {3} "
    "(every rank: {0} of session {1} on rank 0, {2} of session {3} on ranks 1-3); every rank must call the sessions"
)


def test_two_sessions_called_in_different_orders_are_one_error_everywhere_at_once() -> None:
    """Issue 44's job: rank 0 reduces the generator first, the others the critic: no wait for the watchdog."""
    code, out, after = job("sessions", MPIDP_TIMEOUT="600")
    assert code != 0, out
    assert re.search(r"mpidp: uncaught ContractError on rank \d; aborting the MPI job", out), out
    assert SESSIONS.format("reduce", "1 ('generator')", "reduce", "2 ('critic')") in out, out
    assert "watchdog" not in out, out
    assert after <= 5, f"the job took {after:.1f} s to end after the swap"


def test_a_script_that_ends_while_the_others_reduce_another_session_closes_it_everywhere() -> None:
    """Rank 0 closes the critic at exit while the others wait in the generator's reduce."""
    code, out, after = job("sessions-exit", MPIDP_TIMEOUT="600")
    assert code != 0, out
    closing = "close (at interpreter exit: its script ended)"
    assert SESSIONS.format(closing, "2 ('critic')", "reduce", "1 ('generator')") in out, out
    assert "session 2 ('critic') is now closed on every rank" in out, out
    assert "watchdog" not in out, out
    assert after <= 5, f"the job took {after:.1f} s to end after rank 0's script ended"


@pytest.mark.parametrize(("mode", "reducing"), [("extra", 3), ("one", 0)])
def test_a_reduce_the_others_do_not_make_before_close_is_one_error_everywhere_at_once(mode: str, reducing: int) -> None:
    """One rank reduces once more, the others close: every rank raises the same ContractError, long before the watchdog."""
    code, out, after = job(mode, MPIDP_TIMEOUT="600")
    assert code != 0, out
    closing = 1 if reducing == 0 else 0
    first, second = sorted([(reducing, "reduce"), (closing, "close")])
    where = f"rank {first[0]} in {first[1]}, rank {second[0]} in {second[1]}"
    assert re.search(r"mpidp: uncaught ContractError on rank \d; aborting the MPI job", out), out  # the first to abort ends the job
    assert f"ContractError: ranks are in different mpidp operations: {where}" in out, out
    assert "the session is now closed on every rank" in out, out
    assert "watchdog" not in out, out
    assert after <= 5, f"the job took {after:.1f} s to end after the extra reduce"


def test_a_script_that_ends_while_another_rank_reduces_is_one_error_everywhere_at_once() -> None:
    """The session left open is closed at interpreter exit, and that close agrees with rank 3's extra reduce."""
    code, out, after = job("exit", MPIDP_TIMEOUT="600")
    assert code != 0, out
    where = "rank 0 in close (at interpreter exit: its script ended), rank 3 in reduce"
    assert "mpidp: uncaught ContractError on rank 3; aborting the MPI job" in out, out
    assert f"ContractError: ranks are in different mpidp operations: {where}" in out, out
    assert re.search(r"mpidp: closing a session left open at exit failed on rank [012]: ContractError: ranks are in different", out), out
    assert "watchdog" not in out, out
    assert after <= 5, f"the job took {after:.1f} s to end after the extra reduce"


def test_a_session_left_open_is_closed_at_exit_before_mpi_is_finalized() -> None:
    code, out, _ = job("exit-clean")
    assert code == 0, out
    assert out.count("at exit closed=True freed=True") == 4, out
    assert "mpidp:" not in out, out


def test_nothing_is_closed_at_exit_after_the_program_finalized_mpi_itself() -> None:
    code, out, _ = job("finalize-first")
    assert code == 0, out
    assert out.count("done, not closed") == 4, out
    assert "mpidp:" not in out and "Traceback" not in out, out


@pytest.mark.parametrize("mode", ["late", "raise-early"])
def test_watchdog_is_armed_while_initialize_waits(mode: str) -> None:
    """The session's first collective (the Dup of the user's communicator) is watched too."""
    code, out, after = job(mode, MPIDP_TIMEOUT="3")
    assert code != 0, out
    for rank in (0, 1, 2):
        assert re.search(rf"mpidp watchdog: rank {rank} has waited [\d.]+ s in initialize: MPI_Comm_dup", out), out
    assert after <= 3 + 5, f"the job took {after:.1f} s to end after rank 3's {mode}"


@pytest.mark.parametrize(
    ("mode", "operation"),
    [
        # the PyTorch adapter's own collectives (its buffers) are watched like the core's
        ("skip-buffers", r"broadcast_buffers: agreement"),
        # overlap="hooks": the exchange that opens the window before its first bucket, under the session's watchdog
        ("skip-overlap", r"reduce \(window 1\): open"),
        # overlap='thread': the thread's blocking calls are watched by the buckets' own watchdog (the session's timeout)
        ("skip-overlap-thread", r"reduce: Allreduce \(communication thread\)"),
    ],
)
def test_watchdog_aborts_ranks_left_waiting_by_a_torch_rank(mode: str, operation: str) -> None:
    """Rank 3 skips what the others wait in: the watchdog ends the job, every waiting rank naming the operation."""
    pytest.importorskip("torch")
    code, out, after = job(mode, MPIDP_TIMEOUT="3")
    assert code != 0, out
    for rank in (0, 1, 2):
        assert re.search(rf"mpidp watchdog: rank {rank} has waited [\d.]+ s in {operation}", out), out
    if mode == "skip-overlap-thread":
        assert "mpidp-communication" in out or "_serve" in out, out  # the stacks show the thread
    assert after <= 3 + 5, f"the job took {after:.1f} s to end after the skip"


def test_an_mpi_failure_in_the_communication_thread_aborts_the_job_with_its_traceback() -> None:
    pytest.importorskip("torch")
    code, out, after = job("thread-mpi-error", MPIDP_TIMEOUT="60")
    assert code != 0, out
    assert "mpidp: the communication thread's Allreduce failed on rank 3; aborting the MPI job" in out, out
    assert "CollectiveError: MPI_Allreduce failed on rank 3: injected" in out, out
    assert after <= 10, f"the job took {after:.1f} s to end after the failure"


def test_the_latest_session_decides_whether_an_exception_aborts(tmp_path: Path) -> None:
    """A session with abort_on_exception=False after a closed default one: an exception is a plain traceback."""
    script = tmp_path / "later.py"
    script.write_text(
        "import numpy as np, mpidp\n"
        "mpidp.DataParallel.initialize({'w': np.zeros(3, np.float32)}).close()\n"
        "dp = mpidp.DataParallel.initialize({'w': np.zeros(3, np.float32)}, abort_on_exception=False)\n"
        "raise RuntimeError('plain failure')\n"
    )
    # each rank's stderr in a file of its own: two tracebacks written at once through mpiexec interleave mid-line
    mpich = MPI.get_vendor()[0] == "MPICH"
    split = ["-errfile-pattern", str(tmp_path / "err-%r.txt")] if mpich else []
    p = subprocess.run([MPIEXEC, "-n", "2", *split, sys.executable, str(script)], check=False, capture_output=True, text=True,
                       timeout=60, env=clean_env())
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    errs = [(tmp_path / f"err-{r}.txt").read_text() for r in range(2)] if mpich else [out]
    for err in errs:  # every rank raised the plain exception, with its plain traceback
        assert err.count("RuntimeError: plain failure") == (1 if mpich else 2), errs
        assert "mpidp: uncaught" not in err, errs


def test_abort_hook_can_be_turned_off(tmp_path: Path) -> None:
    """With abort_on_exception=False a single-rank script just raises (exit 1, normal traceback)."""
    script = tmp_path / "off.py"
    script.write_text(
        "import numpy as np, mpidp, sys\n"
        "dp = mpidp.DataParallel.initialize({'w': np.zeros(3, np.float32)}, abort_on_exception=False)\n"
        "print('hooked' if sys.excepthook is not sys.__excepthook__ else 'not hooked')\n"
    )
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], check=False, capture_output=True, text=True,
                       timeout=60, env=clean_env())
    assert p.returncode == 0 and p.stdout.count("not hooked") == 2, p.stdout + p.stderr
