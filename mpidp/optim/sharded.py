"""The sharded optimizer: each rank owns one slice of the flat trainable storage, its state and its float32 masters.

One :meth:`ShardedOptimizer.step` is a window (:meth:`mpidp.DataParallel.reduce`'s
checks and agreement, the optimizer's description joining the agreed
record), then the movement: gradients reduce-scattered to their owners
(:mod:`mpidp.optim.moves`; ``exact=True``: the session's exact reduction),
divided by the global weight, clipped by the exact global norm if asked
(:mod:`mpidp.optim.norm`), the owner's slice updated by an elementwise rule
(:mod:`mpidp.optim.rules`), and every updated slice gathered into every
rank's parameters as their own bytes (2 per 16-bit element), in place.
Afterwards the replicas are bitwise equal.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .. import arrays, casts, records
from ..core import DataParallel, MissingGradientPolicy
from ..cut import Cut, byte_bounds, pieces, starts
from ..errors import CollectiveError, ContractError
from . import groups as groupings
from . import moves, norm, offload, rules
from .state import OptimizerState, Piece, Run, state_key

__all__ = ["ShardedOptimizer", "StepResult"]

#: elements a rule updates at a time, so that its temporaries stay in cache (128 KiB of float32 each)
UPDATE_BLOCK = 1 << 15


class StepResult(NamedTuple):
    """A sharded step's result: the global weight, the global norm (None: not clipped), whether a scaled step skipped.

    ``found_inf``: a step with ``scale`` found inf or NaN and skipped its
    update, on every rank alike.
    """

    global_weight: int
    norm: float | None
    found_inf: bool = False


class ShardedOptimizer(OptimizerState):
    """The base of the sharded optimizers; a subclass names its rule and says ``elementwise = True``.

    Collective: building one is an agreement of every rank of the session
    (the kind, the groups and their hyperparameters must be equal), and so
    is every :meth:`step` and :meth:`load`. A subclass that does not declare
    ``elementwise = True`` (its update reads a whole tensor; set ``whole`` to
    say what it reads) is refused: ContractError on every rank, naming why.

    ``groups_or_names``: None (every trainable tie group's head name, one
    group), a list of head names (one group), or torch-like groups, dicts of
    ``{"params": [names], "lr": ..., ...}``; head names not in any group are
    not updated. Keywords are the rule's hyperparameters (defaults of the
    groups that do not set their own). :attr:`param_groups` holds the group
    dicts: change ``lr`` there between steps, on every rank alike.

    Trainable arrays must be C-contiguous; each rank keeps the state of its
    slice only (:meth:`owned`, :meth:`state_pieces`, :attr:`nbytes`). On a
    device (CuPy arrays, or CUDA tensors through the torch adapter) the state,
    the float32 masters and the update stay on the host, as ZeRO-Offload
    keeps them: each step copies the gradients down and every updated slice
    up. ``adapter_error``: an adapter's own local error, raised on every rank
    by the agreement. ``sources``: another optimizer's group dicts (torch's
    ``param_groups``), one per group, which then *are* the hyperparameters:
    read at every step and save, written by a load (:class:`groups.Live`).

    Checkpoints: the contract of :mod:`mpidp.optim.state` (each rank writes
    and reads the slices it owns; any world size loads).
    """

    kind = ""
    elementwise: ClassVar[bool] = False
    whole: ClassVar[str | None] = None  # what a refused optimizer's update reads of a whole tensor
    rule: ClassVar[type[rules.Rule] | None] = None

    def __init__(
        self, dp: DataParallel, groups_or_names: Any = None, *, adapter_error: str | None = None,
        sources: Sequence[MutableMapping[str, Any]] | None = None, **hyperparameters: Any,
    ) -> None:
        facts = dp.facts()
        self._dp, self._comm, self._exact = dp, facts.comm, facts.exact
        self._chunk = max(1, facts.chunk_bytes // 4)
        self._params = facts.params
        self._shapes = [tuple(arrays.view(p).shape) for p in self._params]
        self._flats = [arrays.view(p).reshape(-1) for p in self._params]
        self._dtypes = [a.dtype for a in self._flats]
        self.cut = Cut.of(facts.sizes, facts.comm.rank, facts.comm.size)
        self._chunk_bytes = facts.chunk_bytes
        self._place = offload.place(facts.device)  # host arrays in place, or device arrays with the update on the host
        itemsizes = [d.itemsize for d in self._dtypes]
        self._bytes_begin = starts([n * i for n, i in zip(facts.sizes, itemsizes)])  # the flat byte storage
        self._spans = byte_bounds(self.cut.begin, self._bytes_begin, itemsizes, self.cut.bounds)
        self._mine = self.cut.mine()
        heads = dp.trainable
        error = adapter_error or (None if self.elementwise and self.rule is not None else self.refusal())
        self.groups: list[groupings.Group] = []
        if error is None:
            assert self.rule is not None
            self.groups, error = groupings.parse(groups_or_names, heads, (), self.rule.defaults, hyperparameters)
            error = error or self._problem(facts.device)
            for g, source in zip(self.groups, sources or ()):
                g.hp = groupings.Live(source, g.names)
        self._agree(error, "sharded optimizer: agreement", self.hyperparameters())
        self._group_of = {s: g for g in self.groups for s in g.slots}
        self._states = {name: np.zeros(self.cut.hi - self.cut.lo, np.float32) for name in self._rule_states()}
        self._masters = self._make_masters()
        self._grad: np.ndarray | None = None  # this rank's gradient slice (float path), made on the first step
        self._whole: np.ndarray | None = None  # the whole flat gradient (exact path)
        self._incoming: tuple[dict[str, np.ndarray], dict[int, np.ndarray]] = ({}, {})  # a load's state, read by wants' runs

    def refusal(self) -> str:
        """Why this optimizer is refused (it is not elementwise): the message every rank raises."""
        return groupings.refusal(type(self).__name__, self.whole)

    @property
    def param_groups(self) -> list[MutableMapping[str, Any]]:
        """The group dicts (``params``: head names; hyperparameters), live: change ``lr`` here between steps."""
        return [g.hp for g in self.groups]

    def _problem(self, device: str) -> str | None:
        """Why this rank cannot run the sharded optimizer (local), or None."""
        assert self.rule is not None
        for k, g in enumerate(self.groups):
            why = self.rule.check(g.hp)
            if why is not None:
                return f"group {k}: {why}"
        for name, p, f in zip(self._dp.trainable, self._params, self._flats):
            if not arrays.view(p).flags["C_CONTIGUOUS"] or (device == "cpu" and not f.flags.writeable):
                return f"a sharded optimizer writes parameters in place: {name!r} is not a writable C-contiguous array"
        return None

    def _rule_states(self) -> tuple[str, ...]:
        assert self.rule is not None
        found: dict[str, None] = {}
        for g in self.groups:
            found.update(dict.fromkeys(self.rule.states(g.hp)))
        return tuple(found)

    def _make_masters(self) -> dict[int, np.ndarray]:
        """float32 copies of this rank's pieces of 16-bit parameters, by piece index."""
        self._place.wait()
        return {
            k: self._place.down(self._flats[p.slot][p.a : p.b]).astype(np.float32)
            for k, p in enumerate(self._mine) if self._dtypes[p.slot] != np.float32
        }

    # ----------------------------------------------------------- the interface

    def hyperparameters(self) -> dict[str, Any]:
        """The JSON-able description: ``{"kind", "groups": [{"params": names, hyperparameters..., "step": n}]}`` (local)."""
        return groupings.describe(self.kind, self.groups)

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's own state keys, with ``"master"`` where a trainable parameter is 16-bit (local; equal on every rank)."""
        sixteen = any(d != np.float32 for d in self._dtypes)
        return self._rule_states() + (("master",) if sixteen else ())

    def owned(self) -> list[tuple[str, int, int]]:
        """This rank's pieces: ``(head name, lo, hi)``, flat element ranges of each parameter, in flat order (local)."""
        heads = self._dp.trainable
        return [(heads[p.slot], p.a, p.b) for p in self._mine]

    def state_pieces(self) -> dict[str, dict[str, np.ndarray]]:
        """``{state name: {head name: float32 view of the owned range}}``: views of the live state, not copies (local).

        ``"master"`` holds the pieces of 16-bit parameters only.
        """
        heads = self._dp.trainable
        out = {s: {heads[p.slot]: a[p.offset : p.offset + p.b - p.a] for p in self._mine} for s, a in self._states.items()}
        if "master" in self.state_names():
            out["master"] = {heads[self._mine[k].slot]: m for k, m in self._masters.items()}
        return out

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds of optimizer state and float32 masters (local)."""
        return sum(a.nbytes for a in self._states.values()) + sum(m.nbytes for m in self._masters.values())

    # ---------------------------------------------------- the checkpoint contract

    def describe(self) -> dict[str, Any]:
        """The description a checkpoint keeps: :meth:`hyperparameters` and the state names (local)."""
        return {**self.hyperparameters(), "state": list(self.state_names())}

    def pieces(self, rank: int, size: int) -> list[Piece]:
        """This rank's owned slices of every state, under ``state/<state>/<parameter>`` (local; the session's cut)."""
        heads = self._dp.trainable
        out = []
        for state, by_name in self.state_pieces().items():
            for p in self._mine:
                if heads[p.slot] in by_name:  # a state only some parameters have ("master": 16-bit ones)
                    out.append(Piece(state_key(state, heads[p.slot]), self._shapes[p.slot], "float32", p.a, by_name[heads[p.slot]]))
        return out

    def _runs(self) -> list[tuple[str, int, int, int]]:
        """What a load reads, in order: ``(state, piece index, lo, hi)`` for every owned piece."""
        return [(name, k, p.a, p.b) for k, p in enumerate(self._mine) for name in (*self._states, *(("master",) if k in self._masters else ()))]

    def wants(self, description: Mapping[str, Any]) -> list[Run]:
        """The slices this rank owns of every state of a checkpoint of this optimizer (ValueError: another optimizer)."""
        problem = self._mismatch(description)
        if problem is not None:
            raise ValueError(problem)
        heads = self._dp.trainable
        # read straight into new state arrays, which the commit puts in place of the old ones (no copy)
        self._incoming = ({s: np.empty_like(a) for s, a in self._states.items()}, {k: np.empty_like(m) for k, m in self._masters.items()})
        states, masters = self._incoming
        return [
            Run(state_key(s, heads[self._mine[k].slot]), self._shapes[self._mine[k].slot], "float32", a, b,
                masters[k] if s == "master" else states[s][self._mine[k].offset : self._mine[k].offset + b - a])
            for s, k, a, b in self._runs()
        ]

    def prepare(self, description: Mapping[str, Any], values: Sequence[np.ndarray]) -> Callable[[], None]:
        """Check the slices read (:meth:`wants`' order) and the step counts; the commit that loads them (ValueError: refused).

        The commit writes the state, the masters, the step counts and every
        group's hyperparameters (a scheduled ``lr``, torch's ``initial_lr``),
        as ``torch.optim``'s ``load_state_dict`` does.
        """
        steps = [g.get("step") for g in description["groups"]]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in steps):
            raise ValueError(f"the optimizer's step counts must be non-negative ints, got {steps!r}")
        runs = self._runs()
        if len(values) != len(runs):
            raise ValueError(f"expected {len(runs)} slices of optimizer state, got {len(values)}")
        heads = self._dp.trainable
        checked = [_piece(v, b - a, s, heads[self._mine[k].slot]) for (s, k, a, b), v in zip(runs, values)]
        if set(self._incoming[0]) != set(self._states):  # prepare without wants first: new arrays here
            self._incoming = ({s: np.empty_like(a) for s, a in self._states.items()}, {k: np.empty_like(m) for k, m in self._masters.items()})
        states, masters = self._incoming
        for (s, k, a, b), v in zip(runs, checked):  # values read elsewhere than wants' arrays: into them
            into = masters[k] if s == "master" else states[s][self._mine[k].offset : self._mine[k].offset + b - a]
            if not np.shares_memory(into, v):
                into[...] = v

        def commit() -> None:
            self._states.update(states)
            self._masters.update(masters)
            for g, n, saved in zip(self.groups, steps, description["groups"]):
                g.step = n
                for key, v in saved.items():
                    if key not in ("params", "step"):
                        g.hp[key] = tuple(v) if isinstance(v, list) else v

        return commit

    def _mismatch(self, saved: Mapping[str, Any]) -> str | None:
        """How a saved description differs from this optimizer's (kind, groups' parameters, keys, state names), or None."""
        groups = saved.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(saved.get("state"), list):
            return "the checkpoint's optimizer description has no list of groups and state names"
        mine = {"kind": self.kind, "groups": [{"params": list(g.names)} for g in self.groups]}
        theirs = {"kind": saved.get("kind"), "groups": [{"params": g.get("params")} for g in groups]}
        where = groupings.first(mine, theirs)
        if where is not None:
            return f"the checkpoint's optimizer differs: {where}"
        assert self.rule is not None
        lacking = [k for g in groups for k in self.rule.defaults if k not in g]
        if lacking:
            return f"the checkpoint's optimizer groups lack the hyperparameter {lacking[0]!r}"
        if list(self.state_names()) != saved["state"]:
            return (
                f"the checkpoint's optimizer keeps the states {saved['state']}, this one {list(self.state_names())} "
                "(amsgrad, momentum or the parameters' dtypes differ): build it as the checkpoint's was"
            )
        return None

    def _agree(self, error: str | None, operation: str, description: dict[str, Any]) -> None:
        """Agree on ``description`` (and every rank's error): ContractError on every rank where they differ (collective)."""
        rows = self._dp.agree_record(records.OPTIMIZER, [groupings.digest(description)], error, operation)
        if len({r[records.BODY] for r in rows}) > 1:
            self._differ(description, operation)

    def _differ(self, description: dict[str, Any], operation: str) -> None:
        every = self._comm.allgather_obj(description, f"{operation}: descriptions")
        raise ContractError(f"{operation}: the sharded optimizer differs between ranks: {groupings.difference(every)}")

    # ----------------------------------------------------------------- a step

    def step(
        self,
        grads: Mapping[str, Any],
        local_weight: int,
        policy: MissingGradientPolicy = MissingGradientPolicy.ERROR,
        *,
        step: int | None = None,
        max_norm: float | None = None,
        scale: float | None = None,
        adapter_error: str | None = None,
    ) -> StepResult:
        """Reduce the window's gradients to their owners, update every slice, gather the parameters (collective).

        ``grads``, ``local_weight``, ``policy``, ``step`` as for :meth:`mpidp.DataParallel.reduce`
        (exact sessions: the window's :meth:`~mpidp.DataParallel.fold` s count
        too); the gradients are read, not written. Each owner divides its
        slice by the global weight (float32), then by ``scale`` where given (a
        loss scale: times its float32 reciprocal, as GradScaler unscales),
        multiplies it by ``clip_grad_norm_``'s coefficient when ``max_norm``
        is given (the global norm: an exact sum of squares, the same bits on
        every rank, and at every world size where the gradients are), updates
        it, and every rank's parameters receive every updated slice in their
        own dtype, in place. Parameters no weighted rank has a gradient for are
        not updated; a group's step count advances when any of its parameters
        is. With ``scale``, where any owner finds inf or NaN in the reduced
        gradients it updates, every rank skips the update (parameters, state,
        step counts untouched) and returns ``found_inf=True``.

        Raises ContractError on every rank, with parameters and state
        untouched, where :meth:`~mpidp.DataParallel.reduce` would, where
        ``max_norm`` or ``scale`` is bad, where ranks' optimizers differ (kind,
        groups, hyperparameters, step counts, ``max_norm``, ``scale``), or
        where a rank passes ``adapter_error`` (an adapter's local error).
        """
        error = adapter_error or self._step_problem(max_norm, scale)
        dp = self._dp
        checked = dp.check_window(grads, local_weight, policy, error, step=step)
        description = {**self.hyperparameters(), "max_norm": max_norm, "scale": scale}
        agreed = dp.agree_window(checked, None, groupings.digest(description))
        operation = f"{self.kind} step (window {dp.window})"
        if len(set(agreed.extra)) > 1:
            if self._exact is not None:
                self._exact.forget()
            self._differ(description, operation)
        try:
            total, found = self._move(agreed, max_norm, scale, operation)
        except CollectiveError as e:
            dp.fail(e)
            raise
        return StepResult(agreed.global_weight, None if total is None else float(total), found)

    def _move(self, agreed: Any, max_norm: Any, scale: float | None, operation: str) -> tuple[np.float32 | None, bool]:
        """Reduce, unscale, inspect (norm, inf/NaN), clip, update, gather; the norm and whether it skipped (collective)."""
        present = agreed.present(len(self._params))
        grad = self._reduce(agreed, present, operation)
        if scale is not None:
            grad *= np.float32(1.0 / float(scale))  # GradScaler's inverse scale: float64 reciprocal, then float32
        total, found = self._inspect(grad, present, max_norm, scale is not None, operation)
        if not found:
            self._gather(self._update(grad, present), f"{operation}: parameters")
        return total, found

    def _step_problem(self, max_norm: Any, scale: Any) -> str | None:
        assert self.rule is not None
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not float(max_norm) > 0):
            return f"max_norm must be None or a positive real number, got {max_norm!r}"
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < float(scale) < math.inf):
            return f"scale must be None or a positive finite real number, got {scale!r}"
        for k, g in enumerate(self.groups):
            why = self.rule.check(g.hp)
            if why is not None:
                return f"group {k}: {why}"
        if self._rule_states() != tuple(self._states):
            return f"the optimizer was built with the states {list(self._states)}, its groups now need {list(self._rule_states())}: set amsgrad and momentum when building it"
        return None

    def _reduce(self, agreed: Any, present: list[bool], operation: str) -> np.ndarray:
        """This rank's slice of the window's global token mean, float32 (collective)."""
        lo, hi = self.cut.lo, self.cut.hi
        if self._exact is not None:  # the exact reduction of this rank's slice, else of the whole, then the slice
            if self._grad is None:
                self._grad = np.empty(hi - lo, np.float32)
            slices = functools.partial(pieces, self.cut.begin)
            if self._dp.reduce_exact_owned(agreed, self.cut.bounds, slices, self._grad, f"{operation}: gradients"):
                return self._grad
            if self._whole is None:
                self._whole = np.zeros(self.cut.begin[-1], np.float32)
            begin, whole = self.cut.begin, self._whole
            targets = [whole[begin[i] : begin[i + 1]] if here else None for i, here in enumerate(present)]
            self._dp.reduce_exact(agreed, targets, f"{operation}: gradients")
            return whole[lo:hi]
        if self._grad is None:
            self._grad = np.empty(hi - lo, np.float32)
        views = [
            arrays.view(x.array).reshape(-1) if x is not None and here and agreed.weight > 0 else None
            for x, here in zip(agreed.given, present)
        ]
        self._place.wait()  # the gradients on the host, once
        views = [None if v is None else self._place.down(v) for v in views]

        def fill(a: int, b: int, out: np.ndarray) -> None:
            for p in pieces(self.cut.begin, a, b):
                v = views[p.slot]
                if v is not None:
                    casts.DEFAULT.upcast(out[p.offset : p.offset + p.b - p.a], v[p.a : p.b])

        moves.scatter(self._comm, self.cut, self._chunk, fill, self._grad, f"{operation}: gradients")
        casts.divide(self._grad, agreed.global_weight, out=self._grad)
        return self._grad

    def _inspect(self, grad: np.ndarray, present: list[bool], max_norm: Any, scaled: bool, operation: str) -> tuple[np.float32 | None, bool]:
        """The global norm (``grad`` clipped by it) and whether a scaled step found inf or NaN (collective; every rank alike).

        One int64 Allreduce carries the norm's exact sums of squares (with
        ``max_norm``) and the count of inf and NaN in the gradients that this
        rank updates (``scaled``); a step that found any is not clipped.
        """
        if max_norm is None and not scaled:
            return None, False
        words = np.zeros((0 if max_norm is None else norm.WORDS) + 1, np.int64)
        for p in self._mine:
            here = grad[p.offset : p.offset + p.b - p.a]
            if present[p.slot] and max_norm is not None:
                norm.squares(here, words[:-1])
            if present[p.slot] and scaled and p.slot in self._group_of:
                words[-1] += here.size - int(np.count_nonzero(np.isfinite(here)))
        if self.cut.size > 1:
            summed = np.empty_like(words)
            self._comm.Allreduce_into(words, summed, f"{operation}: norm and inf count (int64 Allreduce)")
            words = summed
        found = bool(words[-1])
        if max_norm is None:
            return None, found
        total = norm.norm(words[:-1])
        if not found:
            grad *= norm.clip_coefficient(float(max_norm), total)
        return total, found

    def _update(self, grad: np.ndarray, present: list[bool]) -> list[bool]:
        """Advance the step counts and update this rank's pieces (local); which slots were updated."""
        assert self.rule is not None
        updated = [here and s in self._group_of for s, here in enumerate(present)]
        for g in self.groups:
            if any(updated[s] for s in g.slots):
                g.step += 1
        for k, p in enumerate(self._mine):
            if not updated[p.slot]:
                continue
            group, master = self._group_of[p.slot], self._masters.get(k)
            flat = self._flats[p.slot]
            values = master if master is not None else self._place.down(flat[p.a : p.b])
            # in blocks that stay in cache: the rule's temporaries of a whole slice of a large tensor
            # (an embedding) made that rank's update about 3x slower per element than the others'.
            # An element's update reads only its own values, so the blocks change no bit.
            for a in range(0, p.b - p.a, UPDATE_BLOCK):
                b = min(a + UPDATE_BLOCK, p.b - p.a)
                state = {name: s[p.offset + a : p.offset + b] for name, s in self._states.items()}
                self.rule.update(group.hp, group.step, values[a:b], grad[p.offset + a : p.offset + b], state)
            self._place.updated(p.slot, p.a, values, flat[p.a : p.b], self._dtypes[p.slot], master is not None)
        return updated

    def _gather(self, updated: list[bool], operation: str) -> None:
        """Every owner's updated parameters into every rank's, as bytes (collective)."""
        moves.gather(self._comm, self._spans, self.cut.rank, self._chunk_bytes, self._fill, self._writer(updated), operation)
        self._place.done(self._flats)

    def _fill(self, lo: int, hi: int, out: np.ndarray) -> None:
        """This rank's parameter bytes ``[lo, hi)`` of the flat byte storage into uint8 ``out`` (16-bit: the masters as rounded)."""
        for p in pieces(self._bytes_begin, lo, hi):
            got = self._place.fill(p.slot, self._flats[p.slot], p.a, p.b)
            out[p.offset : p.offset + p.b - p.a] = 0 if got is None else got

    def _writer(self, updated: list[bool]) -> moves.Fill:
        def write(lo: int, hi: int, values: np.ndarray) -> None:
            for p in pieces(self._bytes_begin, lo, hi):
                if updated[p.slot]:
                    self._place.write(self._flats[p.slot].view(np.uint8)[p.a : p.b], values[p.offset : p.offset + p.b - p.a])

        return write


def _piece(x: Any, n: int, state: str, name: str) -> np.ndarray:
    """A checkpoint's piece as float32 of ``n`` values, or ValueError naming it."""
    a = np.asarray(x)
    if a.dtype != np.float32 or a.shape != (n,):
        raise ValueError(f"{state} of {name!r}: expected float32 of shape ({n},), got {a.dtype} {a.shape}")
    return a
