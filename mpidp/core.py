"""DataParallel: check locally, agree globally, then move bytes.

``initialize``, ``reduce`` and ``verify_replicas`` each read in that order:
local checks that can fail (:mod:`mpidp.contract`, :mod:`mpidp.window`),
one exchange in which every rank learns what every other found
(:func:`mpidp.records.agree`), then the movement of bytes on agreed facts
only (:mod:`mpidp.packing`, the device room :mod:`mpidp.cuda`). The module
functions :func:`start` and :func:`broadcast_regions` are the adapters'
(named byte regions moved with the parameters: torch's buffers).
"""

from __future__ import annotations

import contextlib
import enum
import numbers
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from . import arrays, checks, cuda, exact, exact_window, guard, launch, layout, records
from . import comm as _mpi
from .checks import ByteRegions
from .comm import Communicator, MPIComm
from .errors import CollectiveError, ContractError, DataParallelError
from .layout import flat_parameters
from .packing import (
    BCAST_OWN_BYTES,
    BCAST_SPLIT_BYTES,
    DEFAULT_CHUNK_BYTES,
    bcast_calls,
    plan,
    slot,
)
from .records import U64_MAX, Frame, Setup, Window
from .window import Cache, Given, Slots, Transport, check_gradients, reduce_slots

T = TypeVar("T")

__all__ = ["Agreed", "ByteRegions", "Checked", "DataParallel", "Facts", "MPIComm", "MissingGradientPolicy", "ReducedGradients", "broadcast_regions", "flat_parameters", "start"]


class MissingGradientPolicy(enum.Enum):
    """What to do about a trainable parameter that has no local gradient."""

    #: Refuse the window when a rank with a non-zero local weight lacks a gradient.
    ERROR = 0
    #: Contribute zeros; a parameter no weighted rank has a gradient for stays absent.
    ZERO = 1


@dataclass(frozen=True)
class ReducedGradients:
    """Globally token-weighted gradients of one accumulation window."""

    #: ``sum over ranks of grad / global_weight`` per globally present parameter.
    gradients: dict[str, Any]
    #: Exact sum of the local weights over all ranks.
    global_weight: int


class Checked(NamedTuple):
    """This rank's window, checked locally (:meth:`DataParallel.check_window`): its record and its first error."""

    given: list[Given | None]  # this rank's gradient per reduction slot (checked), None where it has none
    weight: int  # this rank's local weight
    code: int  # the policy's value
    step: int  # the STEP word
    presence: np.ndarray  # the presence words
    error: str | None


class Agreed(NamedTuple):
    """The facts of a window every rank agreed on (:meth:`DataParallel.agree_window`), and this rank's gradients."""

    given: list[Given | None]  # this rank's gradient per reduction slot (checked), None where it has none
    weight: int  # this rank's local weight
    global_weight: int
    key: tuple[int, ...]  # the presence words OR-ed over the ranks with a weight
    zero_weight: bool  # some rank has weight 0: its gradients count as zeros
    extra: tuple[int, ...] = ()  # every rank's EXTRA word (the adapter's own, :meth:`DataParallel.agree_window`)
    exact: tuple[exact.Facts, ...] | None = None  # per slot, the agreed facts of the exact reduction (exact sessions)

    def present(self, slots: int) -> list[bool]:
        """Whether each reduction slot is globally present."""
        return Window.present(self.key, slots)


class Facts(NamedTuple):
    """What an adapter's owner of overlapped windows needs to know about the session (:meth:`DataParallel.facts`)."""

    comm: Communicator  # the session's communicator
    sizes: tuple[int, ...]  # values per reduction slot (one per trainable tie group, in :attr:`DataParallel.trainable` order)
    chunk_bytes: int
    root: int
    device: str
    timeout: float | None  # the watchdog's seconds (None: off)


