"""A session's life: its communicator, watchdog and frame, the agreements, and the collectives besides the window.

:class:`Session` holds what :class:`mpidp.core.DataParallel` is made of
(built by :func:`mpidp.core.start` once the ranks agreed), the broadcast of
the parameters, the accessors, and the session's small agreed operations:
``join``, ``verify_replicas`` and ``close``. Every one of them goes through
:meth:`Session._agree`, so that ranks in different operations, ``close``
included, raise the same ContractError. The window itself (check, agree,
move, fold) is the core's.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from . import arrays, checks, guard, layout, records
from .comm import Communicator
from .errors import CollectiveError, ContractError, DataParallelError
from .exact import window as exact_window
from .packing import BCAST_OWN_BYTES, BCAST_SPLIT_BYTES, bcast_calls, plan, slot
from .records import Frame, Setup, Window
from .window import Cache, MissingGradientPolicy, Slots, Transport, check_replica

T = TypeVar("T")

__all__ = ["Session", "close_elsewhere"]


class Session:
    """A rank's session over a private duplicate of the user's communicator (the base of :class:`mpidp.core.DataParallel`)."""

    def __init__(self, comm: Communicator, params: Mapping[str, Any], local: checks.Found, watchdog: guard.Watchdog | None) -> None:
        found = local.found
        self._comm = comm
        self._params = params
        self._contract = found.contract
        self._arrays = found.arrays
        self._infos = found.infos
        self._device = found.device
        self._cuda_aware = local.aware
        self._root = local.setup.root
        self._chunk_bytes = local.setup.chunk_bytes
        self._watchdog = watchdog
        self._transport = Transport(comm, local.stage, local.gpu, local.scatter, local.casts)
        #: (name, array, signature) per entry: what _check_replica compares every window
        self._replica = tuple(zip((e.name for e in found.contract), found.arrays, map(arrays.signature, found.arrays)))
        #: contract indices of every tie-group head (frozen ones included): what is broadcast and verified
        self._heads = tuple(i for i, e in enumerate(self._contract) if e.alias == i)
        self._slots = Slots(found.contract, found.infos, found.arrays)
        #: the exact reduction's integer sums (:mod:`mpidp.exact`), in an exact session
        self._exact = None
        if local.setup.exact:  # slot space in the flat gradient storage's order: results gathered there in place
            order = layout.flat_order(self._slots.sizes, self._slots.kinds, len(local.stage))
            self._exact = exact_window.ExactWindow(self._slots, Window.PRESENCE + self._slots.words, order, local.exact_mode)
        extra = len(self._slots) if self._exact is not None else 0  # a word per slot: its exact facts
        self._frame = Frame(max(Window.body(len(self._slots)) + extra, len(self._heads), 1))
        comm.widen(self._frame.width)  # every session's records of the job are as wide as the widest's (agreed facts)
        comm.closer = self._closed_elsewhere  # a rank that closes it while this one is in another session's call
        self._window_frame = self._frame.new(records.WINDOW, comm.width)  # reused: Allgather copies it out
        self._judge = Window.judge(MissingGradientPolicy)
        self._cache = Cache()
        self._window = 0
        self._closed = False
        self._closing = False  # a rank is in close: this rank closes without asking again
        self._exiting = False  # closed by the interpreter's exit, not by the program
        self._failed: str | None = None  # set by the first CollectiveError: the session is unusable

    def _broadcast(self, everyone: list[Setup]) -> None:
        """Bcast every tie-group head from root: array by array, or by runs of adjacent memory (agreed facts only).

        Calls above chunk_bytes, and small calls of their own, only where no rank stages device memory
        through its chunk-sized pinned buffer; whole memory runs (flat_parameters) only where every rank
        has the same runs: every rank must build the same calls.
        """
        host = all(r.on_host for r in everyone)
        runs = everyone[0].runs if host and all(r.runs == everyone[0].runs for r in everyone) else None
        heads = [self._arrays[i] for i in self._heads]
        if runs is None:
            slots = [slot(arrays.view(a)) for a in heads]
        else:
            slots = [slot(layout.region(heads, run)) for run in runs]
        split, own = (BCAST_SPLIT_BYTES, BCAST_OWN_BYTES) if host else (None, None)
        calls = plan([s.flat.nbytes for s in slots], [True] * len(slots), self._chunk_bytes, split, own)
        bcast_calls(calls, slots, self._transport.stage.view(np.uint8), self._bcast("initialize: Bcast"), self.rank == self._root)

    def _bcast(self, operation: str) -> Callable[[Any], None]:
        """Broadcast one buffer (host, or this session's device memory) from root (collective)."""
        comm, gpu, root = self._comm, self._transport.gpu, self._root
        if gpu is None:
            return lambda b: comm.Bcast(b, root, operation)
        return lambda b: gpu.bcast(comm, b, root, operation)

    def _move_regions(self, regions: checks.ByteRegions, operation: str) -> None:
        """Move every region's bytes from root in one host Bcast (the ranks agreed on the list)."""
        blob = np.empty(sum(v.size for v in regions.views), dtype=np.uint8)
        if blob.size == 0:
            return
        is_root = self.rank == self._root
        bounds = np.cumsum([0] + [v.size for v in regions.views]).tolist()
        if is_root:
            for v, lo, hi in zip(regions.views, bounds, bounds[1:]):
                blob[lo:hi] = v
        self._comm.Bcast(blob, self._root, operation)
        if not is_root:
            for v, lo, hi in zip(regions.views, bounds, bounds[1:]):
                v[...] = blob[lo:hi]
            regions.written()

    @property
    def rank(self) -> int:
        """This replica's rank in the communicator (local; no communication)."""
        return self._comm.rank

    @property
    def closed(self) -> bool:
        """Whether the session is closed: by :meth:`close`, or by a rank that closed while this one was in another call (local)."""
        return self._closed

    @property
    def world_size(self) -> int:
        """Number of replicas (local; no communication)."""
        return self._comm.size

    @property
    def device(self) -> str:
        """This rank's device: ``"cpu"`` or ``"cuda:N"``; every array must live there (local)."""
        return self._device

    @property
    def cuda_aware(self) -> tuple[bool, str]:
        """Whether device buffers are handed to MPI directly, and why (False: staged through the host; local)."""
        return self._cuda_aware

    @property
    def window(self) -> int:
        """Number of :meth:`reduce` calls so far in the run, failed ones included, counted on after a checkpoint's load (local)."""
        return self._window

    def continue_count(self, windows: int) -> None:
        """Count the run's windows on from ``windows`` (a loaded checkpoint's count: every rank alike; local)."""
        self._window = int(windows)

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name, in contract (sorted) order (local; no communication)."""
        return tuple(e.name for e in self._contract)

    @property
    def trainable(self) -> tuple[str, ...]:
        """The name that heads each trainable tie group, in contract order (local; no communication)."""
        return tuple(g.name for g in self._slots.groups)

    def _usable(self) -> None:
        if self._closed:
            raise ContractError("this DataParallel is closed")
        if self._failed is not None:
            raise CollectiveError(f"an earlier collective failed ({self._failed}); this DataParallel cannot be used")

    def _on_device(self) -> Any:
        """A context in which the session's CUDA device is current (nothing for host sessions)."""
        gpu = self._transport.gpu
        return contextlib.nullcontext() if gpu is None else gpu.current()

    def join(self, batches: Iterable[T]) -> Iterator[T | None]:
        """Yield this rank's batches, then None until no rank has a batch left: uneven shards (collective).

        Every rank iterates the same number of times, the length of the
        longest shard: ``for batch in dp.join(loader):`` yields each local
        batch, then None on a rank whose batches ran out while another rank
        still has one, and stops on every rank at once when none has. A rank
        whose batch is None takes part in the window with weight 0 and no
        gradients (``dp.reduce({}, 0)``; the ERROR policy allows it), then
        steps its optimizer with the returned gradients like every other
        rank, so replicas stay equal; the token-weighted mean makes the
        result exact, as one process over the same batches. Each step
        asks every rank one small agreed question (one Allgather of a
        frame, watched by the watchdog); ``batches`` is not read past its
        end. The same for Horovod's ``hvd.join()`` and DDP's ``Join``.

        Raises ContractError on every rank when a rank's ``batches`` raised
        (``rank r: the batches raised ...``; on that rank the exception is
        the cause) or ranks are in different operations (a rank in
        ``reduce`` while another asks for its next batch).
        """
        self._usable()
        it: Iterator[T] | None = None
        done = False
        step = 0
        while True:
            batch: T | None = None
            error: str | None = None
            cause: BaseException | None = None
            try:
                it = iter(batches) if it is None else it
                batch = None if done else next(it)
            except StopIteration:
                done = True
            except Exception as e:  # noqa: BLE001 - reported to every rank, raised there alike
                error, cause = f"the batches raised {type(e).__name__}: {e}", e
            self._usable()
            frame = self._frame.new(records.JOIN)
            frame[records.Join.HAS] = not done
            try:
                rows = self._agree(frame, error, f"join (step {step}): does any rank have a batch")
            except ContractError as e:
                if cause is not None:
                    raise e from cause
                raise
            if not records.Join.any(rows):
                return
            step += 1
            yield None if done else batch

    def verify_replicas(self) -> None:
        """Check that every rank's parameters are bitwise equal to the root's.

        Collective. Compares a CRC-32 of every parameter's bytes; raises
        ContractError on every rank naming the parameters and ranks that
        differ (and nothing moves but one small Allgather).
        """
        self._usable()
        frame = self._frame.new(records.VERIFY)
        try:
            error = check_replica(self._params, self._replica, self._infos)
            if error is None:
                for k, i in enumerate(self._heads):
                    frame[records.Verify.CRCS + k] = zlib.crc32(layout.crc_bytes(arrays.view(self._arrays[i])))
        except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
            error = f"could not read the parameters: {type(e).__name__}: {e}"
        rows = self._agree(frame, error, "verify_replicas")
        crcs = records.Verify.crcs(rows, len(self._heads))
        differ = crcs != crcs[self._root]
        if differ.any():
            ranks = np.flatnonzero(differ.any(axis=1))
            names = [self._contract[self._heads[k]].name for k in np.flatnonzero(differ.any(axis=0))]
            shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise ContractError(
                f"replicas differ from root {self._root} on rank(s) {', '.join(map(str, ranks))}: parameter(s) {shown}"
            )

    def _agree(self, frame: np.ndarray, error: str | None, operation: str, judge: records.Judge | None = None, agreed: int = records.BODY) -> Any:
        """:func:`records.agree` on this session; where a rank is in :meth:`close` (of any session of the job),
        every rank closes that session, then raises (collective)."""
        try:
            return records.agree(self._comm, frame, error, operation, judge, agreed)
        except records.OperationsDiffer as e:
            close_elsewhere(self._comm, e.closes)
            raise ContractError(str(e)) from None  # the user's error type, as for every other refusal

    def _closed_elsewhere(self) -> None:
        """Close without agreeing: every rank learned that a rank closes this session (collective)."""
        self._closing = True
        self.close()

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Agree that every rank closes, then free the private communicator (collective). Idempotent.

        A rank in another mpidp operation meanwhile (it made a ``reduce`` this
        rank skipped, or called one alone) is one ContractError on every rank,
        naming where each rank is; the session is closed on every rank then
        (here after freeing what it holds). A session still open when the
        interpreter exits is closed then, before MPI is finalized. ``then()``
        (an adapter's: the overlapped window's buckets) runs after the
        agreement and before the communicator is freed.
        """
        if self._closed:
            return
        error = self._agree_close()
        self._closed = True
        guard.forget_at_exit(self)
        self._cache.forget()  # release the last windows' gradient arrays
        try:
            if then is not None:
                then()
        finally:
            self._free()
        if error is not None:
            raise error

    def _free(self) -> None:
        """Free the communicator and stop the watchdog (collective)."""
        try:
            self._comm.close()  # watched, like every collective of the session
        finally:
            if self._watchdog is not None:
                self._watchdog.close()

    def _agree_close(self) -> DataParallelError | None:
        """Agree with every rank that the session closes (collective): the error to raise once closed, or None."""
        if self._failed is not None or self._closing:  # a broken session frees what it can; a closing rank was heard
            return None
        try:
            frame = self._frame.new(records.CLOSE)
            frame[records.Close.AT_EXIT] = self._exiting
            records.agree(self._comm, frame, None, "close: agreement")
        except CollectiveError as e:
            self._failed = str(e)
            return e
        except records.OperationsDiffer as e:  # ranks in different operations: closed on every rank, with what they close
            close_elsewhere(self._comm, [n for n in e.closes if n != self._comm.session])
            return ContractError(str(e))
        except ContractError as e:
            return ContractError(str(e))  # pragma: no cover - a close agreement refuses only on different operations
        return None

    def _close_at_exit(self) -> None:
        """:meth:`close`, from the interpreter's exit (the other ranks' error then says so)."""
        self._exiting = True
        self.close()

    def __exit__(self, *exc: object) -> None:
        """Close the session (collective, like :meth:`close`)."""
        self.close()


def close_elsewhere(comm: Communicator, sessions: Iterable[int]) -> None:
    """Close each of the job's ``sessions`` still open on this rank, as a rank in its ``close`` asked (collective)."""
    job = comm.job
    for number in sessions:
        member = comm if job is None else job.members.get(number)
        closer = None if member is None else member.closer
        if closer is not None:
            closer()
