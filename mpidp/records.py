"""Every record the ranks exchange, named, and the one agree step every collective operation takes.

A session's first exchange is the :class:`Setup` record of ``initialize``,
pickled (plain data only: a dict of named fields). Every later operation
exchanges one fixed-size frame of unsigned 64-bit words, the same length
for every operation of the session, so that ranks in different operations
still match in MPI and learn that they are::

    word 0   KIND     which operation: WINDOW (reduce), VERIFY, REGIONS (broadcast_buffers), JOIN, CLOSE,
                      OPEN (an overlapped window, before its first bucket call), INITIALIZE (a new session),
                      OPTIMIZER (a sharded optimizer's agreement: mpidp.optim),
                      SAVE, LOAD, STOP (a checkpoint's steps and a stop request: mpidp.checkpoint)
    word 1   ERROR    1 when this rank found an error before the exchange
    word 2   SESSION  which session of the job (its number, 1, 2, ... in the order they were made; 0: none)
    word 3.. body     the operation's own fields, named by its class (:class:`Window`, ...)

Every session over the same ranks exchanges its frames on one communicator
of the job (:class:`mpidp.comm.Job`), each as wide as the widest session's,
so that ranks in different sessions' operations also match in MPI and learn
that they are: the same :class:`OperationsDiffer`, naming the sessions.

:func:`agree` is the step between checking locally and moving bytes: it
exchanges the records and raises the same ContractError on every rank when
ranks are in different operations, any rank reported an error (the first
such rank's text; a frame fetches the texts only then), or the records
disagree on what must be equal. After it returns no rank can diverge.
Ranks in different operations raise :class:`OperationsDiffer`, which names
every rank's operation (and session) and says whether one of them is ``close``: then the
session closes on every rank (``close`` takes part in the agreement so that
a rank that skipped or added a call is an error at once, not a hang).
Everything but :func:`agree` is pure: tests build tables by hand.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from .contract import Contract, Entry, Region, Regions, diff, diff_regions
from .errors import ContractError

if TYPE_CHECKING:
    from .comm import Communicator

__all__ = [
    "CLOSE", "INITIALIZE", "JOIN", "LOAD", "OPEN", "OPTIMIZER", "REGIONS", "SAVE", "SESSION", "STOP", "U64_MAX", "VERIFY", "WINDOW",
    "Close", "Frame", "Join", "Open", "OperationsDiffer",
    "RegionsRecord", "Setup", "Verify", "Window", "agree", "regions_disagreement",
]

U64_MAX = (1 << 64) - 1
#: operation kinds (word 0 of a frame)
WINDOW, VERIFY, REGIONS, JOIN, CLOSE, OPEN, INITIALIZE = 1, 2, 3, 4, 5, 6, 7
OPTIMIZER = 8  # a sharded optimizer's agreement (mpidp.optim): its description's digest in word BODY
SAVE, LOAD, STOP = 9, 10, 11  # a checkpoint's steps and a stop request (mpidp.checkpoint)
OPERATIONS = {
    WINDOW: "reduce", VERIFY: "verify_replicas", REGIONS: "broadcast_buffers", JOIN: "join", CLOSE: "close",
    OPEN: "reduce (starting its overlapped buckets)", INITIALIZE: "initialize",
    OPTIMIZER: "a sharded optimizer's agreement",
    SAVE: "checkpoint save", LOAD: "checkpoint load", STOP: "checkpoint stop request",
}
#: the words every frame starts with
KIND, ERROR, SESSION, BODY = 0, 1, 2, 3

Rows = list[list[int]]
#: judges a table every rank holds alike: what the ranks disagree on, or None
Judge = Callable[[Rows], "str | None"]


# ------------------------------------------------------------------ initialize


@dataclass(frozen=True)
class Setup:
    """What one rank brings to ``initialize``: every rank must bring the same, or say why it cannot."""

    contract: Contract
    root: int
    chunk_bytes: int
    #: whether this rank's arrays are host memory (the broadcast plan depends on every rank's)
    on_host: bool
    #: runs of adjacent host memory (:func:`mpidp.layout.runs`), None where there are none to use
    runs: tuple[tuple[int, ...], ...] | None
    #: named byte regions moved with the parameters (the torch adapter's buffers)
    regions: Regions = ()
    #: how host calls are summed (``MPIDP_REDUCTION``): every rank must choose alike
    reduction: str = "auto"
    #: the exact reduction (:mod:`mpidp.exact`): every rank must choose alike
    exact: bool = False
    #: the name the user gave the session (``initialize(..., name=)``), in the errors that name it; every rank's alike
    name: str | None = None

    def encode(self, error: str | None) -> dict[str, Any]:
        """Plain data by field name, with this rank's error (the restricted unpickler admits nothing else)."""
        out = {name: getattr(self, name) for name in SETUP_FIELDS}
        out["contract"] = tuple(tuple(e) for e in self.contract)
        out["regions"] = tuple(tuple(r) for r in self.regions)
        out["error"] = error
        return out

    @classmethod
    def decode(cls, data: dict[str, Any]) -> tuple[Setup, str | None]:
        """The record and the error a rank sent."""
        values = {name: data[name] for name in SETUP_FIELDS}
        values["contract"] = tuple(Entry(*e) for e in data["contract"])
        values["regions"] = tuple(Region(*r) for r in data["regions"])
        return cls(**values), data["error"]

    @staticmethod
    def disagreement(records: Sequence[Setup]) -> str | None:
        """The first rank that differs from rank 0, named with what differs (regions first), or None."""
        head = records[0]
        why = regions_disagreement([r.regions for r in records])
        if why is not None:
            return why
        for rank, r in enumerate(records):
            difference = diff(head.contract, r.contract)
            if difference is not None:
                return f"rank {rank} differs from rank 0: {difference}"
            if r.root != head.root:
                return f"rank {rank} broadcasts from root {r.root}, rank 0 from root {head.root}"
            if r.chunk_bytes != head.chunk_bytes:
                return f"rank {rank} uses chunk_bytes={r.chunk_bytes}, rank 0 chunk_bytes={head.chunk_bytes}"
            if r.reduction != head.reduction:
                return f"rank {rank} uses MPIDP_REDUCTION={r.reduction!r}, rank 0 MPIDP_REDUCTION={head.reduction!r}"
            if r.exact != head.exact:
                return f"rank {rank} passes exact={r.exact}, rank 0 exact={head.exact}: every rank must pass the same"
            if r.name != head.name:
                return f"rank {rank} passes name={r.name!r}, rank 0 name={head.name!r}: every rank must pass the same"
        return None