class DataParallel:
    """A rank's replicated training session over a private duplicate of ``comm``.

    Create it with :meth:`initialize`. Local object identities may differ
    between ranks: names and tie topology decide the order of collectives.
    """

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
        self._exact = exact_window.ExactWindow(self._slots, Window.PRESENCE + self._slots.words) if local.setup.exact else None
        extra = len(self._slots) if self._exact is not None else 0  # a word per slot: its exact facts
        self._frame = Frame(max(Window.body(len(self._slots)) + extra, len(self._heads), 1))
        self._window_frame = self._frame.new(records.WINDOW)  # reused: Allgather copies it out
        self._judge = Window.judge(MissingGradientPolicy)
        self._cache = Cache()
        self._window = 0
        self._closed = False
        self._closing = False  # a rank is in close: this rank closes without asking again
        self._exiting = False  # closed by the interpreter's exit, not by the program
        self._failed: str | None = None  # set by the first CollectiveError: the session is unusable

    # ------------------------------------------------------------------ set-up

    @classmethod
    def initialize(
        cls,
        params: Mapping[str, Any],
        comm: MPIComm | None = None,
        root: int = 0,
        frozen: Any = (),
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device: str | None = None,
        abort_on_exception: bool = True,
        timeout: float | None = None,
        exact: bool = False,
    ) -> DataParallel:
        """Validate every rank's replica, agree, then broadcast it from ``root`` in place.

        Collective: every rank of ``comm`` must call it. ``params`` maps names
        to NumPy, CuPy or PyTorch arrays; tied weights are the same array
        object under several names. Names in ``frozen`` are broadcast but
        never reduced. Arrays keep their identity: an optimizer that already
        holds them keeps working.

        ``chunk_bytes`` is the size of one collective call (equal on every
        rank). ``device`` is this rank's device (``"cpu"`` or ``"cuda:N"``);
        None takes the first parameter's. ``abort_on_exception`` makes an
        uncaught exception on any rank abort the whole job instead of
        leaving the others waiting. ``timeout`` (seconds; None: from
        ``MPIDP_TIMEOUT``, which defaults to 1800; 0: off) is the watchdog's:
        it aborts the job when a rank waits longer than that in one mpidp
        collective, this call's own included.

        ``exact=True`` makes :meth:`reduce` exact (:mod:`mpidp.exact`, host
        arrays only): the result's bits then depend only on the set of
        micro-batches whose gradients were folded (:meth:`fold`) or passed,
        not on the world size, the reduction path or their order. Every
        rank must pass the same.

        Raises ContractError on every rank if any rank's replica is invalid
        or differs from another's; nothing is modified then.
        """
        options = {"chunk_bytes": chunk_bytes, "device": device, "abort_on_exception": abort_on_exception, "timeout": timeout, "exact": exact}
        return start(params, comm, root, frozen, options, checks.NO_REGIONS)

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

    # --------------------------------------------------------------- accessors

    @property
    def rank(self) -> int:
        """This replica's rank in the communicator (local; no communication)."""
        return self._comm.rank

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
        """Number of :meth:`reduce` calls so far, failed ones included (local)."""
        return self._window

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name, in contract (sorted) order (local; no communication)."""
        return tuple(e.name for e in self._contract)

    @property
    def trainable(self) -> tuple[str, ...]:
        """The name that heads each trainable tie group, in contract order (local; no communication)."""
        return tuple(g.name for g in self._slots.groups)

    # ------------------------------------------------------------------ window

    def reduce(
        self,
        grads: Mapping[str, Any],
        local_weight: int,
        policy: MissingGradientPolicy = MissingGradientPolicy.ERROR,
        *,
        step: int | None = None,
    ) -> ReducedGradients:
        """Turn gradients of local loss **sums** into the global token mean.

        Collective: every rank must call it once per accumulation window.
        ``grads`` maps one name per trainable tie group to the gradient of
        this rank's loss *sum* over the window; ``local_weight`` is the
        number of tokens (or samples) behind it. The result per globally
        present parameter is ``sum over ranks of grad / global_weight``,
        summed in float32 and cast back to the parameter's dtype, bitwise
        equal on every rank.

        The caller's gradient arrays are consumed: the results are written
        into them in place and returned under the names they came with. A
        globally present parameter this rank has no gradient for (policy
        ZERO, or local weight 0) gets a new array; gradients of a rank with
        weight 0 are ignored (counted as zeros). Parameters no weighted rank
        has a gradient for are absent from the result.

        ``step`` is a number the caller counts, such as the optimizer step.
        When any rank passes one, every rank must pass the same one: a rank
        that skipped or repeated a ``reduce`` is then an error on every rank
        instead of gradients silently paired with another rank's window (the
        ranks cannot tell otherwise: each rank's n-th call is its window n).
        None on every rank (the default) checks nothing. It travels in the
        window's exchange: no extra collective.

        Refilling the same arrays every window is the fast path: arrays that
        are the last window's objects, unchanged, skip their checks, and from
        the second window in a row the views cut for them are kept (and the
        arrays referenced) until a window on other arrays, a window that raises,
        or ``close``.

        Raises ContractError identically on every rank, before anything is
        modified, when any rank's input is invalid, ranks disagree on the
        policy or the step, or the global weight is 0. Raises CollectiveError if MPI
        fails while gradients move: like the reference design, which consumes
        its input, the gradient arrays are then unspecified, and every later
        call on this session raises CollectiveError too.
        """
        agreed = self.agree_window(self.check_window(grads, local_weight, policy, step=step))
        given, weight, global_weight, key = agreed.given, agreed.weight, agreed.global_weight, agreed.key
        operation = f"reduce (window {self._window})"
        if self._exact is not None:
            try:
                return ReducedGradients(self._exact.reduce(agreed, self._comm, self._chunk_bytes, operation), global_weight)
            except CollectiveError as e:
                self._failed = str(e)
                raise
        entry = self._cache.plan(key, self._slots.sizes, len(self._transport.stage), self._slots.kinds)
        try:
            # device work (zeros, contiguous copies, casts, streams and events) runs on the session's device
            with self._on_device():
                out = reduce_slots(self._transport, self._cache, entry, self._slots.groups, given, weight, global_weight, operation)
        except CollectiveError as e:
            self._failed = str(e)
            self._cache.forget()  # a broken session holds no gradient arrays
            raise
        return ReducedGradients(out, global_weight)

    def check_window(self, grads: Mapping[str, Any], local_weight: Any, policy: Any, error: str | None = None, *, step: Any = None) -> Checked:
        """:meth:`reduce`'s local checks: this rank's window record and its first error (local; counts the window).

        ``error`` is the caller's own local error (an adapter's), agreed like
        the core's; ``step`` as in :meth:`reduce`. Raises only where the
        session is closed or broken; every other problem is the returned error.
        """
        self._usable()
        self._window += 1
        given: list[Given | None] = [None] * len(self._slots.groups)
        error = self._check_window(grads, given) or error
        if type(local_weight) is int and 0 <= local_weight <= U64_MAX and policy.__class__ is MissingGradientPolicy:
            weight, code = local_weight, policy.value  # the usual window, cheaply
        else:
            weight, code, error = _check_weight(local_weight, policy, error)
        if step is None:
            step_word = 0
        elif type(step) is int and 0 <= step < U64_MAX:
            step_word = step + 1
        else:
            step_word, error = _check_step(step, error)
        present = None if self._exact is None else self._exact.measure(given)
        complete = None not in given if present is None else all(present)  # Given never equals None: an identity test per entry, in C
        if present is None and not complete:
            present = [x is not None for x in given]
        if error is None and code == MissingGradientPolicy.ERROR.value and weight > 0 and not complete:
            assert present is not None
            missing = self._slots.groups[present.index(False)].name
            error = (
                f"parameter {missing!r} has no gradient (policy ERROR, local weight {weight}); "
                "pass policy=MissingGradientPolicy.ZERO if it is legitimately unused"
            )
        if self._exact is not None:
            error = error or self._exact.error
        presence = self._slots.complete if complete or present is None else self._slots.presence(present)
        return Checked(given, weight, code, step_word, presence, error)

    def agree_window(self, checked: Checked, error: str | None = None, extra: int = 0) -> Agreed:
        """:meth:`reduce` up to the movement: one exchange of the checked window (collective; moves no gradient).

        ``error`` is one more local error found after :meth:`check_window`;
        ``extra`` a word of the caller's own, every rank's returned in
        :attr:`Agreed.extra`. Raises ContractError on every rank as :meth:`reduce`
        does; otherwise every rank holds the same facts of the window.
        """
        error = checked.error or error
        Window.fill(self._window_frame, checked.step, checked.code, checked.weight, checked.presence, extra)
        if self._exact is not None:
            self._exact.words(self._window_frame)
        try:
            operation = f"reduce (window {self._window}): exchange"
            rows = self._agree(self._window_frame, error, operation, self._judge, Window.AGREED)
            global_weight, key = Window.facts(rows, self._slots.words)
            _check_global_weight(global_weight)
            facts = None if self._exact is None else self._exact.facts(rows)
        except ContractError:
            self._cache.program = None  # a window that raises keeps no gradient arrays
            if self._exact is not None:  # a refused window forgets its folds: the next one starts clean
                self._exact.forget()
            raise
        zero = any(r[Window.WEIGHT] == 0 for r in rows)
        return Agreed(checked.given, checked.weight, global_weight, key, zero, tuple(r[Window.EXTRA] for r in rows), facts)

    def agree_record(self, kind: int, words: Sequence[int], error: str | None, operation: str) -> list[list[int]]:
        """Exchange one frame of ``kind`` whose body is ``words``: every rank's, as Python ints (collective).

        An adapter's own record (:class:`mpidp.records.Open`), met by ranks in
        any other operation as every operation's record is: ContractError on
        every rank when ranks are in different operations or one reported an error.
        """
        self._usable()
        frame = self._frame.new(kind)
        frame[records.BODY : records.BODY + len(words)] = words
        rows: list[list[int]] = self._agree(frame, error, operation)
        return rows

    # ------------------------------------------------------ exact reduction

    def fold(self, grads: Mapping[str, Any]) -> None:
        """Add one micro-batch's gradients to this window's exact sums (local; ``initialize(..., exact=True)``).

        ``grads`` maps names of trainable parameters (one per tie group) to
        host gradients of one micro-batch's loss sum; they are read, not
        modified, and may be reused for the next micro-batch at once. The
        next :meth:`reduce` adds its own ``grads`` as the window's last
        micro-batch and reduces all of them exactly (:mod:`mpidp.exact`).
        Fold every micro-batch separately: micro-batches summed in float32
        before they are folded count as one, and their float32 sum depends
        on how they were grouped. Never raises for bad gradients: what is
        wrong is this rank's error at the next :meth:`reduce`, on every rank,
        and that window's folds are forgotten.
        """
        if self._exact is None:
            raise ContractError("fold needs an exact session: DataParallel.initialize(..., exact=True)")
        self._usable()
        self._exact.fold(grads)

    def _check_window(self, grads: Any, given: list[Given | None]) -> str | None:
        """This rank's replica and gradients, checked (local): the error, or None with ``given`` filled."""
        self._cache.again = False
        try:
            error = self._check_replica() or check_gradients(grads, self._slots, self._cache, given)
            if error is None and self._transport.gpu is not None:
                # torch's queued writes to the gradients are done before any device work of the window
                # (and a CUDA error it reports is this rank's error, agreed, not a raise on one rank)
                with self._on_device():
                    cuda.wait_for_torch()
        except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
            self._cache.again = False
            given[:] = [None] * len(given)
            return f"could not read the gradients: {type(e).__name__}: {e}"
        return error

    def _check_replica(self) -> str | None:
        params = self._params
        if len(params) != len(self._contract):
            return f"the parameter mapping changed after initialize: {len(params)} names, expected {len(self._contract)}{REBUILD}"
        get, signature = params.get, arrays.signature
        for (name, array, sig), info in zip(self._replica, self._infos):
            if get(name, None) is not array:
                return f"parameter {name!r} was replaced or removed after initialize{REBUILD}"
            if signature(array) == sig:
                continue
            now = arrays.describe(array)
            if now != info:
                return f"parameter {name!r} changed after initialize ({_changes(info, now)}){REBUILD}"
        return None

    def _usable(self) -> None:
        if self._closed:
            raise ContractError("this DataParallel is closed")
        if self._failed is not None:
            raise CollectiveError(f"an earlier collective failed ({self._failed}); this DataParallel cannot be used")

    # ------------------------------------------------- flat gradient storage

    def gradient_buffers(self) -> dict[str, Any]:
        """Return persistent zeroed gradient arrays, one per trainable tie group.

        Local; no communication. The arrays are views into one flat buffer
        per dtype (of the parameters' backend and device), laid out in the
        order :meth:`reduce` moves them, so that reducing them needs no
        packing: float32 gradients are summed and scaled in place, chunk by
        chunk. They are allocated on the first call; later calls return the
        same arrays. Accumulate into them in place, pass them to
        :meth:`reduce`, and clear them with :meth:`zero_gradients`.
        """
        if self._cache.flat is None:
            groups = self._slots.groups
            self._cache.flat = layout.FlatGradients(
                [g.param for g in groups], [g.info for g in groups], self._slots.sizes, len(self._transport.stage)
            )
        return {g.name: a for g, a in zip(self._slots.groups, self._cache.flat.arrays)}

    def facts(self) -> Facts:
        """What an owner of overlapped windows needs: communicator, slot sizes, chunk, root, device, timeout (local)."""
        timeout = None if self._watchdog is None else self._watchdog.timeout
        return Facts(self._comm, self._slots.sizes, self._chunk_bytes, self._root, self._device, timeout)

    def fail(self, error: CollectiveError) -> None:
        """Mark the session broken by ``error`` (an adapter's MPI call failed mid-window): every later call raises (local)."""
        self._failed = str(error)

    def zero_gradients(self) -> None:
        """Set every array of :meth:`gradient_buffers` to zero (local, one fill per dtype)."""
        if self._cache.flat is not None:
            with self._on_device():
                self._cache.flat.zero()

    def _on_device(self) -> Any:
        """A context in which the session's CUDA device is current (nothing for host sessions)."""
        gpu = self._transport.gpu
        return contextlib.nullcontext() if gpu is None else gpu.current()

    # ------------------------------------------------------------- utilities

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
            if not done:
                try:
                    if it is None:
                        it = iter(batches)
                    batch = next(it)
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
            error = self._check_replica()
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
        """:func:`records.agree` on this session; where a rank is in :meth:`close`, every rank closes, then raises (collective)."""
        try:
            return records.agree(self._comm, frame, error, operation, judge, agreed)
        except records.OperationsDiffer as e:
            if e.closing:
                self._closing = True
                self.close()
            raise ContractError(str(e)) from None  # the user's error type, as for every other refusal

    def close(self) -> None:
        """Agree that every rank closes, then free the private communicator (collective). Idempotent.

        A rank in another mpidp operation meanwhile (it made a ``reduce`` this
        rank skipped, or called one alone) is one ContractError on every rank,
        naming where each rank is; the session is closed on every rank then
        (here after freeing what it holds). A session still open when the
        interpreter exits is closed then, before MPI is finalized.
        """
        if self._closed:
            return
        error = self._agree_close()
        self._closed = True
        guard.forget_at_exit(self)
        self._cache.forget()  # release the last windows' gradient arrays
        try:
            self._comm.close()  # watched, like every collective of the session
        finally:
            if self._watchdog is not None:
                self._watchdog.close()
        if error is not None:
            raise error

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
        except ContractError as e:  # ranks in different operations: closed on every rank
            return ContractError(str(e))
        return None

    def _close_at_exit(self) -> None:
        """:meth:`close`, from the interpreter's exit (the other ranks' error then says so)."""
        self._exiting = True
        self.close()

    def __enter__(self) -> DataParallel:  # noqa: PYI034 - Self needs Python 3.11
        """Return this session (local)."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the session (collective, like :meth:`close`)."""
        self.close()


