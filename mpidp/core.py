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

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from . import checks, cuda, guard, launch, layout, records, window
from . import comm as _mpi
from .checks import ByteRegions
from .comm import Communicator, MPIComm
from .errors import CollectiveError, ContractError
from .exact import sums as exact
from .layout import flat_parameters
from .packing import DEFAULT_CHUNK_BYTES
from .records import U64_MAX, Window
from .session import Session, close_elsewhere
from .window import Agreed, Checked, Given, MissingGradientPolicy, ReducedGradients

T = TypeVar("T")

__all__ = ["Agreed", "ByteRegions", "Checked", "DataParallel", "Facts", "MPIComm", "MissingGradientPolicy", "ReducedGradients", "broadcast_regions", "flat_parameters", "start"]


class Facts(NamedTuple):
    """What an adapter's owner of overlapped windows needs to know about the session (:meth:`DataParallel.facts`)."""

    comm: Communicator  # the session's communicator
    sizes: tuple[int, ...]  # values per reduction slot (one per trainable tie group, in :attr:`DataParallel.trainable` order)
    chunk_bytes: int
    root: int
    device: str
    timeout: float | None  # the watchdog's seconds (None: off)
    exact: Any = None  # the session's exact sums (:class:`mpidp.exact.window.ExactWindow`; None: not exact)
    params: tuple[Any, ...] = ()  # the parameter array of each reduction slot (a sharded optimizer's owners write them)


