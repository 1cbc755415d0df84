"""One reduce window's local side: the reduction slots, the gradient checks, the reuse cache, the move, its facts.

Pure up to :func:`move`, which takes the session's communicator: the checks
run before the exchange (:mod:`mpidp.records`), the move after it, on
agreed facts only (global presence, global weight), so every rank issues
the same collectives.
"""

from __future__ import annotations

import enum
import numbers
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import arrays, layout
from .casts import DEFAULT, Casts
from .errors import ContractError
from .exact import sums as exact
from .packing import Call, Moves, Scatter, Slot, Step, plan, reduce_calls, run_steps, slot, steps
from .records import U64_MAX, Window

if TYPE_CHECKING:
    from .comm import Communicator
    from .cuda import Device

__all__ = [
    "REBUILD", "Accepted", "Agreed", "Cache", "Checked", "Given", "Group", "MissingGradientPolicy", "Program", "ReducedGradients",
    "Transport", "check_global_weight", "check_gradients", "check_replica", "check_step", "check_weight", "reduce_slots",
]

#: a window's plan: the calls, and the globally present reduction slots
Plan = tuple[tuple[Call, ...], list[int]]
#: the plans of this many presence patterns are kept (presence patterns can be endless)
PLANS = 8


class Group(NamedTuple):
    """One reduction slot: a trainable tie group, reduced once."""

    number: int  # its reduction slot
    name: str  # the group's head (first name in contract order)
    info: arrays.ArrayInfo  # of the parameter: a gradient must match its shape, dtype and device
    param: Any  # the parameter array (what a zero gradient is made like)


