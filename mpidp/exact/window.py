"""An exact session's side of each window (``initialize(..., exact=True)``): folds, record words, agreed facts, the move.

The core calls it at four points of a window and knows nothing else of
the exact reduction: :meth:`ExactWindow.measure` with the local checks,
:meth:`ExactWindow.words` into the window's record, :meth:`ExactWindow.facts`
after the agreement (a slot that would overflow is one ContractError on
every rank), and :meth:`ExactWindow.reduce` to move the bytes. The
arithmetic is :mod:`mpidp.exact`'s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ContractError
from ..records import Window
from . import sums as exact

__all__ = ["ExactWindow", "reduce"]

#: ``pieces(lo, hi)``: the slots of flat range ``[lo, hi)``, each as (slot, start, end within it, offset in the range)
Pieces = Callable[[int, int], Iterable[tuple[int, int, int, int]]]


class ExactWindow:
    """The exact sums of a session's reduction slots (``slots``: the core's), and their place in the window record."""

    def __init__(self, slots: Any, base: int, order: Sequence[int] | None = None, mode: str = "auto") -> None:
        self.slots = slots
        self.base = base  # the record word of slot 0's exact facts
        # ``order``: the slots' order in the flat gradient storage; ``mode``: whose passes (``MPIDP_EXACT_KERNELS``)
        self.acc = exact.Accumulator(slots.sizes, order, mode)

    @property
    def error(self) -> str | None:
        """What went wrong in a fold of this window: this rank's error at the agreement."""
        return self.acc.error

    def fold(self, grads: Mapping[str, Any]) -> None:
        """Add one micro-batch's gradients (local; never raises for bad ones: :attr:`error`)."""
        acc, seen = self.acc, set[int]()
        for name, g in grads.items():
            group = self.slots.of.get(name)
            why = _fold_problem(name, g, group, seen, self.slots.frozen)
            if why is None:
                seen.add(group.number)
                try:
                    acc.fold(group.number, arrays.view(g))
                except Exception as e:  # noqa: BLE001 - this rank's error at the next reduce, on every rank
                    why = f"could not read gradient {name!r}: {type(e).__name__}: {e}"
            if why is not None:
                acc.error = acc.error or f"fold: {why}"
                return

    def measure(self, given: Sequence[Any]) -> list[bool]:
        """Take the facts of the window's last gradients (``given``: checked, per slot); which slots this rank has (local)."""
        acc = self.acc
        for i, x in enumerate(given):
            if x is not None:
                try:
                    acc.measure(i, x.view)
                except Exception as e:  # noqa: BLE001 - this rank's error, agreed
                    acc.error = acc.error or f"could not read gradient {x.name!r}: {type(e).__name__}: {e}"
        return [x is not None or acc.present(i) for i, x in enumerate(given)]

    def words(self, frame: np.ndarray) -> None:
        """Write every slot's exact facts into this rank's window record."""
        n = len(self.slots)
        frame[self.base : self.base + n] = np.array([self.acc.word(i) for i in range(n)], np.uint64)

    def facts(self, rows: Sequence[Sequence[int]]) -> tuple[exact.Facts, ...]:
        """Every slot's agreed facts over the ranks with a weight; ContractError (every rank alike) where one would overflow."""
        facts = tuple(exact.Facts([r[self.base + i] if r[Window.WEIGHT] else 0 for r in rows]) for i in range(len(self.slots)))
        for group, f in zip(self.slots.groups, facts):
            if f.overflow:
                raise ContractError(
                    f"exact reduction: the gradients of {group.name!r} span more than {exact.LIMIT} bits over this window's "
                    f"{f.count} micro-batches (magnitudes from below 2**{f.top} down to quanta of 2**{f.quantum}), "
                    "more than an int64 sum holds; fold fewer micro-batches per window, or reduce without exact=True"
                )
        return facts

    def forget(self) -> None:
        """Drop the window's folds (a refused window: the next one starts clean)."""
        self.acc.clear()

    def reduce(self, agreed: Any, comm: Any, chunk_bytes: int, operation: str, into: Sequence[Any] | None = None) -> dict[str, Any]:
        """Sum the integers over the ranks, write each result once converted (collective; ``agreed``: the core's Agreed).

        Returns the results by the names the gradients came with (new zero
        arrays, by head name, where this rank had none); with ``into`` (a
        host array per present slot, else None: an overlapped window's send
        views), writes there instead and returns nothing. Raises
        CollectiveError if MPI fails; the folds are gone either way.
        """
        acc, facts = self.acc, agreed.exact
        out: dict[str, Any] = {}
        targets: list[Any] = [None] * len(self.slots) if into is None else list(into)
        for i, here in enumerate(agreed.present(len(self.slots)) if into is None else ()):
            if here:
                x, group = agreed.given[i], self.slots.groups[i]
                g = arrays.zeros_like(group.param) if x is None else x.array
                targets[i] = arrays.view(g) if x is None else x.view
                out[group.name if x is None else x.name] = g
        try:
            reduce(
                acc, facts, targets, agreed.weight > 0, agreed.global_weight, chunk_bytes // 8, comm.rank, comm.size,
                lambda send, recv: comm.Reduce_scatter_block(send, recv, f"{operation}: Reduce_scatter_block (integers)"),
                lambda b: comm.Allgather_in_place(b, f"{operation}: Allgather"),
                lambda send, recv: comm.Alltoall(send, recv, f"{operation}: Alltoall (float32 integers)"),
            )
            if any(f.special for f in facts):
                self._specials(facts, agreed.weight > 0, targets, comm, operation)
        finally:
            acc.clear()
        return out

    def reduce_owned(self, agreed: Any, comm: Any, chunk: int, bounds: Sequence[int], pieces: Pieces, out: np.ndarray, operation: str) -> bool:
        """Only this rank's slice ``[bounds[rank], bounds[rank + 1])`` of the flat trainable storage (slots back to back in index
        order; ``pieces(lo, hi)``: the slots of a flat range, as :func:`mpidp.cut.pieces`), exact, into float32 ``out``;
        False, with nothing done, where some rank holds inf or NaN (collective).

        For a sharded optimizer: each rank's integers go straight to the
        slice's owner in rounds of ``chunk`` float32 values per rank, and each
        owner sums and converts its own slice only, no gather of gradients
        (:func:`owned`). Where a rank holds inf or NaN (an agreed fact: every
        rank decides alike) the caller reduces the whole window instead. The
        folds are gone after a True.
        """
        acc, facts = self.acc, agreed.exact
        if any(f.special for f in facts):
            return False
        try:
            owned(
                acc, facts, bounds, pieces, agreed.weight > 0, agreed.global_weight, chunk, comm.rank, comm.size, out,
                lambda send, recv: comm.Alltoall(send, recv, f"{operation}: Alltoall (float32 integers)"),
                lambda send, recv: comm.Reduce_scatter_block(send, recv, f"{operation}: Reduce_scatter_block (integers)"),
            )
        finally:
            acc.clear()
        return True

    def _specials(self, facts: Sequence[exact.Facts], weighted: bool, targets: Sequence[Any], comm: Any, operation: str) -> None:
        """inf and NaN: summed apart in float32 (no order either); they win over the finite sums as in a float sum."""
        acc = self.acc
        acc.take_specials()
        for i, f in enumerate(facts):
            if not f.special:
                continue
            kept = acc.special.get(i) if weighted else None
            kept = np.zeros(acc.sizes[i], np.float32) if kept is None else kept
            comm.Allreduce(kept, f"{operation}: Allreduce (not finite)")
            if targets[i] is not None:
                kept = kept.reshape(targets[i].shape)
                np.copyto(targets[i], kept, where=kept != 0)