# ---------------------------------------------------------------- sessions


def start(
    params: Mapping[str, Any], comm: MPIComm | None, root: Any, frozen: Any, options: dict[str, Any], regions: checks.ByteRegions
) -> DataParallel:
    """:meth:`DataParallel.initialize` with named byte ``regions`` moved from root too (collective).

    ``options`` are initialize's keyword arguments. The regions' entries are
    part of the initialize record, and ``regions.error`` is this rank's
    error (before the core's own): one agreement, one communicator, one
    watchdog for the parameters and the regions. The watchdog is armed
    before the communicator's Dup: every collective of the session is
    watched, from the first (a rank that never comes) to ``close``.
    """
    try:
        timeout, setup_error = guard.resolve_timeout(options["timeout"]), None
    except ValueError as e:  # refused on every rank at the agreement, which the default watches meanwhile
        timeout, setup_error = guard.DEFAULT_TIMEOUT, str(e)
    dogs: list[guard.Watchdog] = []

    def arm(c: Communicator) -> None:
        if timeout:
            dogs.append(guard.Watchdog(c, timeout))

    try:
        c = _mpi.duplicate(comm, arm)
    except BaseException:
        for dog in dogs:
            dog.close()
        raise
    watchdog = dogs[0] if dogs else None
    try:
        _warn_launch(c.rank == root)
        local = checks.setup(c, params, root, frozen, options, regions, setup_error)  # check locally
        everyone = records.agree(c, local.setup, local.error, "initialize: agreement")  # agree
        self = DataParallel(c, params, local, watchdog)
        self._broadcast(everyone)  # move
        self._move_regions(regions, "buffers: Bcast")
    except BaseException:
        try:
            c.close()
        finally:
            if watchdog is not None:
                watchdog.close()
        raise
    if c.size > 1:  # the latest session decides, for the process
        guard.install_abort_hook(_mpi.world().rank, bool(options["abort_on_exception"]))
    guard.close_at_exit(self, self._close_at_exit)
    return self