class Slots:
    """The reduction slots of a contract: one per trainable tie group, in contract order (agreed facts)."""

    def __init__(self, entries: Sequence[Any], infos: Sequence[arrays.ArrayInfo], params: Sequence[Any]) -> None:
        heads = [i for i, e in enumerate(entries) if e.trainable and e.alias == i]
        self.groups = tuple(Group(k, entries[i].name, infos[i], params[i]) for k, i in enumerate(heads))
        of_head = dict(zip(heads, self.groups))
        #: every trainable name (tied ones included) -> its reduction slot
        self.of = {e.name: of_head[e.alias] for e in entries if e.trainable}
        self.frozen = frozenset(e.name for e in entries if not e.trainable)
        self.sizes = tuple(g.info.size for g in self.groups)
        #: the slots' dtypes: only slots of one dtype share a call (which may then be gathered in it)
        self.kinds = tuple(g.info.dtype for g in self.groups)
        #: presence words of a window record
        self.words = (len(self.groups) + 63) // 64
        #: the presence words of a rank that has every gradient (the usual window)
        self.complete = self._pack([True] * len(self.groups))

    def __len__(self) -> int:
        return len(self.groups)

    def presence(self, present: list[bool]) -> np.ndarray:
        """The presence words of a window record: bit ``i`` set when slot ``i`` has a gradient."""
        return self.complete if all(present) else self._pack(present)

    def _pack(self, present: list[bool]) -> np.ndarray:
        out = np.zeros(self.words, dtype=np.uint64)
        out.view(np.uint8)[: (len(present) + 7) // 8] = np.packbits(np.array(present, dtype=bool))
        return out


class Given(NamedTuple):
    """A gradient this rank passed for one reduction slot, as the window moves it."""

    name: str  # the name it came under (the head or another name of the tie group)
    array: Any
    view: Any  # NumPy or CuPy view of ``array``
    prepared: Slot | None  # the Slot built once for mpidp's own flat storage, else None


class Transport(NamedTuple):
    """How a session's chunks reach MPI: its communicator, its float32 stage, its device (None: host), its reduce-scatter, its casts."""

    comm: Communicator
    stage: Any
    gpu: Device | None
    scatter: Scatter | None = None  # host reduce-scatter buffers and the agreed mode; None: Allreduce only
    casts: Casts = DEFAULT  # how host 16-bit values are cast (``MPIDP_CASTS``, chosen once per session)


class Accepted(NamedTuple):
    """A gradient of an accepted set (:class:`Cache`): the same object, unchanged, passes again without a look."""

    ref: Any  # a weak reference to the array
    fingerprint: tuple[Any, ...]  # :func:`mpidp.arrays.fingerprint` of the array when it was accepted
    number: int  # its reduction slot
    own: Given | None  # its Given, when it is mpidp's own flat storage (the session holds it anyway)


#: what ``accepted.get`` gives a name that is not there: its reference is dead, so nothing matches it
_NOT_ACCEPTED: Accepted = Accepted(lambda: None, (), -1, None)


class Program(NamedTuple):
    """The cut host steps of a window on the same arrays as the window before (:class:`Cache`)."""

    plan: Plan  # the plan they were cut for
    serial: int  # the accepted set they were cut on (:attr:`Cache.serial`)
    steps: tuple[Step, ...]
    result: dict[str, Any]  # the reduced gradients by name, as the window returned them
    given: tuple[Given | None, ...]  # that window's checked gradients, reused by the next check


class Cache:
    """What reduce reuses from window to window; a window that raises keeps no gradient arrays.

    * ``accepted``: name -> :class:`Accepted` of every gradient
      of the last window that passed the checks: the same objects, unchanged, pass again without a
      second look (weak, so that a caller who allocates new gradients every window does not keep the
      old ones alive); ``serial`` counts the sets accepted, ``again`` says this window's set is the last
      one, unchanged. ``previous``: the set accepted before it, which passes the same way (an
      overlapped session's ``.grad`` alternate between two sets of tensors); it then becomes
      ``accepted`` again, as a new set (``serial`` counts it, ``again`` stays False).
    * ``program``: the :class:`Program` of the last window whose gradients were the
      same arrays as the window before: the next such window reruns the steps as they are, and its
      check reuses that window's ``given`` (views and all) instead of viewing every array again.
    * ``plans``: presence bits -> plan, a small LRU.
    * ``flat``: the persistent flat gradient storage (:meth:`DataParallel.gradient_buffers`), once asked for.
    """

    def __init__(self) -> None:
        self.accepted: dict[str, Accepted] = {}
        self.previous: dict[str, Accepted] = {}
        self.serial = 0
        self.again = False
        self.program: Program | None = None
        self.plans: dict[tuple[int, ...], Plan] = {}
        self.flat: layout.FlatGradients | None = None

    def forget(self) -> None:
        """Hold no gradient array any more (a window that failed, a closed session)."""
        self.accepted, self.previous, self.program, self.again = {}, {}, None, False

    def plan(self, key: tuple[int, ...], sizes: Sequence[int], chunk: int, kinds: Sequence[Any] | None = None) -> Plan:
        """The plan of presence words ``key`` (agreed), from the LRU or made now; ``kinds``: the slots' dtypes."""
        entry = self.plans.pop(key, None)
        if entry is None:
            present = np.unpackbits(np.array(key, dtype=np.uint64).view(np.uint8), count=len(sizes)).astype(bool).tolist()
            entry = (plan(sizes, present, chunk, kinds=kinds), [i for i, here in enumerate(present) if here])
        self.plans[key] = entry
        if len(self.plans) > PLANS:
            del self.plans[next(iter(self.plans))]
        return entry


def check_gradients(grads: Any, slots: Slots, cache: Cache, given: list[Given | None]) -> str | None:
    """Check this rank's gradients and fill ``given`` (one entry per reduction slot); the error, or None.

    Local. The last accepted set, unchanged, passes without a second look
    (``cache.again``), and so does the one before it (:class:`Cache`).
    """
    cache.again = False
    if not isinstance(grads, Mapping):
        return f"grads must be a mapping of names to arrays, got {type(grads).__name__}"
    program = cache.program
    kept = program.given if program is not None and program.serial == cache.serial else None
    if _accepted_again(grads, cache.accepted, given, kept):
        cache.again = True
        return None
    if _accepted_again(grads, cache.previous, given):
        cache.accepted, cache.previous = cache.previous, cache.accepted
        cache.serial += 1
        cache.program = None
        return None
    last = cache.accepted
    cache.forget()
    cache.serial += 1
    seen: dict[int, str] = {}
    for name in sorted(grads, key=str):
        group = slots.of.get(name)
        if group is None:
            return f"gradient for {'frozen' if name in slots.frozen else 'unknown'} parameter {name!r}"
        earlier = given[group.number]
        if earlier is not None:
            return f"two gradients for one tied array: {earlier.name!r} and {name!r}"
        g = grads[name]
        if id(g) in seen:
            return f"gradients {seen[id(g)]!r} and {name!r} are the same array (each needs its own)"
        seen[id(g)] = name
        why = _problem(name, g, group.info)
        if why is not None:
            return why
        flat = cache.flat.prepared(group.number, g) if cache.flat is not None else None
        given[group.number] = Given(name, g, arrays.view(g), None) if flat is None else Given(name, g, flat.view, flat.slot)
    present = [x for x in given if x is not None]
    why = layout.overlap([x.view for x in present], [x.name for x in present])
    if why is None:
        _accept(cache, given, last)
    return why


def _problem(name: str, g: Any, p: arrays.ArrayInfo) -> str | None:
    """Why gradient ``g`` cannot be its parameter's (``p``), or None."""
    info = arrays.describe(g)
    if info is None:
        return f"gradient {name!r} is a {type(g).__name__}, not an array"
    for field in ("shape", "dtype", "device"):
        if getattr(info, field) != getattr(p, field):
            return f"gradient {name!r}: {field} {getattr(info, field)} differs from its parameter's {getattr(p, field)}"
    why = arrays.problem(g)
    return None if why is None else f"gradient {name!r}: {why}"


def _accept(cache: Cache, given: Sequence[Given | None], last: dict[str, Accepted]) -> None:
    """Remember the accepted gradients, so that the same arrays pass the next window without a look; ``last`` becomes the previous set."""
    accepted: dict[str, Accepted] = {}
    try:
        for i, x in enumerate(given):
            if x is None:
                continue
            if x.prepared is None or cache.flat is None:  # a caller's array: its view is made again (held weakly)
                accepted[x.name] = Accepted(weakref.ref(x.array), arrays.fingerprint(x.array), i, None)
            else:  # mpidp's own flat storage: the session holds it anyway, Given and all
                accepted[x.name] = Accepted(weakref.ref(x.array), cache.flat.slots[i].fingerprint, i, x)
        cache.previous, cache.accepted = last, accepted
    except TypeError:  # an array type without weak references: checked in full every window
        cache.previous, cache.accepted = {}, {}


def _accepted_again(
    grads: Mapping[str, Any], accepted: dict[str, Accepted], given: list[Given | None],
    kept: Sequence[Given | None] | None = None,
) -> bool:
    """Fill ``given`` if ``grads`` are the arrays of an ``accepted`` set (:class:`Cache`), unchanged.

    ``kept``: the ``given`` of the window that cut the cached program, on
    the same set (its views are reused instead of made again; the program
    holds those arrays anyway).
    """
    if not accepted or len(grads) != len(accepted):
        return False
    fingerprint = arrays.fingerprint
    for name, g in grads.items():
        # unpacked, not read by field name: a field read costs more than an index (every window, every gradient)
        entry: Accepted = accepted.get(name, _NOT_ACCEPTED)
        ref, taken, number, own = entry
        if ref() is not g or fingerprint(g) != taken:
            given[:] = [None] * len(given)
            return False
        if kept is None:  # ``own``: mpidp's own flat storage, unchanged since its fingerprint was taken
            given[number] = own if own is not None else Given(name, g, arrays.view(g), None)
    if kept is not None:
        given[:] = kept
    return True


def reduce_slots(
    transport: Transport, cache: Cache, entry: Plan, groups: Sequence[Group], given: Sequence[Given | None],
    weight: int, global_weight: int, operation: str,
) -> dict[str, Any]:
    """Sum the globally present slots over all ranks, divide by ``global_weight``, cast back (collective).

    Every rank calls it with the same agreed ``entry`` and ``global_weight``.
    Returns the reduced gradients by the names they came with (new zero
    arrays, by head name, where this rank had none).
    """
    comm = transport.comm
    moves = _moves(comm, operation)
    program = cache.program
    if program is not None and cache.again and weight > 0 and program.plan is entry and program.serial == cache.serial:
        # the same arrays as the window that cut these steps, unchanged (same objects, same
        # fingerprints: same memory) and all present; a weighted rank with every gradient makes
        # every slot globally present, so the plan is the same too (checked all the same: cheap)
        run_steps(program.steps, moves, global_weight, transport.casts)
        return dict(program.result)
    cache.program = None
    calls, indices = entry
    out: dict[str, Any] = {}
    slots: list[Slot | None] = [None] * len(groups)  # filled in for every globally present slot
    for index in indices:
        x = given[index]
        if x is None:
            g = arrays.zeros_like(groups[index].param)
            slots[index] = slot(arrays.view(g))
            out[groups[index].name] = g
            continue
        if weight == 0:
            x.view[...] = 0
        slots[index] = x.prepared if x.prepared is not None else slot(x.view)
        out[x.name] = x.array
    if transport.gpu is not None:  # device arrays keep the Allreduce (mpidp.cuda)
        transport.gpu.reduce_calls(comm, calls, slots, global_weight, f"{operation}: Allreduce")
    elif cache.again and weight > 0 and all(x is not None for x in given) and all(s.original is None for s in slots if s is not None):
        # the second window in a row on the same arrays: keep the cut views for the next one
        work = steps(calls, slots, transport.stage, transport.scatter)
        cache.program = Program(entry, cache.serial, work, dict(out), tuple(given))
        run_steps(work, moves, global_weight, transport.casts)
    else:
        reduce_calls(calls, slots, transport.stage, moves, global_weight, transport.scatter, transport.casts)
    return out


def _moves(comm: Communicator, operation: str) -> Moves:
    """The host collectives of a window, named after ``operation`` for errors and the watchdog."""
    summed, scattered, gathered = f"{operation}: Allreduce", f"{operation}: Reduce_scatter_block", f"{operation}: Allgather"
    return Moves(
        lambda b: comm.Allreduce(b, summed),
        lambda send, recv: comm.Reduce_scatter_block(send, recv, scattered),
        lambda b: comm.Allgather_in_place(b, gathered),
    )


# ------------------------------------------------- the window's own checks and facts


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


def check_replica(params: Mapping[str, Any], replica: Sequence[tuple[str, Any, Any]], infos: Sequence[arrays.ArrayInfo]) -> str | None:
    """Why the session's parameters are no longer those of initialize (``replica``: (name, array, signature) each), or None."""
    if len(params) != len(replica):
        return f"the parameter mapping changed after initialize: {len(params)} names, expected {len(replica)}{REBUILD}"
    get, signature = params.get, arrays.signature
    for (name, array, sig), info in zip(replica, infos):
        if get(name, None) is not array:
            return f"parameter {name!r} was replaced or removed after initialize{REBUILD}"
        if signature(array) == sig:
            continue
        now = arrays.describe(array)
        if now != info:
            return f"parameter {name!r} changed after initialize ({_changes(info, now)}){REBUILD}"
    return None


def check_weight(local_weight: Any, policy: Any, error: str | None) -> tuple[int, int, str | None]:
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


def check_step(step: Any, error: str | None) -> tuple[int, str | None]:
    """The STEP word of this rank's window record (step + 1), and the first error (local)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return 0, error or f"step must be None or a non-negative int, got {type(step).__name__} {step!r}"
    if not 0 <= int(step) < U64_MAX:
        return 0, error or f"step {step} is outside [0, 2**64 - 2]"
    return int(step) + 1, error


def check_global_weight(global_weight: int) -> None:
    """Refuse a window whose agreed global weight is 0 or does not fit in 64 bits (every rank alike)."""
    if not 0 < global_weight <= U64_MAX:
        if global_weight:
            raise ContractError(f"the global weight {global_weight} does not fit in 64 bits")
        raise ContractError("the global weight is 0: no rank has a token in this window, nothing to normalize")