SETUP_FIELDS = tuple(f.name for f in fields(Setup))


def regions_disagreement(everyone: Sequence[Regions]) -> str | None:
    """The first rank whose named regions differ from rank 0's, named with what differs, or None."""
    for rank, regions in enumerate(everyone):
        difference = diff_regions(everyone[0], regions)
        if difference is not None:
            return f"rank {rank} differs from rank 0: {difference}"
    return None


# -------------------------------------------------------------- fixed frames


class Frame:
    """A session's fixed-size exchange record; ``body`` words fit the largest operation's fields."""

    def __init__(self, body: int) -> None:
        self.width = BODY + body

    def new(self, kind: int, width: int = 0) -> np.ndarray:
        """A zeroed frame of operation ``kind``, at least ``width`` words (the job's frame width)."""
        frame = np.zeros(max(self.width, width), dtype=np.uint64)
        frame[KIND] = kind
        return frame


class Window:
    """The reduce record: the caller's step and the policy (every rank's must be equal), weight, presence bits.

    The STEP word is 0 when the caller passed no step, else step + 1. Each
    rank numbers its own reduce calls, so only a number the caller counts
    (``reduce(..., step=)``) can tell that a rank skipped or repeated one.
    """

    #: EXTRA: a word of the adapter's own, each rank's returned as it is (the overlapped window's calls and redo mark)
    STEP, POLICY, WEIGHT, EXTRA, PRESENCE = BODY, BODY + 1, BODY + 2, BODY + 3, BODY + 4
    #: frame words ``[0, AGREED)`` are equal on every rank of a window that goes ahead
    AGREED = BODY + 2

    @staticmethod
    def body(slots: int) -> int:
        """Body words for ``slots`` reduction slots."""
        return 4 + (slots + 63) // 64

    @staticmethod
    def fill(frame: np.ndarray, step: int, policy: int, weight: int, presence: np.ndarray, extra: int = 0) -> None:
        """Write this rank's window record into a WINDOW ``frame`` (``step``: the STEP word)."""
        frame[Window.STEP] = step
        frame[Window.POLICY] = policy
        frame[Window.WEIGHT] = weight
        frame[Window.EXTRA] = extra
        frame[Window.PRESENCE : Window.PRESENCE + presence.size] = presence

    @staticmethod
    def judge(policies: Callable[[int], Any]) -> Judge:
        """The judge of a window table whose agreed words differ: ranks at different steps, then policies."""

        def disagreement(rows: Rows) -> str | None:
            other = first_different([r[Window.STEP] for r in rows])
            if other is not None:
                mine, theirs = rows[0][Window.STEP], rows[other][Window.STEP]
                if mine and theirs:
                    return (
                        f"rank {other} is at step {theirs - 1}, rank 0 at step {mine - 1}: "
                        "a rank skipped or repeated a reduce"
                    )
                return (
                    f"rank {other} passed {_step(theirs)}, rank 0 {_step(mine)}: "
                    "pass step= to reduce on every rank or on none"
                )
            other = first_different([r[Window.POLICY] for r in rows])
            if other is None:
                return None
            return (
                f"ranks disagree on the missing-gradient policy: rank 0 uses {policies(rows[0][Window.POLICY]).name}, "
                f"rank {other} uses {policies(rows[other][Window.POLICY]).name}"
            )

        return disagreement

    @staticmethod
    def facts(rows: Rows, words: int) -> tuple[int, tuple[int, ...]]:
        """The exact global weight, and the presence words OR-ed over the ranks with a weight."""
        global_weight = sum(r[Window.WEIGHT] for r in rows)  # exact: Python ints
        bits = [0] * words
        for r in rows:
            if r[Window.WEIGHT]:
                bits = [a | b for a, b in zip(bits, r[Window.PRESENCE : Window.PRESENCE + words])]
        return global_weight, tuple(bits)

    @staticmethod
    def present(key: Sequence[int], slots: int) -> list[bool]:
        """Presence words ``key`` as one flag per slot."""
        return np.unpackbits(np.array(key, dtype=np.uint64).view(np.uint8), count=slots).astype(bool).tolist()