def _warn_launch(root: bool) -> None:
    """Warn (at initialize's caller) of a world of 1 the launcher meant larger, and, on root, once, of unknown MPIDP_ names."""
    world = _mpi.world()
    warning = launch.check_world(world.size, world.library)
    if warning is not None:
        warnings.warn(warning, launch.LaunchWarning, stacklevel=4)
    unknown = launch.unknown_variables_once() if root else None  # root's word: once per job
    if unknown is not None:
        warnings.warn(unknown, launch.VariableWarning, stacklevel=4)


def broadcast_regions(dp: DataParallel, regions: checks.ByteRegions, operation: str) -> None:
    """Copy root's named byte regions into every rank's, after agreeing on them (collective).

    Raises ContractError on every rank, with nothing modified, when a rank
    reported ``regions.error`` or holds regions other than rank 0's.
    """
    dp._usable()  # a closed or broken session says so, on every rank alike
    frame = dp._frame.new(records.REGIONS)
    frame[records.RegionsRecord.DIGEST] = records.RegionsRecord.digest(regions.entries)
    rows = dp._agree(frame, regions.error, f"{operation}: agreement")
    if records.RegionsRecord.differ(rows):  # every rank holds the same rows: all fetch the entries, or none
        sent = dp._comm.allgather_obj(tuple(tuple(r) for r in regions.entries), f"{operation}: entries")
        records.refuse(records.regions_disagreement(records.RegionsRecord.decode(sent)))
    dp._move_regions(regions, f"{operation}: Bcast")


