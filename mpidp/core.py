"""DataParallel: check locally, agree globally, then move bytes."""

from __future__ import annotations

import contextlib
import enum
import itertools
import numbers
import warnings
import weakref
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, contract, cuda, guard, launch
from . import comm as _mpi
from .comm import Communicator
from .errors import CollectiveError, ContractError
from .packing import (
    BCAST_OWN_BYTES,
    BCAST_SPLIT_BYTES,
    DEFAULT_CHUNK_BYTES,
    Call,
    Slot,
    Step,
    bcast_calls,
    plan,
    reduce_calls,
    run_steps,
    slot,
    steps,
)

__all__ = ["DataParallel", "MissingGradientPolicy", "ReducedGradients", "flat_parameters"]

_U64_MAX = (1 << 64) - 1
_REDUCE, _VERIFY = 1, 2  # exchange record tags
#: reduce record: tag, policy, error flag, window, weight, presence words; every rank must agree on the first four
_AGREED = slice(0, 4)
_OPERATIONS = {_REDUCE: "reduce", _VERIFY: "verify_replicas"}
#: up to this many ranks the exchange table is checked as Python ints, beyond it with NumPy
_LIST_RANKS = 64


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


class DataParallel:
    """A rank's replicated training session over a private duplicate of ``comm``.

    Create it with :meth:`initialize`. Local object identities may differ
    between ranks: names and tie topology decide the order of collectives.
    """

    def __init__(
        self,
        comm: Communicator,
        params: Mapping[str, Any],
        local: contract.Local,
        chunk_bytes: int,
        watchdog: guard.Watchdog | None,
        cuda_aware: tuple[bool, str],
        root: int,
        stage: Any,
        device: cuda.Device | None,
    ) -> None:
        self._comm = comm
        self._params = params
        self._contract = local.contract
        self._arrays = local.arrays
        self._infos = local.infos
        self._device = local.device
        self._signatures = tuple(arrays.signature(a) for a in local.arrays)
        #: (name, array, signature) per entry: what _check_replica compares every window
        self._replica = tuple(zip((e.name for e in local.contract), local.arrays, self._signatures))
        self._cuda_aware = cuda_aware
        self._root = root
        self._chunk_bytes = chunk_bytes
        self._watchdog = watchdog
        self._stage: Any = stage  # one chunk of float32: host memory, or device memory for device arrays
        #: the device's buffers and transfers (device arrays), else None
        self._gpu = device
        #: contract indices of the trainable tie-group heads: one reduction slot each
        self._slots = tuple(i for i, e in enumerate(self._contract) if e.trainable and e.alias == i)
        slot_of_head = {head: s for s, head in enumerate(self._slots)}
        #: every trainable name (tied ones included) -> its reduction slot
        self._slot_of = {
            e.name: slot_of_head[e.alias] for e in self._contract if e.trainable
        }
        self._frozen = frozenset(e.name for e in self._contract if not e.trainable)
        self._sizes = tuple(self._infos[i].size for i in self._slots)
        #: presence bits -> (the plan, the globally present slots)
        self._plans: dict[tuple[int, ...], tuple[tuple[Call, ...], list[int]]] = {}
        self._words = (len(self._slots) + 63) // 64
        #: the presence words of a rank that has every gradient
        self._complete = np.zeros(self._words, dtype=np.uint64)
        self._complete.view(np.uint8)[: (len(self._slots) + 7) // 8] = np.packbits(np.ones(len(self._slots), dtype=bool))
        #: contract indices of every tie-group head (frozen ones included): what is broadcast and verified
        self._heads = tuple(i for i, e in enumerate(self._contract) if e.alias == i)
        #: every exchange record has this length, so mismatched operations still match in MPI
        self._record_words = max(5 + self._words, 2 + len(self._heads))
        self._reduce_record = self._record(_REDUCE)
        self._window = 0
        self._closed = False
        self._failed: str | None = None  # set by the first CollectiveError: the session is unusable
        self._flat: dict[str, Any] | None = None  # dtype -> flat gradient storage
        self._flat_views: dict[str, Any] = {}
        #: reduction slot -> (flat-storage gradient, its fingerprint, view and Slot), built by gradient_buffers
        self._flat_slots: dict[int, tuple[Any, tuple[Any, ...], Any, Slot]] = {}
        #: name -> (weak reference, fingerprint, slot, flat-storage entry or None) of every gradient of the last window that passed the
        #: checks: the same objects, unchanged, pass again without a second look (weak, so that a
        #: caller who allocates new gradients every window does not keep the old ones alive)
        self._accepted: dict[str, tuple[Any, tuple[Any, ...], int, Any]] = {}
        self._accepted_serial = 0  # counts the sets of gradients accepted; a program belongs to one
        self._again = False  # this window's gradients are the last accepted ones, unchanged
        #: (plan entry, accepted serial, host steps, result) of the last window whose gradients were
        #: the same arrays as the window before: the next such window reruns the steps as they are
        self._program: tuple[Any, int, tuple[Step, ...], dict[str, Any]] | None = None

    # ------------------------------------------------------------------ set-up

    @classmethod
    def initialize(
        cls,
        params: Mapping[str, Any],
        comm: Any = None,
        root: int = 0,
        frozen: Any = (),
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device: str | None = None,
        abort_on_exception: bool = True,
        timeout: float | None = None,
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
        leaving the others waiting. ``timeout`` (seconds, default from
        ``MPIDP_TIMEOUT``) arms a watchdog that aborts the job when a rank
        waits longer than that in one mpidp collective.

        Raises ContractError on every rank if any rank's replica is invalid
        or differs from another's; nothing is modified then.
        """
        c = _mpi.duplicate(comm)
        world = _mpi.world()
        warning = launch.check_world(world.size, world.library)
        if warning is not None:
            warnings.warn(warning, launch.LaunchWarning, stacklevel=2)
        setup_error: str | None = None
        try:
            timeout = guard.resolve_timeout(timeout)
        except ValueError as e:
            setup_error, timeout = str(e), None
        watchdog = guard.Watchdog(c, timeout) if timeout else None
        try:
            try:
                local = contract.build(params, frozen, device)
            except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
                local = contract.Local((), (), (), f"could not read the parameters: {type(e).__name__}: {e}")
            error = local.error or setup_error
            aware = (False, "host arrays")
            if local.device != "cpu":
                try:
                    import cupy  # noqa: F401 - device staging, casts and scaling run in CuPy

                    aware = cuda.detect(c.comm)
                except ImportError:
                    error = error or "GPU arrays need CuPy (pip install mpidp[cupy])"
                except ValueError as e:
                    error = error or str(e)
            if isinstance(root, bool) or not isinstance(root, numbers.Integral) or not 0 <= root < c.size:
                error = error or f"root {root!r} is outside the world of {c.size} ranks"
                root = -1
            if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or chunk_bytes < 4096:
                error = error or f"chunk_bytes must be an integer of at least 4096, got {chunk_bytes!r}"
                chunk_bytes = 0
            stage: Any = None
            gpu: cuda.Device | None = None
            if error is None:  # before the ranks agree: a rank that cannot allocate them is an error on every rank
                try:
                    stage, gpu = _chunk_buffers(local.device, int(chunk_bytes) // 4 * 4, aware[0])
                except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
                    error = f"could not allocate the chunk buffers (chunk_bytes={chunk_bytes}, {local.device}): {type(e).__name__}: {e}"
            runs = _runs(local) if error is None else None
            record = (tuple(tuple(e) for e in local.contract), int(root), int(chunk_bytes) // 4 * 4, error, _on_host(local), runs)
            records = c.allgather_obj(record)
            for rank, (_, _, _, err, _, _) in enumerate(records):
                if err is not None:
                    raise ContractError(f"rank {rank}: {err}")
            head = records[0]
            reference = tuple(contract.Entry(*e) for e in head[0])
            for rank, (entries, r, chunk, _, _, _) in enumerate(records):
                difference = contract.diff(reference, tuple(contract.Entry(*e) for e in entries))
                if difference is not None:
                    raise ContractError(f"rank {rank} differs from rank 0: {difference}")
                if r != head[1]:
                    raise ContractError(f"rank {rank} broadcasts from root {r}, rank 0 from root {head[1]}")
                if chunk != head[2]:
                    raise ContractError(f"rank {rank} uses chunk_bytes={chunk}, rank 0 chunk_bytes={head[2]}")
            self = cls(c, params, local, int(chunk_bytes) // 4 * 4, watchdog, aware, int(root), stage, gpu)
            # calls above chunk_bytes, and small calls of their own, only where no rank stages device memory
            # through its chunk-sized pinned buffer; whole memory runs (flat_parameters) only where every rank
            # has the same runs. Agreed facts only: every rank must build the same calls.
            host = all(r[4] for r in records)
            same_runs = host and runs is not None and all(r[5] == runs for r in records)
            self._broadcast(
                int(root),
                BCAST_SPLIT_BYTES if host else None,
                runs if same_runs else None,
                BCAST_OWN_BYTES if host else None,
            )
        except BaseException:
            if watchdog is not None:
                watchdog.close()
            c.close()
            raise
        if c.size > 1:  # the latest session decides, for the process
            guard.install_abort_hook(world.rank, bool(abort_on_exception))
        return self

    def _broadcast(
        self, root: int, split: int | None, runs: tuple[tuple[int, ...], ...] | None = None, own: int | None = None
    ) -> None:
        """Bcast every tie-group head from ``root``: array by array, or by runs of adjacent memory (see :func:`_runs`).

        ``split``, ``runs`` and ``own`` (slots of at least ``own`` bytes get calls of their own, smaller ones
        are packed; None: the reduce plan's quarter chunk) must be the same on every rank.
        """
        if runs is None:
            slots = [slot(arrays.view(self._arrays[i])) for i in self._heads]
        else:
            heads = [self._arrays[i] for i in self._heads]
            slots = [slot(_region(heads, run)) for run in runs]
        calls = plan([s.flat.nbytes for s in slots], [True] * len(slots), self._chunk_bytes, split, own)
        label = "initialize: Bcast"
        gpu, comm = self._gpu, self._comm
        if gpu is None:
            bcast: Any = lambda b: comm.Bcast(b, root, label)
        else:
            bcast = lambda b: gpu.bcast(comm, b, root, label)
        bcast_calls(calls, slots, self._stage.view(np.uint8), bcast, self.rank == root)

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
        return tuple(self._contract[i].name for i in self._slots)

    # ------------------------------------------------------------------ window

    def _check_replica(self) -> str | None:
        params = self._params
        if len(params) != len(self._contract):
            return f"the parameter mapping changed after initialize: {len(params)} names, expected {len(self._contract)}"
        get, signature = params.get, arrays.signature
        for (name, array, sig), info in zip(self._replica, self._infos):
            if get(name, None) is not array:
                return f"parameter {name!r} was replaced or removed after initialize"
            if signature(array) == sig:
                continue
            now = arrays.describe(array)
            if now != info:
                return f"parameter {name!r} changed after initialize: {now} was {info}"
        return None

    def _check_gradients(
        self, grads: Any, local: list[Any], views: list[Any], names: list[str | None], prepared: list[Any]
    ) -> str | None:
        self._again = False
        if not isinstance(grads, Mapping):
            return f"grads must be a mapping of names to arrays, got {type(grads).__name__}"
        if self._accepted_again(grads, local, views, names, prepared):
            self._again = True
            return None
        self._accepted, self._program = {}, None
        self._accepted_serial += 1
        seen: dict[int, str] = {}
        entries: dict[str, tuple[Any, int, Any]] = {}  # name -> (gradient, slot, flat-storage entry or None)
        for name in sorted(grads, key=str):
            index = self._slot_of.get(name)
            if index is None:
                kind = "frozen" if name in self._frozen else "unknown"
                return f"gradient for {kind} parameter {name!r}"
            if names[index] is not None:
                return f"two gradients for one tied array: {names[index]!r} and {name!r}"
            g = grads[name]
            if id(g) in seen:
                return f"gradients {seen[id(g)]!r} and {name!r} are the same array (each needs its own)"
            seen[id(g)] = name
            info = arrays.describe(g)
            p = self._infos[self._slots[index]]
            if info is None:
                return f"gradient {name!r} is a {type(g).__name__}, not an array"
            for field in ("shape", "dtype", "device"):
                if getattr(info, field) != getattr(p, field):
                    return f"gradient {name!r}: {field} {getattr(info, field)} differs from its parameter's {getattr(p, field)}"
            why = arrays.problem(g)
            if why is not None:
                return f"gradient {name!r}: {why}"
            local[index] = g
            flat = self._flat_slot(index, g)
            views[index] = flat[2] if flat is not None else arrays.view(g)
            prepared[index] = None if flat is None else flat[3]
            names[index] = name
            entries[name] = (g, index, flat)
        why = _overlap(views, names)
        if why is None:
            try:
                self._accepted = {
                    name: (weakref.ref(g), arrays.fingerprint(g) if flat is None else flat[1], index, flat)
                    for name, (g, index, flat) in entries.items()
                }
            except TypeError:  # an array type without weak references: checked in full every window
                self._accepted = {}
        return why

    def _accepted_again(
        self, grads: Mapping[str, Any], local: list[Any], views: list[Any], names: list[str | None], prepared: list[Any]
    ) -> bool:
        """Fill the window's lists if ``grads`` are the last accepted window's arrays, unchanged."""
        accepted = self._accepted
        if not accepted or len(grads) != len(accepted):
            return False
        fingerprint = arrays.fingerprint
        for name, g in grads.items():
            entry = accepted.get(name)
            if entry is None or entry[0]() is not g or fingerprint(g) != entry[1]:
                n = len(local)
                local[:], views[:], names[:], prepared[:] = [None] * n, [None] * n, [None] * n, [None] * n
                return False
            index, flat = entry[2], entry[3]
            local[index], names[index] = g, name
            if flat is None:  # a caller's array: only its view is needed again
                views[index] = arrays.view(g)
            else:  # mpidp's own flat storage, unchanged since its fingerprint was taken
                views[index], prepared[index] = flat[2], flat[3]
        return True

    def _flat_slot(self, index: int, g: Any) -> tuple[Any, tuple[Any, ...], Any, Slot] | None:
        """The prepared view and Slot of ``g`` if it is the unchanged flat-storage gradient of ``index``."""
        flat = self._flat_slots.get(index)
        return flat if flat is not None and flat[0] is g and arrays.fingerprint(g) == flat[1] else None

    def reduce(
        self,
        grads: Mapping[str, Any],
        local_weight: int,
        policy: MissingGradientPolicy = MissingGradientPolicy.ERROR,
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

        Refilling the same arrays every window is the fast path: arrays that
        are the last window's objects, unchanged, skip their checks, and from
        the second window in a row the views cut for them are kept (and the
        arrays referenced) until a window on other arrays, a window that raises,
        or ``close``.

        Raises ContractError identically on every rank, before anything is
        modified, when any rank's input is invalid, ranks disagree on the
        policy, or the global weight is 0. Raises CollectiveError if MPI
        fails while gradients move: like the reference design, which consumes
        its input, the gradient arrays are then unspecified, and every later
        call on this session raises CollectiveError too.
        """
        self._usable()
        self._window += 1
        n = len(self._slots)
        local: list[Any] = [None] * n
        views: list[Any] = [None] * n
        names: list[str | None] = [None] * n
        prepared: list[Any] = [None] * n  # Slots of mpidp's own flat storage, built once
        self._again = False
        try:
            error = self._check_replica() or self._check_gradients(grads, local, views, names, prepared)
            if error is None and self._device != "cpu":
                # torch's queued writes to the gradients are done before any device work of the window
                # (and a CUDA error it reports is this rank's error, agreed, not a raise on one rank)
                with self._on_device():
                    cuda.wait_for_torch()
        except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
            self._again = False
            local, views, names, prepared = [None] * n, [None] * n, [None] * n, [None] * n
            error = f"could not read the gradients: {type(e).__name__}: {e}"
        weight = 0
        if type(local_weight) is int and 0 <= local_weight <= _U64_MAX:  # the usual case, cheaply
            weight = local_weight
        elif isinstance(local_weight, bool) or not isinstance(local_weight, numbers.Integral):
            error = error or f"local_weight must be a non-negative int, got {type(local_weight).__name__} {local_weight!r}"
        elif not 0 <= local_weight <= _U64_MAX:
            error = error or f"local_weight {local_weight} is outside [0, 2**64 - 1]"
        else:
            weight = int(local_weight)
        if policy.__class__ is MissingGradientPolicy:
            code = policy.value
        else:
            error = error or f"policy must be a MissingGradientPolicy, got {policy!r}"
            code = 255
        complete = all(g is not None for g in local)
        if error is None and code == MissingGradientPolicy.ERROR.value and weight > 0 and not complete:
            missing = self._contract[self._slots[next(i for i, g in enumerate(local) if g is None)]].name
            error = (
                f"parameter {missing!r} has no gradient (policy ERROR, local weight {weight}); "
                "pass policy=MissingGradientPolicy.ZERO if it is legitimately unused"
            )
        record = self._reduce_record  # reused: Allgather has copied it out before it returns
        record[1] = code
        record[2] = error is not None
        record[3] = self._window
        record[4] = weight
        presence = record[5 : 5 + self._words]
        if complete:
            presence[...] = self._complete
        else:
            presence[...] = 0
            presence.view(np.uint8)[: (n + 7) // 8] = np.packbits(np.array([g is not None for g in local], dtype=bool))
        label = f"reduce (window {self._window})"
        table = self._comm.Allgather(record, f"{label}: exchange")
        words = self._words
        if len(table) <= _LIST_RANKS:  # a few ranks: Python ints beat a dozen tiny NumPy calls
            rows = table.tolist()
            head = rows[0][:4]
            if head[2] or any(r[:4] != head for r in rows):  # the one check of the usual window
                self._disagreement(table, error)
            global_weight = sum(r[4] for r in rows)  # exact: Python ints
            bits = [0] * words
            for r in rows:
                if r[4]:
                    bits = [a | b for a, b in zip(bits, r[5 : 5 + words])]
            key = tuple(bits)
        else:
            first = table[0]
            if first[2] or not (table[:, _AGREED] == first[_AGREED]).all():
                self._disagreement(table, error)
            weights = table[:, 4]
            global_weight = sum(weights.tolist())
            key = tuple(np.bitwise_or.reduce(table[weights > 0, 5 : 5 + words], axis=0).tolist())
        if not 0 < global_weight <= _U64_MAX:
            self._program = None  # a window that raises keeps no gradient arrays
            if global_weight:
                raise ContractError(f"the global weight {global_weight} does not fit in 64 bits")
            raise ContractError("the global weight is 0: no rank has a token in this window, nothing to normalize")
        entry = self._plans.pop(key, None)  # a small LRU: presence patterns can be endless
        if entry is None:
            globally = np.unpackbits(np.array(key, dtype=np.uint64).view(np.uint8), count=n).astype(bool).tolist()
            entry = (plan(self._sizes, globally, len(self._stage)), [i for i, here in enumerate(globally) if here])
        self._plans[key] = entry
        if len(self._plans) > 8:
            del self._plans[next(iter(self._plans))]
        try:
            # device work (zeros, contiguous copies, casts, streams and events) runs on the session's device
            with self._on_device():
                gradients = self._reduce(entry, local, views, names, prepared, weight, global_weight, label)
        except CollectiveError as e:
            self._failed = str(e)
            self._program, self._accepted = None, {}  # a broken session holds no gradient arrays
            raise
        return ReducedGradients(gradients, global_weight)

    def _disagreement(self, table: np.ndarray, error: str | None) -> None:
        """Raise the error every rank agrees on from an exchange table that is not unanimous."""
        self._program = None  # a window that raises keeps no gradient arrays
        _check_operations(table)
        self._agree(table[:, 2], error)
        other = _first_different(table[:, 3])
        if other is not None:
            raise ContractError(
                f"ranks are in different windows: rank 0 in window {table[0, 3]}, rank {other} in window "
                f"{table[other, 3]} (a rank skipped or added a reduce)"
            )
        codes = table[:, 1]
        other = _first_different(codes)
        if other is not None:
            raise ContractError(
                f"ranks disagree on the missing-gradient policy: rank 0 uses "
                f"{MissingGradientPolicy(int(codes[0])).name}, rank {other} uses {MissingGradientPolicy(int(codes[other])).name}"
            )
        raise ContractError("ranks sent exchange records that disagree")  # pragma: no cover - only if records were misread

    def _usable(self) -> None:
        if self._closed:
            raise ContractError("this DataParallel is closed")
        if self._failed is not None:
            raise CollectiveError(f"an earlier collective failed ({self._failed}); this DataParallel cannot be used")

    def _agree(self, flags: np.ndarray, error: str | None) -> None:
        """Raise every rank's first local error on every rank (collective only if one exists)."""
        if not flags.any():
            return
        errors = self._comm.allgather_obj(error)
        rank = next((r for r, e in enumerate(errors) if e is not None), None)
        if rank is None:  # pragma: no cover - only if records were misread
            raise ContractError("ranks disagree on whether an error occurred")
        raise ContractError(f"rank {rank}: {errors[rank]}")

    def _reduce(
        self,
        entry: tuple[tuple[Call, ...], list[int]],
        local: list[Any],
        views: list[Any],
        names: list[str | None],
        prepared: list[Any],
        weight: int,
        global_weight: int,
        label: str,
    ) -> dict[str, Any]:
        label = f"{label}: Allreduce"

        def allreduce(b: Any) -> None:
            self._comm.Allreduce(b, label)

        program = self._program
        if program is not None and self._again and weight > 0 and program[0] is entry and program[1] == self._accepted_serial:
            # the same arrays as the window that cut these steps, unchanged (same objects, same
            # fingerprints: same memory) and all present; a weighted rank with every gradient makes
            # every slot globally present, so the plan is the same too (checked all the same: cheap)
            run_steps(program[2], allreduce, global_weight)
            return dict(program[3])
        self._program = None
        calls, indices = entry
        out: dict[str, Any] = {}
        slots: list[Any] = prepared  # filled in for every globally present slot
        for index in indices:
            g = local[index]
            if g is None:
                head = self._slots[index]
                g = arrays.zeros_like(self._arrays[head])
                slots[index] = slot(arrays.view(g))
                out[self._contract[head].name] = g
                continue
            if weight == 0:
                views[index][...] = 0
            if slots[index] is None:
                slots[index] = slot(views[index])
            out[names[index]] = g  # type: ignore[index]
        if (
            self._again
            and weight > 0
            and isinstance(self._stage, np.ndarray)
            and all(g is not None for g in local)
            and all(s.original is None for s in slots if s is not None)
        ):
            # the second window in a row on the same arrays: keep the cut views for the next one
            work = steps(calls, slots, self._stage)
            self._program = (entry, self._accepted_serial, work, dict(out))
            run_steps(work, allreduce, global_weight)
            return out
        if self._gpu is None:
            reduce_calls(calls, slots, self._stage, allreduce, global_weight)
        else:
            self._gpu.reduce_calls(self._comm, calls, slots, global_weight, label)
        return out

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
        if self._flat is None:
            order = [seg.slot for call in plan(self._sizes, [True] * len(self._sizes), len(self._stage)) for seg in call.segments]
            offsets: dict[int, tuple[str, int]] = {}
            totals: dict[str, int] = {}
            likes: dict[str, Any] = {}
            for index in dict.fromkeys(order):
                head = self._slots[index]
                dtype = self._infos[head].dtype
                offsets[index] = (dtype, totals.get(dtype, 0))
                totals[dtype] = totals.get(dtype, 0) + self._sizes[index]
                likes.setdefault(dtype, self._arrays[head])
            self._flat = {d: arrays.flat_zeros(likes[d], n) for d, n in totals.items()}
            for index, head in enumerate(self._slots):
                info = self._infos[head]
                if index in offsets:
                    dtype, start = offsets[index]
                    g = self._flat[dtype][start : start + info.size].reshape(info.shape)
                else:  # an empty array
                    g = arrays.zeros_like(self._arrays[head])
                self._flat_views[self._contract[head].name] = g
                v = arrays.view(g)
                self._flat_slots[index] = (g, arrays.fingerprint(g), v, slot(v))
        return dict(self._flat_views)

    def zero_gradients(self) -> None:
        """Set every array of :meth:`gradient_buffers` to zero (local, one fill per dtype)."""
        with self._on_device():
            for flat in (self._flat or {}).values():
                arrays.view(flat)[...] = 0

    def _on_device(self) -> Any:
        """A context in which the session's CUDA device is current (nothing for host sessions)."""
        return contextlib.nullcontext() if self._gpu is None else self._gpu.current()

    # ------------------------------------------------------------- utilities

    def verify_replicas(self) -> None:
        """Check that every rank's parameters are bitwise equal to the root's.

        Collective. Compares a CRC-32 of every parameter's bytes; raises
        ContractError on every rank naming the parameters and ranks that
        differ (and nothing moves but one small Allgather).
        """
        self._usable()
        heads = self._heads
        record = self._record(_VERIFY)
        try:
            error = self._check_replica()
            if error is None:
                for k, i in enumerate(heads):
                    record[2 + k] = zlib.crc32(_bytes(arrays.view(self._arrays[i])))
        except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
            error = f"could not read the parameters: {type(e).__name__}: {e}"
        record[1] = error is not None
        table = self._exchange(record, "verify_replicas")
        self._agree(table[:, 1], error)
        crcs = table[:, 2 : 2 + len(heads)]
        differ = crcs != crcs[self._root]
        if differ.any():
            ranks = np.flatnonzero(differ.any(axis=1))
            names = [self._contract[heads[k]].name for k in np.flatnonzero(differ.any(axis=0))]
            shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise ContractError(
                f"replicas differ from root {self._root} on rank(s) {', '.join(map(str, ranks))}: parameter(s) {shown}"
            )

    def _record(self, operation: int) -> np.ndarray:
        """A zeroed exchange record, one length for every operation, tagged with ``operation``."""
        record = np.zeros(self._record_words, dtype=np.uint64)
        record[0] = operation
        return record

    def _exchange(self, record: np.ndarray, label: str) -> np.ndarray:
        """Allgather ``record``; raise on every rank if ranks are in different operations."""
        table = self._comm.Allgather(record, label)
        _check_operations(table)
        return table

    def close(self) -> None:
        """Free the private communicator (collective). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._program, self._accepted = None, {}  # release the last windows' gradient arrays
        if self._watchdog is not None:
            self._watchdog.close()
        self._comm.close()

    def __enter__(self) -> DataParallel:  # noqa: PYI034 - Self needs Python 3.11
        """Return this session (local)."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the session (collective, like :meth:`close`)."""
        self.close()


def _chunk_buffers(device: str, chunk_bytes: int, cuda_aware: bool) -> tuple[Any, cuda.Device | None]:
    """Allocate a session's chunk-sized buffers (local): the float32 stage, and for device arrays the device's.

    Host arrays get a host stage. Device arrays get a device stage (the casts and scaling run on the
    device) and, where MPI is not CUDA-aware, the pinned staging of :class:`mpidp.cuda.Device`.
    """
    if device == "cpu":
        return np.empty(chunk_bytes // 4, dtype=np.float32), None
    gpu = cuda.Device(device, cuda_aware, chunk_bytes)
    return gpu.stage, gpu


def _on_host(local: contract.Local) -> bool:
    """Whether this rank's arrays are host memory (a fact of the initialize record: plans depend on every rank's)."""
    return local.device == "cpu"


def _bytes(v: Any) -> memoryview:
    """Return the bytes of a host view (device arrays are copied to the host)."""
    if not isinstance(v, np.ndarray):
        v = v.get()
    data: Any = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
    return memoryview(data)


def _check_operations(table: np.ndarray) -> None:
    """Raise on every rank if the ranks of an exchange ``table`` are in different operations."""
    tags = table[:, 0]
    other = _first_different(tags)
    if other is not None:
        raise ContractError(
            f"ranks are in different mpidp operations: rank 0 in {_OPERATIONS.get(int(tags[0]), '?')}, "
            f"rank {other} in {_OPERATIONS.get(int(tags[other]), '?')}"
        )


def _first_different(column: np.ndarray) -> int | None:
    """The first rank whose value differs from rank 0's, or None when all agree."""
    differ = column != column[0]
    return int(np.argmax(differ)) if differ.any() else None


_byte_bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds


def _strided_bounds(address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``[lo, hi)`` byte range of a non-empty strided array starting at ``address`` (as ``numpy.byte_bounds``)."""
    lo = hi = address
    for n, stride in zip(shape, strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + itemsize


def _overlap(views: list[Any], names: list[str | None]) -> str | None:
    """Name two gradients whose memory overlaps (each result needs its own memory), or None."""
    ranges = []
    for v, name in zip(views, names):
        if v is None or not v.size:
            continue
        if isinstance(v, np.ndarray):
            lo, hi = _byte_bounds(v)
        else:  # a CuPy view: device addresses (one device per rank)
            lo, hi = _strided_bounds(v.data.ptr, v.shape, v.strides, v.itemsize)
        ranges.append((lo, hi, name))
    ranges.sort(key=lambda r: r[0])
    for (_, hi, a), (lo, _, b) in itertools.pairwise(ranges):  # the first overlap is between neighbours
        if lo < hi:
            return f"gradients {a!r} and {b!r} share memory (each needs its own)"
    return None


def flat_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """Copy ``params`` into flat storage: one contiguous buffer per backend, dtype and device.

    Local; no communication. Returns a new mapping with the same names whose
    arrays are views into the flat buffers, holding the same values, in the
    order :meth:`DataParallel.initialize` broadcasts them; a tied array (one
    object under several names) becomes one view under the same names. When
    every rank passes parameters laid out like this, ``initialize``
    broadcasts each buffer as one region, in chunk-sized calls with no
    packing, instead of array by array (the same holds for any caller-made layout of adjacent, contiguous
    arrays). Torch tensors keep their ``requires_grad`` flag. Raises
    TypeError for a value that is not a NumPy, CuPy or PyTorch array.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, got {type(params).__name__}")
    unique: dict[int, Any] = {}
    for name in sorted(params, key=str):
        a = params[name]
        if arrays.describe(a) is None:
            raise TypeError(f"parameter {name!r}: {type(a).__name__} is not a NumPy, CuPy or PyTorch array")
        unique.setdefault(id(a), a)
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for a in unique.values():
        info = arrays.describe(a)
        assert info is not None
        groups.setdefault((info.backend, info.dtype, info.device), []).append(a)
    moved: dict[int, Any] = {}
    for members in groups.values():
        sizes = [arrays.describe(a).size for a in members]  # type: ignore[union-attr]
        flat = arrays.flat_zeros(members[0], sum(sizes))
        start = 0
        for a, n in zip(members, sizes):
            v = flat[start : start + n].reshape(tuple(a.shape))
            arrays.view(v)[...] = arrays.view(a)
            if getattr(a, "requires_grad", False):
                v.requires_grad_(True)
            moved[id(a)] = v
            start += n
    return {name: moved[id(a)] for name, a in params.items()}


def _runs(local: contract.Local) -> tuple[tuple[int, ...], ...] | None:
    """Group the non-empty tie-group heads into runs of adjacent contiguous host memory, or None.

    A run is a tuple of positions in the head order whose arrays are
    C-contiguous and follow one another in memory, in address order: one
    region of bytes. Runs are listed in the order of their first head, not
    by address, so that buffers allocated in another order on another rank
    still match. Exchanged in the contract record: ranks with equal runs
    broadcast region by region, with no packing.
    """
    if local.device != "cpu":
        return None
    extents = []
    position = 0
    for i, e in enumerate(local.contract):
        if e.alias != i:
            continue
        v = arrays.view(local.arrays[i])
        if v.size:
            if not v.flags.c_contiguous:
                return None
            extents.append((arrays.address(v), v.nbytes, position))
        position += 1
    extents.sort()
    runs: list[list[int]] = []
    end = -1
    for address, nbytes, k in extents:
        if address == end:
            runs[-1].append(k)
        else:
            runs.append([k])
        end = address + nbytes
    return tuple(sorted(tuple(r) for r in runs))  # in head order: where each buffer lies must not matter


def _region(heads: list[Any], run: tuple[int, ...]) -> np.ndarray:
    """A uint8 view of the memory of one run (positions into ``heads``, in address order)."""
    first = arrays.view(heads[run[0]])
    nbytes = sum(arrays.view(heads[k]).nbytes for k in run)
    return arrays.host_region(arrays.address(first), nbytes)