def _step(word: int) -> str:
    return f"step {word - 1}" if word else "no step"


class Open:
    """The record that opens an overlapped window before its first bucket call: what the ranks know before backward.

    WEIGHT is 0 when the rank gave no weight before backward, else weight + 1;
    CLOSING is 1 when the rank opens the window only to close the session.
    Ranks in another operation meet this record in their own exchange, so no
    bucket call ever waits for a rank that is elsewhere.
    """

    WEIGHT, CLOSING = BODY, BODY + 1

    @staticmethod
    def divisor(rows: Rows) -> int | None:
        """The global weight when every rank gave its weight before backward and none is 0, else None."""
        weights = [r[Open.WEIGHT] for r in rows]
        if all(w > 1 for w in weights):
            return sum(w - 1 for w in weights)
        return None

    @staticmethod
    def closing(rows: Rows) -> list[int]:
        """The ranks that opened the window to close the session."""
        return [rank for rank, r in enumerate(rows) if r[Open.CLOSING]]


class Verify:
    """The verify_replicas record: a CRC-32 of every tie-group head's bytes, in contract order."""

    CRCS = BODY

    @staticmethod
    def crcs(rows: Rows, heads: int) -> np.ndarray:
        """The ``(ranks, heads)`` table of CRCs."""
        return np.array([r[Verify.CRCS : Verify.CRCS + heads] for r in rows], dtype=np.uint64).reshape(len(rows), heads)


class Join:
    """The join record: whether this rank still has a batch (ranks differ there: that is the question)."""

    HAS = BODY

    @staticmethod
    def any(rows: Rows) -> bool:
        """Whether some rank still has a batch."""
        return any(r[Join.HAS] for r in rows)


class Close:
    """The close record: whether this rank closes at interpreter exit (its script ended) or was asked to."""

    AT_EXIT = BODY


class RegionsRecord:
    """The broadcast_buffers record: a digest of the named regions every rank must hold alike."""

    DIGEST = BODY

    @staticmethod
    def digest(regions: Regions) -> int:
        """A 64-bit digest of the region entries: equal entries, equal digests."""
        data = pickle.dumps(tuple(tuple(r) for r in regions), protocol=4)
        return (zlib.crc32(data) << 32) | zlib.adler32(data)

    @staticmethod
    def differ(rows: Rows) -> bool:
        """Whether some rank's digest differs from rank 0's (then the entries are fetched to name it)."""
        return first_different([r[RegionsRecord.DIGEST] for r in rows]) is not None

    @staticmethod
    def decode(sent: Sequence[Any]) -> list[Regions]:
        """Every rank's region entries, as :func:`regions_disagreement` compares them."""
        return [tuple(Region(*r) for r in regions) for regions in sent]


# ---------------------------------------------------------------- agreement