def _fold_problem(name: str, g: Any, group: Any, seen: set[int], frozen: frozenset[str]) -> str | None:
    """Why ``g`` cannot be folded as the gradient of ``name`` (its reduction slot ``group``), or None (local)."""
    if group is None:
        return f"gradient for {'frozen' if name in frozen else 'unknown'} parameter {name!r}"
    if group.number in seen:
        return f"two gradients for one tied array in one fold: {name!r} and another name of {group.name!r}"
    info = arrays.describe(g)
    if info is None or (info.shape, info.dtype, info.device) != (group.info.shape, group.info.dtype, group.info.device):
        return f"gradient {name!r} ({info}) does not match its parameter ({group.info})"
    return None


def reduce(
    acc: exact.Accumulator, facts: Sequence[exact.Facts], targets: Sequence[Any], weighted: bool, global_weight: int,
    chunk: int, rank: int, size: int, scatter: Callable[[np.ndarray, np.ndarray], None], gather: Callable[[np.ndarray], None],
    exchange: Callable[[np.ndarray, np.ndarray], None],
) -> None:
    """Sum the window's integers over the ranks and write each target's exact result (collective, after the agreement).

    Chunk by chunk of ``chunk`` values: this rank's share summed and
    converted (:func:`_share`), ``gather`` (an Allgather in place), written
    into ``targets`` (a host array per globally present slot, else None).
    Every rank calls the same collectives: ``chunk`` and the slots are
    agreed facts.
    """
    c = max(size, chunk // size * size)
    stage = acc.stage(c, size)  # two send chunks in turns: a chunk the other ranks just read is not packed into again
    later: dict[int, np.ndarray] = {}
    region = _region(acc, targets)
    for k, lo in enumerate(range(0, acc.total, c)):
        hi = min(lo + c, acc.total)
        width = -(-(hi - lo) // size) * size
        direct = region is not None and lo + width <= acc.total  # gathered straight into the targets
        floats = region[lo : lo + width] if direct else stage.floats[:width]  # type: ignore[index]
        _share(acc, facts, stage.send[k % 2][:width], stage, lo, hi, weighted, global_weight, rank, size, floats, scatter, exchange)
        if size > 1:
            gather(floats)
        if not direct:
            _write(acc, lo, hi, floats, targets, later)
    for i, values in later.items():
        t = targets[i]
        t[...] = values.reshape(t.shape)


def _share(
    acc: exact.Accumulator, facts: Sequence[exact.Facts], send: np.ndarray, stage: exact.Stage, lo: int, hi: int, weighted: bool,
    global_weight: int, rank: int, size: int, floats: np.ndarray, scatter: Callable[[np.ndarray, np.ndarray], None],
    exchange: Callable[[np.ndarray, np.ndarray], None],
) -> None:
    """This rank's share of chunk ``[lo, hi)`` (``send``: its int64 buffer, ``size`` equal shares), summed and converted into its
    place in ``floats``, one of two ways decided on agreed facts (every rank alike).

    - *thin* (:meth:`mpidp.exact.Accumulator.thin`: one fold per rank and
      slot, 53 bits or fewer): each rank's integers at the agreed quanta as
      float32, ``exchange`` (an Alltoall: every rank's part of this rank's
      share; the default path's bytes, no MPI arithmetic), summed in float64
      and converted once;
    - else 64-bit integers at the agreed quanta (float64 where the agreed
      facts allow, :meth:`mpidp.exact.Accumulator.floats`; zeros where this
      rank has no weight), ``scatter`` (a Reduce_scatter_block), converted.
    """
    width = send.size
    part = width // size
    mine_lo, mine_hi = min(hi, lo + rank * part), min(hi, lo + (rank + 1) * part)
    mine = floats[mine_lo - lo : mine_hi - lo]
    if acc.thin(lo, hi, facts):  # float32 integers summed by their owner
        send32 = send.view(np.float32)[:width]
        if weighted:
            acc.pack32(lo, hi, facts, send32[: hi - lo])
            send32[hi - lo :] = 0
        else:  # nobody reads this rank's part: zeros, not stale bytes, on the wire
            send32[...] = 0
        parts = send32.reshape(1, width)
        if size > 1:
            exchange(send32, stage.parts[:width])
            parts = stage.parts[:width].reshape(size, part)
        acc.combine(mine_lo, mine_hi, facts, parts, global_weight, mine)
        return
    shard = stage.shard[:part]
    if acc.floats(lo, hi, facts):  # float64 sums of integers below 2**53: exact, and no conversion passes
        send, shard = send.view(np.float64), shard.view(np.float64)
    if weighted:
        acc.pack(lo, hi, facts, send[: hi - lo])
        send[hi - lo :] = 0
    else:
        send[...] = 0
    ints = send
    if size > 1:
        scatter(send, shard)
        ints = shard
    acc.unpack(mine_lo, mine_hi, facts, ints[: mine_hi - mine_lo], global_weight, mine)


def owned(
    acc: exact.Accumulator, facts: Sequence[exact.Facts], bounds: Sequence[int], pieces: Pieces, weighted: bool, global_weight: int,
    chunk: int, rank: int, size: int, out: np.ndarray, exchange: Callable[[np.ndarray, np.ndarray], None],
    scatter: Callable[[np.ndarray, np.ndarray], None],
) -> None:
    """This rank's slice of the flat storage (``bounds``: every rank's, slots in index order) summed exactly into ``out``
    (collective; no rank holds inf or NaN).

    In round ``k`` rank ``j``'s block of the send buffer holds this rank's
    integers of the flat elements ``[bounds[j] + k c, ...)`` of ``j``'s slice
    (``c`` per rank and round). Where every slot is :meth:`~mpidp.exact.Accumulator.thin`
    they are float32 and ``exchange`` (an Alltoall) gives each owner every
    rank's part of its next ``c`` elements, which it sums and converts
    (:meth:`~mpidp.exact.Accumulator.combine`): the bytes of a float32
    reduce-scatter. Else they are int64 (float64 where every slot allows,
    :meth:`~mpidp.exact.Accumulator.floats`, zeros where this rank has no
    weight) and ``scatter`` (a Reduce_scatter_block) sums each owner's, which
    it converts. The choice is made on agreed facts: every rank alike.
    """
    thin = acc.thin(0, acc.total, facts)
    dtype = np.float32 if thin else np.float64 if acc.floats(0, acc.total, facts) else np.int64
    c = max(1, chunk // size // (1 if thin else 2))
    rounds = max(-(-(b - a) // c) for a, b in itertools.pairwise(bounds))
    send, recv = np.empty(size * c, dtype), np.empty((size if thin else 1) * c, dtype)
    for k in range(rounds):
        if not thin or not weighted or k == rounds - 1:
            send[...] = 0  # zeros past a slice's end (summed by MPI where not thin), and where this rank has no weight
        if weighted:
            for j in range(size):
                lo = bounds[j] + k * c
                for i, a, b, at in pieces(lo, min(lo + c, bounds[j + 1])):
                    s, o = acc.starts[i], send[j * c + at : j * c + at + b - a]
                    if thin:
                        acc.pack32(s + a, s + b, facts, o)
                    else:
                        acc.pack(s + a, s + b, facts, o)
        if size > 1:
            (exchange if thin else scatter)(send, recv)
        got = recv if size > 1 else send
        lo = bounds[rank] + k * c
        for i, a, b, at in pieces(lo, min(lo + c, bounds[rank + 1])):
            s, o = acc.starts[i], out[k * c + at : k * c + at + b - a]
            if thin:
                acc.combine(s + a, s + b, facts, got.reshape(size, c)[:, at : at + b - a], global_weight, o)
            else:
                acc.unpack(s + a, s + b, facts, got[at : at + b - a], global_weight, o)


def _region(acc: exact.Accumulator, targets: Sequence[Any]) -> np.ndarray | None:
    """The targets as one float32 array over the whole slot space where they lie so (gradient buffers), else None.

    Each target is its slot's values, so where every one is writable
    contiguous float32 that starts at the byte its slot starts at, they
    tile the memory of the array returned, and a chunk's results can be
    gathered there in place (no copy-out pass).
    """
    if not acc.total or any(t is None or t.dtype != np.float32 or not t.flags.c_contiguous or not t.flags.writeable for t in targets):
        return None
    first = acc.order[0]  # the first slot in slot space (empty slots come last: this one has values)
    base = targets[first].ctypes.data - 4 * acc.starts[first]
    if any(n and (t.ctypes.data != base + 4 * start or t.size != n) for t, start, n in zip(targets, acc.starts, acc.sizes)):
        return None
    return np.lib.stride_tricks.as_strided(targets[first].reshape(-1), shape=(acc.total,), strides=(4,), writeable=True)


def _write(acc: exact.Accumulator, lo: int, hi: int, floats: np.ndarray, targets: Sequence[Any], later: dict[int, np.ndarray]) -> None:
    """Copy the results of slot space ``[lo, hi)`` into the targets (whole-slot copies for targets not flat float32)."""
    for i, a, b in acc.pieces(lo, hi):
        t = targets[i]
        if t is None:
            continue
        base = acc.starts[i]
        if t.dtype == np.float32 and t.flags.c_contiguous:
            t.reshape(-1)[a - base : b - base] = floats[a - lo : b - lo]
        else:
            later.setdefault(i, np.empty(acc.sizes[i], np.float32))[a - base : b - base] = floats[a - lo : b - lo]