def _check_weight(local_weight: Any, policy: Any, error: str | None) -> tuple[int, int, str | None]:
    """The weight and policy code of this rank's window record, and the first error (local)."""
    weight = 0
    if type(local_weight) is int and 0 <= local_weight <= U64_MAX:
        weight = local_weight
    elif isinstance(local_weight, bool) or not isinstance(local_weight, numbers.Integral):
        error = error or f"local_weight must be a non-negative int, got {type(local_weight).__name__} {local_weight!r}"
    elif not 0 <= int(local_weight) <= U64_MAX:
        error = error or f"local_weight {local_weight} is outside [0, 2**64 - 1]"
    else:
        weight = int(local_weight)
    if policy.__class__ is MissingGradientPolicy:
        return weight, policy.value, error
    return weight, 255, error or f"policy must be a MissingGradientPolicy, got {policy!r}"


#: what every "changed after initialize" error tells the user to do
REBUILD = "; build a new DataParallel after changing the model (mpidp does not follow a model changed after it was built)"


def _changes(was: arrays.ArrayInfo | None, now: arrays.ArrayInfo | None) -> str:
    """What differs between a parameter's description at initialize and now, field by field."""
    if was is None or now is None:
        return f"{now} was {was}"
    fields = ("backend", "dtype", "shape", "device")
    return ", ".join(f"{f} {getattr(now, f)} was {getattr(was, f)}" for f in fields if getattr(now, f) != getattr(was, f))


def _check_step(step: Any, error: str | None) -> tuple[int, str | None]:
    """The STEP word of this rank's window record (step + 1), and the first error (local)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return 0, error or f"step must be None or a non-negative int, got {type(step).__name__} {step!r}"
    if not 0 <= int(step) < U64_MAX:
        return 0, error or f"step {step} is outside [0, 2**64 - 2]"
    return int(step) + 1, error


def _check_global_weight(global_weight: int) -> None:
    """Refuse a window whose agreed global weight is 0 or does not fit in 64 bits (every rank alike)."""
    if not 0 < global_weight <= U64_MAX:
        if global_weight:
            raise ContractError(f"the global weight {global_weight} does not fit in 64 bits")
        raise ContractError("the global weight is 0: no rank has a token in this window, nothing to normalize")