def agree(
    comm: Communicator, mine: Any, error: str | None, operation: str, judge: Judge | None = None, agreed: int = BODY
) -> Any:
    """Exchange this rank's record; raise the same ContractError on every rank unless the ranks are in step.

    Collective: every rank must call it. ``mine`` is a :class:`Setup`
    (returns every rank's) or a frame (returns every rank's as Python ints).
    ``error`` is this rank's local error. Raises :class:`OperationsDiffer`
    when ranks are in different operations, then for the first rank that reported an error (``rank r:
    ...``), then what ``judge`` finds (for a Setup: :meth:`Setup.disagreement`).
    Frame words ``[0, agreed)`` must be equal on every rank; ``judge`` is
    asked only when they are not (the usual exchange costs one comparison
    per rank). A frame is exchanged on the job's communicator, marked with
    the session's number and as wide as the job's frames (padded if narrower).
    """
    if isinstance(mine, Setup):
        sent = [Setup.decode(r) for r in comm.allgather_obj(mine.encode(error), operation)]
        _raise_first_error([e for _, e in sent])
        records = [r for r, _ in sent]
        refuse(Setup.disagreement(records))
        return records
    mine[ERROR] = error is not None
    mine[SESSION] = comm.session
    if mine.size < comm.width:
        mine = np.concatenate([mine, np.zeros(comm.width - mine.size, dtype=mine.dtype)])
    rows: Rows = comm.Exchange(mine, operation).tolist()
    head = rows[0][:agreed]
    if head[ERROR] or any(r[:agreed] != head for r in rows):
        if first_different([r[KIND] for r in rows]) is not None or first_different([r[SESSION] for r in rows]) is not None:
            raise OperationsDiffer(rows, comm.sessions(), comm.session)
        if any(r[ERROR] for r in rows):
            _raise_first_error(comm.allgather_obj(error, f"{operation}: error texts"))
            raise ContractError("ranks disagree on whether an error occurred")  # pragma: no cover - records misread
        refuse(None if judge is None else judge(rows))
        raise ContractError("ranks sent records that disagree")  # pragma: no cover - a judge that finds nothing
    return rows


class OperationsDiffer(ContractError):
    """Ranks are in different mpidp operations, or in different sessions' (every rank raises it alike, from the same rows).

    The text names rank 0's operation and the first rank in another, then,
    at more than two ranks, where every rank is; where the sessions differ,
    each operation with its session (``sessions`` names one by its number,
    alike on every rank). :attr:`closes` are the sessions some rank is in
    ``close`` of: each then closes on every rank (the closing rank asked for
    it; the others cannot go on without it); :attr:`closing` is whether
    ``mine``, the session of the rank that raises, is one of them.
    """

    def __init__(self, rows: Rows, sessions: Callable[[int], str] | None = None, mine: int = 0) -> None:
        self.kinds = tuple(r[KIND] for r in rows)
        numbers = [r[SESSION] for r in rows]
        self.closes = tuple(sorted({n for n, kind in zip(numbers, self.kinds) if kind == CLOSE}))
        self.closing = mine in self.closes
        label = sessions or (lambda n: f"session {n}")
        across = first_different(numbers) is not None
        name = [_operation(r) + (f" of {label(r[SESSION])}" if across else "") for r in rows]
        other = first_different(list(zip(self.kinds, numbers))) or 0
        what = "sessions" if across else "operations"
        text = f"ranks are in different mpidp {what}: rank 0 in {name[0]}, rank {other} in {name[other]}"
        if len(self.kinds) > 2:
            text += f" (every rank: {everyone(name)})"
        if across:
            text += (
                "; every rank must call the sessions made on one communicator in the same order (each session's "
                "calls wait for that session's calls on every other rank)"
            )
        if self.closes and not across:
            text += (
                "; every rank must make the same mpidp calls in the same order (did a rank skip a reduce, "
                "or call one alone?); the session is now closed on every rank"
            )
        elif self.closes:
            closed = " and ".join(label(n) for n in self.closes)
            text += f"; {closed} {'is' if len(self.closes) == 1 else 'are'} now closed on every rank"
        super().__init__(text)


def _operation(row: Sequence[int]) -> str:
    """The name of the operation a rank's frame is of."""
    if row[KIND] == CLOSE and row[Close.AT_EXIT]:
        return "close (at interpreter exit: its script ended)"
    return OPERATIONS.get(row[KIND], "?")


def everyone(names: Sequence[str]) -> str:
    """Where every rank is, by operation in order of first appearance: ``reduce on ranks 0-2, close on rank 3``."""
    ranks: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        ranks.setdefault(name, []).append(rank)
    return ", ".join(f"{name} on {_ranks(r)}" for name, r in ranks.items())


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``: consecutive runs as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def refuse(why: str | None) -> None:
    """Raise ``why`` as the ContractError every rank raises (every rank judged the same records); None: return."""
    if why is not None:
        raise ContractError(why)


def _raise_first_error(errors: Sequence[str | None]) -> None:
    """Raise ``rank r: error`` for the first rank that reported one (every rank holds the same list)."""
    for rank, error in enumerate(errors):
        if error is not None:
            raise ContractError(f"rank {rank}: {error}")


def first_different(column: Sequence[Any]) -> int | None:
    """The first rank whose value differs from rank 0's, or None when all agree."""
    first = column[0]
    return next((rank for rank, value in enumerate(column) if value != first), None)