class DataParallel(Session):
    """A rank's replicated training session over a private duplicate of ``comm``.

    Create it with :meth:`initialize`. Local object identities may differ
    between ranks: names and tie topology decide the order of collectives.
    """

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
        name: str | None = None,
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

        Sessions over the same ranks agree on one shared communicator: a
        rank in one session's call while another is in a different session's
        is one ContractError on every rank, naming each rank's call and session
        (``session 2``: made second; with ``name``, every rank's alike, ``session 2 ('critic')``).

        Raises ContractError on every rank if any rank's replica is invalid
        or differs from another's; nothing is modified then.
        """
        options: dict[str, Any] = {"chunk_bytes": chunk_bytes, "device": device, "abort_on_exception": abort_on_exception, "timeout": timeout}
        options.update(exact=exact, name=name)
        return start(params, comm, root, frozen, options, checks.NO_REGIONS)

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
        summed in float32 (``exact=True``: in integers) and cast back to the
        parameter's dtype, bitwise equal on every rank.

        The results are written into the caller's arrays and returned under
        the names they came with; a globally present parameter this rank has
        no gradient for (policy ZERO, or weight 0) gets a new array. A rank
        of weight 0 counts as zeros; parameters no weighted rank has a
        gradient for are absent from the result.

        ``step`` (a number the caller counts, such as the optimizer step):
        when any rank passes one, every rank must pass the same one, so that
        a rank that skipped or repeated a ``reduce`` is an error everywhere.
        Refilling the same arrays every window is the fast path: unchanged,
        they skip their checks, and their views are kept (the arrays
        referenced) until a window on other arrays, one that raises, or ``close``.

        Raises ContractError identically on every rank, before anything is
        modified, when any rank's input is invalid, ranks disagree on the
        policy or the step, or the global weight is 0; CollectiveError if MPI
        fails while gradients move (the gradients are then unspecified, and
        every later call on this session raises CollectiveError too).
        """
        agreed = self.agree_window(self.check_window(grads, local_weight, policy, step=step))
        operation = f"reduce (window {self._window})"
        try:
            if self._exact is not None:
                out = self._exact.reduce(agreed, self._comm, self._chunk_bytes, operation)
            else:
                out = self._move(agreed, operation)
        except CollectiveError as e:
            self._failed = str(e)
            self._cache.forget()  # a broken session holds no gradient arrays
            raise
        return ReducedGradients(out, agreed.global_weight)

    def reduce_exact(self, agreed: Agreed, targets: Sequence[Any], operation: str) -> None:
        """The exact path's movement of an agreed window into ``targets`` (a float32 host array per present slot; collective).

        What an owner of overlapped windows falls back to where its buckets'
        sums do not hold; the window's folds are gone afterwards. Raises
        CollectiveError if MPI fails (the session is then broken).
        """
        if self._exact is None:
            raise ContractError("reduce_exact needs an exact session: DataParallel.initialize(..., exact=True)")
        try:
            self._exact.reduce(agreed, self._comm, self._chunk_bytes, operation, targets)
        except CollectiveError as e:
            self._failed = str(e)
            raise

    def reduce_exact_owned(self, agreed: Agreed, bounds: Sequence[int], pieces: Any, out: Any, operation: str) -> bool:
        """The exact path's movement of only this rank's slice of the flat trainable storage into ``out`` (collective).

        ``bounds``: every rank's slice of the storage (slots back to back in
        index order); ``pieces(lo, hi)``: the slots of a flat range (as
        :func:`mpidp.cut.pieces`). False, with nothing moved, where the agreed window does
        not allow it (:meth:`mpidp.exact.window.ExactWindow.reduce_owned`): then
        :meth:`reduce_exact` the whole. Raises CollectiveError if MPI fails.
        """
        if self._exact is None:
            raise ContractError("reduce_exact_owned needs an exact session: DataParallel.initialize(..., exact=True)")
        try:
            return self._exact.reduce_owned(agreed, self._comm, self._chunk_bytes // 4, bounds, pieces, out, operation)
        except CollectiveError as e:
            self._failed = str(e)
            raise

    def _move(self, agreed: Agreed, operation: str) -> dict[str, Any]:
        """Sum, divide and cast back the agreed window's gradients (collective): the results by name."""
        entry = self._cache.plan(agreed.key, self._slots.sizes, len(self._transport.stage), self._slots.kinds)
        with self._on_device():  # device work (zeros, contiguous copies, casts, streams and events) on the session's device
            return window.reduce_slots(
                self._transport, self._cache, entry, self._slots.groups, agreed.given, agreed.weight, agreed.global_weight, operation
            )

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
            weight, code, error = window.check_weight(local_weight, policy, error)
        if step is None:
            step_word = 0
        elif type(step) is int and 0 <= step < U64_MAX:
            step_word = step + 1
        else:
            step_word, error = window.check_step(step, error)
        if self._exact is None:
            complete = None not in given  # Given never equals None: an identity test per entry, in C
            present = [] if complete else [x is not None for x in given]
        else:  # a slot folded earlier in the window is present too
            present = self._exact.measure(given)
            complete = all(present)
        if error is None and code == MissingGradientPolicy.ERROR.value and weight > 0 and not complete:
            missing = self._slots.groups[present.index(False)].name
            error = (
                f"parameter {missing!r} has no gradient (policy ERROR, local weight {weight}); "
                "pass policy=MissingGradientPolicy.ZERO if it is legitimately unused"
            )
        if self._exact is not None:
            error = error or self._exact.error
        presence = self._slots.complete if complete else self._slots.presence(present)
        return Checked(given, weight, code, step_word, presence, error)

    def agree_window(self, checked: Checked, error: str | None = None, extra: int = 0) -> Agreed:
        """:meth:`reduce` up to the movement: one exchange of the checked window (collective; moves no gradient).

        ``error`` is one more local error found after :meth:`check_window`;
        ``extra`` a word of the caller's own, every rank's returned in
        :attr:`Agreed.extra`. Raises ContractError on every rank as :meth:`reduce`
        does; otherwise every rank holds the same facts of the window.
        """
        error = checked.error or error
        if self._window_frame.size < self._comm.width:  # a session made since is wider: every rank's record grows alike
            self._window_frame = self._frame.new(records.WINDOW, self._comm.width)
        Window.fill(self._window_frame, checked.step, checked.code, checked.weight, checked.presence, extra)
        if self._exact is not None:
            self._exact.words(self._window_frame)
        try:
            operation = f"reduce (window {self._window}): exchange"
            rows = self._agree(self._window_frame, error, operation, self._judge, Window.AGREED)
            global_weight, key = Window.facts(rows, self._slots.words)
            window.check_global_weight(global_weight)
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
            error = window.check_replica(self._params, self._replica, self._infos) or window.check_gradients(grads, self._slots, self._cache, given)
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
        params = tuple(g.param for g in self._slots.groups)
        return Facts(self._comm, self._slots.sizes, self._chunk_bytes, self._root, self._device, timeout, self._exact, params)

    def fail(self, error: CollectiveError) -> None:
        """Mark the session broken by ``error`` (an adapter's MPI call failed mid-window): every later call raises (local)."""
        self._failed = str(error)

    def zero_gradients(self) -> None:
        """Set every array of :meth:`gradient_buffers` to zero (local, one fill per dtype)."""
        if self._cache.flat is not None:
            with self._on_device():
                self._cache.flat.zero()

    def __enter__(self) -> DataParallel:  # noqa: PYI034 - Self needs Python 3.11
        """Return this session (local)."""
        return self


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
        c = _mpi.duplicate(comm, arm, _announce)
    except BaseException:
        for dog in dogs:
            dog.close()
        raise
    watchdog = dogs[0] if dogs else None
    try:
        _warn_launch(c.rank == root)
        local = checks.setup(c, params, root, frozen, options, regions, setup_error)  # check locally
        everyone = records.agree(c, local.setup, local.error, "initialize: agreement")  # agree
        c.label = f"session {c.session}" + ("" if everyone[0].name is None else f" ({everyone[0].name!r})")
        self = DataParallel(c, params, local, watchdog)
        self._broadcast(everyone)  # move
        self._move_regions(regions, "buffers: Bcast")
        _warn_exact(local.setup.exact and c.rank == root, local.exact_mode)
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


def _announce(c: Communicator) -> None:
    """Tell the job's other sessions that every rank makes session ``c.session`` (collective, on the job's communicator).

    A rank in another session's call meanwhile is one ContractError on every
    rank, as between the calls of one session; a session some rank is closing
    is closed on every rank.
    """
    try:
        records.agree(c, records.Frame(0).new(records.INITIALIZE, c.width), None, "initialize: announcing the session")
    except records.OperationsDiffer as e:
        close_elsewhere(c, e.closes)
        raise ContractError(str(e)) from None


def _warn_launch(root: bool) -> None:
    """Warn (at initialize's caller) of a world of 1 the launcher meant larger, and, on root, once, of unknown MPIDP_ names."""
    world = _mpi.world()
    warning = launch.check_world(world.size, world.library)
    if warning is not None:
        warnings.warn(warning, launch.LaunchWarning, stacklevel=4)
    unknown = launch.unknown_variables_once() if root else None  # root's word: once per job
    if unknown is not None:
        warnings.warn(unknown, launch.VariableWarning, stacklevel=4)


def _warn_exact(root: bool, mode: str) -> None:
    """On root, once per process: an exact session that runs NumPy's passes says what it costs and how to avoid it."""
    slow = exact.slow_passes_once(mode) if root else None
    if slow is not None:
        warnings.warn(slow, exact.SlowPassesWarning, stacklevel=4)


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
