"""The DataParallel session (core.py): verify_replicas, close, failures, operations out of step, timeouts.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from conftest import clean_env, same_error_everywhere
from mpi4py import MPI
from replicas import grads_for, model

import mpidp
from mpidp import ContractError

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport


def test_verify_replicas(comm: MPI.Comm, dp: Any) -> None:
    dp.verify_replicas()
    if comm.size > 1:
        if comm.rank == comm.size - 1:
            dp.params["bias"][0] += 1
        same_error_everywhere(
            comm, dp.verify_replicas, ContractError, f"replicas differ from root 0 on rank(s) {comm.size - 1}: parameter(s) 'bias'"
        )


def test_verify_replicas_reports_a_parameter_it_cannot_read_on_every_rank(
    comm: MPI.Comm, dp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the parameters fails on one rank only: every rank raises the same error, none waits forever."""
    last = comm.size - 1
    if comm.rank == last:

        def unreadable(v: Any) -> memoryview:
            raise RuntimeError("unreadable storage")

        monkeypatch.setattr(mpidp.layout, "crc_bytes", unreadable)
    same_error_everywhere(
        comm, dp.verify_replicas, ContractError, f"rank {last}: could not read the parameters: RuntimeError: unreadable storage"
    )
    monkeypatch.undo()
    dp.verify_replicas()  # the session is still usable


def test_closed_instance_refuses_reduce(comm: MPI.Comm) -> None:
    params = model(0)
    dp = mpidp.DataParallel.initialize(params, comm)
    dp.close()
    dp.close()  # idempotent
    with pytest.raises(ContractError, match="closed"):
        dp.reduce({}, 1)


def test_library_traffic_does_not_match_user_traffic(comm: MPI.Comm) -> None:
    """A pending user message on the same communicator is not consumed by mpidp."""
    if comm.size > 1:
        req = comm.isend(comm.rank, dest=(comm.rank + 1) % comm.size, tag=0)
    with mpidp.DataParallel.initialize(model(0), comm, frozen=["frozen"]) as dp:
        dp.reduce(grads_for(model(0), np.random.default_rng(0)), 1)
    if comm.size > 1:
        assert comm.recv(source=(comm.rank - 1) % comm.size, tag=0) == (comm.rank - 1) % comm.size
        req.wait()


def test_import_mpidp_imports_no_framework() -> None:
    code = "import sys, mpidp; bad = [m for m in ('torch', 'cupy', 'mpidp.examples') if m in sys.modules]; print(bad); assert not bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())


