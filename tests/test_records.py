"""mpidp.records: the named exchange records and the one agree step (pure: scripted ranks, no MPI).

Every rank of a simulated world runs :func:`agree` on the same exchanged
table; the tests assert that each raises the same error, or none does.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from fakecomm import Table

from mpidp import ContractError, MissingGradientPolicy
from mpidp.comm import loads
from mpidp.contract import Entry, Region
from mpidp.records import (
    CLOSE,
    ERROR,
    INITIALIZE,
    JOIN,
    KIND,
    REGIONS,
    SESSION,
    VERIFY,
    WINDOW,
    Close,
    Frame,
    OperationsDiffer,
    RegionsRecord,
    Setup,
    Verify,
    Window,
    agree,
    first_different,
    regions_disagreement,
)

CONTRACT = (Entry("a", (3,), "float32", True, 0), Entry("b", (2, 2), "float16", False, 1), Entry("c", (3,), "float32", True, 0))
BUFFERS = (Region("m", (4,), "int64", "m"), Region("n", (4,), "int64", "m"))


def setup(**change: Any) -> Setup:
    fields = {"contract": CONTRACT, "root": 0, "chunk_bytes": 4096, "on_host": True, "runs": ((0, 1),), "regions": BUFFERS}
    return Setup(**(fields | change))


def outcomes(size: int, run: Any) -> list[tuple[str, str] | None]:
    """``run(rank)`` on every simulated rank: the error type and message each raised, or None."""
    out = []
    for rank in range(size):
        try:
            run(rank)
            out.append(None)
        except ContractError as e:
            out.append(("ContractError", str(e)))
    return out


def same_everywhere(size: int, run: Any) -> str:
    every = outcomes(size, run)
    assert every[0] is not None and all(o == every[0] for o in every), every
    return every[0][1]


# ------------------------------------------------------------------ initialize


def test_setup_record_is_plain_data_by_name() -> None:
    encoded = setup().encode("oops")
    assert sorted(encoded) == ["chunk_bytes", "contract", "error", "exact", "name", "on_host", "reduction", "regions", "root", "runs"]
    decoded, error = Setup.decode(loads(pickle.dumps(encoded)))  # through the restricted unpickler
    assert decoded == setup() and error == "oops"


def agree_setups(records: list[Setup], errors: list[str | None]) -> str:
    sent = [r.encode(e) for r, e in zip(records, errors)]
    return same_everywhere(len(records), lambda rank: agree(Table(rank, objects=[sent]), records[rank], errors[rank], "init"))


def test_setup_agreement_names_the_first_rank_with_an_error() -> None:
    records = [setup()] * 4
    assert agree_setups(records, [None, None, "bad dtype", "worse"]) == "rank 2: bad dtype"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"root": 1}, "rank 3 broadcasts from root 1, rank 0 from root 0"),
        ({"chunk_bytes": 8192}, "rank 3 uses chunk_bytes=8192, rank 0 chunk_bytes=4096"),
        ({"reduction": "allreduce"}, "rank 3 uses MPIDP_REDUCTION='allreduce', rank 0 MPIDP_REDUCTION='auto'"),
        ({"contract": CONTRACT[:2]}, "rank 3 differs from rank 0: 2 parameters, expected 3 (missing 'c')"),
        ({"regions": BUFFERS[:1]}, "rank 3 differs from rank 0: 1 buffers, rank 0 has 2 (missing 'n')"),
        ({"regions": (BUFFERS[0], Region("n", (4,), "int64", "n"))}, "buffer 'n' is a tensor of its own, on rank 0 the same tensor as 'm'"),
    ],
)
def test_setup_agreement_names_the_first_difference(change: dict[str, Any], message: str) -> None:
    records = [setup()] * 3 + [setup(**change)]
    assert message in agree_setups(records, [None] * 4)


def test_setup_agreement_passes_equal_records_and_returns_them() -> None:
    records = [setup(on_host=r != 2) for r in range(3)]  # on_host and runs are facts to collect, not to agree on
    sent = [r.encode(None) for r in records]
    assert agree(Table(1, objects=[sent]), records[1], None, "init") == records


def test_buffer_differences_come_before_parameter_differences() -> None:
    records = [setup(), setup(root=1, regions=BUFFERS[::-1])]
    assert agree_setups(records, [None, None]) == "rank 1 differs from rank 0: buffer 'n' where rank 0 has 'm'"


# ------------------------------------------------------------------- frames


def window_frames(rows: list[dict[str, Any]], slots: int = 70) -> list[np.ndarray]:
    frame = Frame(Window.body(slots))
    out = []
    for row in rows:
        f = frame.new(row.get("kind", WINDOW))
        presence = np.zeros((slots + 63) // 64, np.uint64)
        presence[0] = row.get("presence", 0)
        Window.fill(f, row.get("step", 0), row.get("policy", 0), row.get("weight", 1), presence)
        f[ERROR] = row.get("error") is not None
        out.append(f)
    return out


def agree_window(rows: list[dict[str, Any]]) -> list[list[int]]:
    frames = window_frames(rows)
    texts = [r.get("error") for r in rows]
    judge = Window.judge(MissingGradientPolicy)
    results = []

    def run(rank: int) -> None:
        results.append(agree(Table(rank, frames, [texts]), frames[rank].copy(), texts[rank], "reduce", judge, Window.AGREED))

    every = outcomes(len(rows), run)
    assert all(o == every[0] for o in every), every
    if every[0] is not None:
        raise ContractError(every[0][1])
    return results[0]


def test_a_frame_starts_with_the_operation_and_the_error_flag() -> None:
    frame = Frame(Window.body(3))
    assert frame.width == 3 + 4 + 1  # kind, error, session; step, policy, weight, the adapter's extra word; one presence word
    f = frame.new(VERIFY)
    assert f.dtype == np.uint64 and f[KIND] == VERIFY and not f[1:].any()


def test_window_facts_are_the_exact_weight_and_the_weighted_presence() -> None:
    rows = agree_window([{"weight": 2**63, "presence": 0b011}, {"weight": 2**63 - 1, "presence": 0b100}, {"weight": 0, "presence": 0b1000}])
    global_weight, presence = Window.facts(rows, 2)
    assert global_weight == 2**64 - 1 and isinstance(global_weight, int)
    assert presence == (0b111, 0)  # the rank with weight 0 adds nothing


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{}, {"kind": VERIFY}], "ranks are in different mpidp operations: rank 0 in reduce, rank 1 in verify_replicas"),
        ([{}, {"kind": REGIONS}, {"error": "x"}], "rank 1 in broadcast_buffers"),
        ([{}, {"error": "no gradient"}, {"error": "later"}], "rank 1: no gradient"),
        ([{"step": 3}, {"step": 3}, {"step": 4}], "rank 2 is at step 3, rank 0 at step 2: a rank skipped or repeated a reduce"),
        ([{"step": 3}, {}], "rank 1 passed no step, rank 0 step 2: pass step= to reduce on every rank or on none"),
        ([{}, {"step": 1}], "rank 1 passed step 0, rank 0 no step: pass step= to reduce on every rank or on none"),
        ([{}, {}, {"policy": 1}], "ranks disagree on the missing-gradient policy: rank 0 uses ERROR, rank 2 uses ZERO"),
        ([{"step": 3, "policy": 1}, {"error": "first"}, {"step": 2}], "rank 1: first"),  # errors before steps
    ],
)
def test_agree_raises_the_same_error_on_every_rank(rows: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ContractError) as info:
        agree_window(rows)
    assert message in str(info.value)


def frames_of(kinds: list[int], at_exit: tuple[int, ...] = ()) -> list[np.ndarray]:
    """One frame per rank of operation ``kinds[rank]``; ranks in ``at_exit`` close at interpreter exit."""
    frame = Frame(Window.body(3))
    out = [frame.new(k) for k in kinds]
    for rank in at_exit:
        out[rank][Close.AT_EXIT] = 1
    return out


def agree_frames(frames: list[np.ndarray]) -> str:
    """The one error every simulated rank raises on ``frames``, checked to be an OperationsDiffer alike on all."""
    judge = Window.judge(MissingGradientPolicy)
    caught: list[OperationsDiffer] = []

    def run(rank: int) -> None:
        try:
            agree(Table(rank, frames, []), frames[rank].copy(), None, "x", judge, Window.AGREED)
        except OperationsDiffer as e:
            caught.append(e)
            raise

    message = same_everywhere(len(frames), run)
    assert len(caught) == len(frames) and len({e.closing for e in caught}) == 1
    return message


@pytest.mark.parametrize(
    ("kinds", "at_exit", "message", "closing"),
    [
        ([WINDOW, CLOSE], (), ("ranks are in different mpidp operations: rank 0 in reduce, rank 1 in close; every rank must make the "
         "same mpidp calls in the same order (did a rank skip a reduce, or call one alone?); the session is now closed on every rank"), True),
        ([CLOSE, CLOSE, CLOSE, WINDOW], (1,), ("rank 0 in close, rank 3 in reduce (every rank: close on ranks 0, 2, "
         "close (at interpreter exit: its script ended) on rank 1, reduce on rank 3)"), True),
        ([WINDOW, WINDOW, WINDOW, CLOSE, WINDOW, VERIFY], (), ("rank 0 in reduce, rank 3 in close (every rank: reduce on ranks 0-2, 4, "
         "close on rank 3, verify_replicas on rank 5)"), True),
        ([JOIN, JOIN, WINDOW], (), ("ranks are in different mpidp operations: rank 0 in join, rank 2 in reduce (every rank: join on "
         "ranks 0-1, reduce on rank 2)"), False),
    ],
)
def test_ranks_in_different_operations_are_each_named(kinds: list[int], at_exit: tuple[int, ...], message: str, closing: bool) -> None:
    text = agree_frames(frames_of(kinds, at_exit))
    assert message in text
    assert ("the session is now closed on every rank" in text) == closing
    assert text == OperationsDiffer([f.tolist() for f in frames_of(kinds, at_exit)]).args[0]


def test_ranks_that_all_close_agree_at_exit_or_not() -> None:
    frames = frames_of([CLOSE, CLOSE, CLOSE], at_exit=(0, 2))  # the flag is the rank's own: it need not be equal
    rows = agree(Table(0, frames, []), frames[0].copy(), None, "close: agreement")
    assert [r[KIND] for r in rows] == [CLOSE] * 3


def test_texts_are_fetched_only_when_a_rank_reported_an_error() -> None:
    frames = window_frames([{}, {}])
    comm = Table(0, frames, [])
    agree(comm, frames[0].copy(), None, "reduce (window 1): exchange", Window.judge(MissingGradientPolicy), Window.AGREED)
    assert comm.calls == ["reduce (window 1): exchange"]  # one small Allgather, no pickles


def test_verify_and_regions_records_by_name() -> None:
    frame = Frame(4).new(VERIFY)
    frame[Verify.CRCS : Verify.CRCS + 3] = [7, 8, 9]
    assert Verify.crcs([frame.tolist(), frame.tolist()], 3).tolist() == [[7, 8, 9], [7, 8, 9]]
    assert RegionsRecord.digest(BUFFERS) == RegionsRecord.digest(tuple(BUFFERS))
    assert RegionsRecord.digest(BUFFERS) != RegionsRecord.digest(BUFFERS[:1])
    rows = [[REGIONS, 0, 0, RegionsRecord.digest(b)] for b in (BUFFERS, BUFFERS, BUFFERS[:1])]
    assert RegionsRecord.differ(rows) and not RegionsRecord.differ(rows[:2])
    sent = [tuple(tuple(r) for r in b) for b in (BUFFERS, BUFFERS[:1])]
    assert regions_disagreement(RegionsRecord.decode(sent)) == "rank 1 differs from rank 0: 1 buffers, rank 0 has 2 (missing 'n')"


def test_first_different() -> None:
    assert first_different([3, 3, 3]) is None
    assert first_different([3, 3, 4, 5]) == 2


def test_the_open_record_divides_only_where_every_rank_gave_a_weight_and_none_is_zero() -> None:
    from mpidp.records import OPEN, OPERATIONS, Open

    def rows(*weights: int | None, closing: tuple[int, ...] = ()) -> list[list[int]]:
        return [[OPEN, 0, 0, 0 if w is None else w + 1, int(r in closing)] for r, w in enumerate(weights)]

    assert Open.divisor(rows(3, 4)) == 7
    assert Open.divisor(rows(3, None)) is None and Open.divisor(rows(3, 0)) is None
    assert Open.closing(rows(1, 1, 1, closing=(1, 2))) == [1, 2]
    assert OPERATIONS[OPEN].startswith("reduce")


def test_the_window_record_carries_the_adapters_extra_word() -> None:
    frame = Frame(Window.body(3)).new(WINDOW)
    Window.fill(frame, 0, 0, 5, np.zeros(1, np.uint64), extra=(7 << 1) | 1)
    assert frame[Window.EXTRA] == 15 and frame[Window.WEIGHT] == 5 and Window.PRESENCE == Window.EXTRA + 1


# ------------------------------------------------------------- several sessions (issue 44)

NAMES = {1: "session 1 ('generator')", 2: "session 2", 3: "session 3 ('critic')"}


def session_frames(cells: list[tuple[int, int]], widths: tuple[int, int] = (3, 3)) -> list[np.ndarray]:
    """One frame per rank of (operation, session); frames of the job's width whatever each session's own."""
    out = []
    for kind, session in cells:
        f = Frame(Window.body(widths[session % 2])).new(kind, Frame(Window.body(max(widths))).width)
        f[SESSION] = session
        out.append(f)
    return out


@pytest.mark.parametrize(
    ("cells", "message", "closes"),
    [
        ([(WINDOW, 1), (WINDOW, 2)], ("ranks are in different mpidp sessions: rank 0 in reduce of session 1 ('generator'), "
         "rank 1 in reduce of session 2; every rank must call the sessions made on one communicator in the same order"), ()),
        ([(WINDOW, 1), (WINDOW, 2), (WINDOW, 2), (WINDOW, 2)], ("rank 0 in reduce of session 1 ('generator'), rank 1 in reduce "
         "of session 2 (every rank: reduce of session 1 ('generator') on rank 0, reduce of session 2 on ranks 1-3)"), ()),
        ([(WINDOW, 2), (WINDOW, 2), (CLOSE, 3)], ("rank 0 in reduce of session 2, rank 2 in close of session 3 ('critic') (every "
         "rank: reduce of session 2 on ranks 0-1, close of session 3 ('critic') on rank 2); every rank must call the sessions made "
         "on one communicator in the same order (each session's calls wait for that session's calls on every other rank); "
         "session 3 ('critic') is now closed on every rank"), (3,)),
        ([(CLOSE, 1), (CLOSE, 3)], "session 1 ('generator') and session 3 ('critic') are now closed on every rank", (1, 3)),
        ([(JOIN, 2), (INITIALIZE, 3)], "rank 0 in join of session 2, rank 1 in initialize of session 3 ('critic')", ()),
    ],
)
def test_ranks_in_different_sessions_are_each_named_with_their_session(
    cells: list[tuple[int, int]], message: str, closes: tuple[int, ...]
) -> None:
    frames = session_frames(cells, (3, 200))
    every = []
    for rank, (_, mine) in enumerate(cells):  # every rank agrees for its own session: the same text, its own closing
        with pytest.raises(OperationsDiffer) as raised:
            agree(Table(rank, frames, [], session=mine, names=NAMES), frames[rank].copy(), None, "x")
        assert raised.value.closes == closes and raised.value.closing == (mine in closes)
        every.append(str(raised.value))
    assert all(t == every[0] for t in every) and message in every[0], every


def test_one_session_in_different_operations_is_named_as_before() -> None:
    """Ranks of one session (in a job of several) keep the text of one session: no session named."""
    frames = session_frames([(WINDOW, 2), (CLOSE, 2)])
    with pytest.raises(OperationsDiffer) as raised:
        agree(Table(0, frames, [], session=2, names=NAMES), frames[0].copy(), None, "x")
    assert str(raised.value).startswith("ranks are in different mpidp operations: rank 0 in reduce, rank 1 in close;")
    assert "session 2" not in str(raised.value) and raised.value.closing


def test_a_narrower_sessions_frame_is_padded_to_the_jobs_width_and_stamped() -> None:
    frames = session_frames([(WINDOW, 1), (WINDOW, 1)], (3, 3))
    comm = Table(0, frames, [], session=1)
    comm.width = frames[0].size
    narrow = Frame(1).new(WINDOW)
    rows = agree(comm, narrow, None, "x")
    assert len(rows[0]) == comm.width and rows[0][SESSION] == 1


def test_a_setup_names_a_rank_that_passes_another_name() -> None:
    assert Setup.disagreement([setup(name="g"), setup(name="g"), setup(name="d")]) == (
        "rank 2 passes name='d', rank 0 name='g': every rank must pass the same"
    )