def test_a_failed_collective_poisons_the_session(comm: MPI.Comm, dp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(buf: Any, operation: str = "Allreduce") -> None:
        raise mpidp.CollectiveError(f"{operation} failed on rank {comm.rank}: simulated")

    import weakref

    grads = grads_for(dp.params, np.random.default_rng(0))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # views kept: the broken session must not hold the arrays
    monkeypatch.setattr(dp._comm, "Allreduce", broken)
    with pytest.raises(mpidp.CollectiveError, match="simulated"):
        dp.reduce(grads, 1)
    monkeypatch.undo()
    with pytest.raises(mpidp.CollectiveError, match="an earlier collective failed"):
        dp.reduce(grads, 1)
    ref = weakref.ref(grads["big"])
    del grads
    assert ref() is None


@pytest.mark.mpi(min_size=2)
def test_ranks_in_different_operations_raise_everywhere(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    last = comm.size - 1
    call = dp.verify_replicas if comm.rank == last else (lambda: dp.reduce(grads, 1))
    same_error_everywhere(
        comm, call, ContractError, f"ranks are in different mpidp operations: rank 0 in reduce, rank {last} in verify_replicas"
    )


CLOSING = "every rank must make the same mpidp calls in the same order"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("operation", ["reduce", "join", "verify_replicas", "broadcast_regions"])
def test_a_rank_in_close_while_others_are_in_another_operation_closes_every_rank(comm: MPI.Comm, operation: str) -> None:
    """``if rank == 0: dp.reduce(...)`` then ``close()``: one ContractError everywhere at once, the session closed everywhere."""
    params = model(100 + comm.rank)
    dp = mpidp.DataParallel.initialize(params, comm, frozen=["frozen"])
    grads = grads_for(params, np.random.default_rng(comm.rank))
    before = {k: v.copy() for k, v in grads.items()}
    calls = {
        "reduce": lambda: dp.reduce(grads, 1),
        "join": lambda: list(dp.join([1, 2])),
        "verify_replicas": dp.verify_replicas,
        "broadcast_regions": lambda: mpidp.core.broadcast_regions(dp, mpidp.checks.NO_REGIONS, "broadcast_buffers"),
    }
    name = "broadcast_buffers" if operation == "broadcast_regions" else operation
    call = calls[operation] if comm.rank == 0 else dp.close
    every = "" if comm.size == 2 else f" (every rank: {name} on rank 0, close on ranks 1-{comm.size - 1})"
    same_error_everywhere(
        comm, call, ContractError, f"ranks are in different mpidp operations: rank 0 in {name}, rank 1 in close{every}; ", CLOSING,
        "the session is now closed on every rank",
    )
    assert dp._closed and dp._comm.comm == MPI.COMM_NULL  # freed on every rank
    assert dp._watchdog is not None and dp._watchdog._stop.is_set()  # the watchdog stopped
    assert all(np.array_equal(before[k], grads[k]) for k in grads)  # nothing moved
    dp.close()  # idempotent: nothing to agree on any more
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, "this DataParallel is closed")


@pytest.mark.mpi(min_size=2)
def test_an_extra_reduce_before_close_is_an_error_at_once(comm: MPI.Comm) -> None:
    """The last rank reduces once more than the others, which close (or leave a ``with`` block): no wait for the watchdog."""
    import time

    last = comm.size - 1
    with mpidp.DataParallel.initialize(model(0), comm, frozen=["frozen"]) as dp:
        grads = grads_for(model(0), np.random.default_rng(0))
        dp.reduce(grads, 1)
        start = time.monotonic()

        def run() -> None:
            with dp:  # __exit__ is the close
                if comm.rank == last:
                    dp.reduce(grads, 1)

        message = same_error_everywhere(comm, run, ContractError, f"rank 0 in close, rank {last} in reduce", CLOSING)
        assert time.monotonic() - start < 5, message
    assert dp._closed


def test_close_agrees_even_alone(comm: MPI.Comm) -> None:
    """A clean close is one agreement, then the frees (every rank in close: no error)."""
    dp = mpidp.DataParallel.initialize(model(0), comm)
    seen: list[str] = []
    exchange = dp._comm.Exchange
    dp._comm.Exchange = lambda record, operation: seen.append(operation) or exchange(record, operation)
    dp.close()
    assert seen == ["close: agreement"]
    assert dp._comm.comm == MPI.COMM_NULL


def test_verify_replicas_compares_with_the_root(comm: MPI.Comm) -> None:
    root = comm.size - 1
    params = model(comm.rank)
    with mpidp.DataParallel.initialize(params, comm, root=root, frozen=["frozen"]) as dp:
        if comm.size > 1:
            if comm.rank == 0:
                params["bias"][0] += 1
            same_error_everywhere(comm, dp.verify_replicas, ContractError, f"replicas differ from root {root} on rank(s) 0: parameter(s) 'bias'")


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_bad_timeout_is_refused_everywhere(comm: MPI.Comm, where: tuple[bool, int], timeout: float) -> None:
    mine, bad = where
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm, timeout=timeout if mine else None), ContractError,
        f"rank {bad}: timeout must be a non-negative number of seconds, got {timeout!r}",
    )


def test_a_timeout_beyond_any_float_means_no_limit(comm: MPI.Comm) -> None:
    import time

    with mpidp.DataParallel.initialize(model(0), comm, timeout=10**400) as dp:
        time.sleep(0.1)
        assert dp._watchdog is not None and dp._watchdog._thread.is_alive()  # watching, never firing
        dp.verify_replicas()


#: MPIDP_TIMEOUT that turns the watchdog off (a name: the docs check reads literal defaults)
OFF = "0"


def test_a_session_is_watched_by_default(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without timeout= or MPIDP_TIMEOUT the watchdog runs with 1800 s; 0 turns it off."""
    monkeypatch.delenv("MPIDP_TIMEOUT", raising=False)
    with mpidp.DataParallel.initialize(model(0), comm) as dp:
        assert dp._watchdog is not None and dp._watchdog.timeout == 1800 and dp._watchdog._thread.is_alive()
        watchdog = dp._watchdog
    watchdog._thread.join(timeout=10)
    assert not watchdog._thread.is_alive()  # close() stops it
    with mpidp.DataParallel.initialize(model(0), comm, timeout=0) as dp:
        assert dp._watchdog is None
    monkeypatch.setenv("MPIDP_TIMEOUT", OFF)
    with mpidp.DataParallel.initialize(model(0), comm) as dp:
        assert dp._watchdog is None


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_bad_timeout_in_the_environment_is_refused_everywhere(
    comm: MPI.Comm, where: tuple[bool, int], value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, bad = where
    if mine:
        monkeypatch.setenv("MPIDP_TIMEOUT", value)
    else:
        monkeypatch.delenv("MPIDP_TIMEOUT", raising=False)
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(model(0), comm), ContractError,
        f"rank {bad}: MPIDP_TIMEOUT must be a non-negative number of seconds, got {value!r}",
    )
