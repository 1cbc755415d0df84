"""Parameter groups, the optimizer's description, its digest, and the optimizers refused (pure).

A group is ``{"params": [names], hyperparameter: value, ...}`` as in
``torch.optim``; missing hyperparameters take the optimizer's defaults.
The description (:func:`describe`) is what every rank must hold alike:
kind, groups with their names, hyperparameters and step counts. It is
JSON, so its digest is the same wherever it is equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["REFUSED", "Group", "Live", "describe", "difference", "digest", "first", "parse", "refusal"]

#: optimizers whose update reads a whole tensor (or matrix), so an owner of a slice cut inside a tensor cannot compute it
REFUSED = {
    "lamb": "LAMB scales each tensor's update by the ratio of the tensor's weight norm to its update norm",
    "lars": "LARS scales each tensor's update by the ratio of the tensor's weight norm to its gradient norm",
    "adafactor": "Adafactor keeps factored row and column second moments of each matrix",
    "shampoo": "Shampoo preconditions each tensor with matrix roots of its gradient statistics",
    "muon": "Muon orthogonalizes each matrix's update (Newton-Schulz iterations over the whole matrix)",
}


def refusal(name: str, why: str | None = None) -> str:
    """The one message that refuses optimizer ``name`` (``why``: what of a whole tensor its update reads)."""
    why = why or REFUSED.get(name.lower(), "its update reads a whole tensor")
    return (
        f"a sharded optimizer cannot run {name}: {why}, and each rank owns a slice of the flat parameters cut anywhere, "
        "inside tensors too; mpidp shards only elementwise optimizers (SGD, Adam, AdamW): use a replicated optimizer "
        "after DataParallel.reduce for this one"
    )


class Group:
    """One parameter group: its head names, its reduction slots, its hyperparameters (``params`` too), its step count.

    ``hp`` is the group dict, or a :class:`Live` view of another optimizer's
    (torch's ``param_groups``): the one place the hyperparameters live.
    """

    def __init__(self, names: list[str], slots: list[int], hp: MutableMapping[str, Any]) -> None:
        self.names = names
        self.slots = slots
        self.hp = hp
        self.step = 0


def _plain(v: Any) -> bool:
    """Whether ``v`` is a JSON-able scalar or a list or tuple of them (a hyperparameter a description can carry)."""
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (str, int, float, bool))


class Live(MutableMapping[str, Any]):
    """A group's hyperparameters read from, and written to, another optimizer's group dict (torch's), when needed.

    ``params`` reads as the head names; every other key of the source whose
    value is plain data (a scheduler's ``initial_lr`` too) is a
    hyperparameter, so a step, a save and a load all see what the source
    holds at that moment: nothing keeps a second copy.
    """

    def __init__(self, source: MutableMapping[str, Any], names: list[str]) -> None:
        self._source = source
        self._names = names

    def __getitem__(self, key: str) -> Any:
        return self._names if key == "params" else self._source[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise KeyError("a group's parameters do not change")
        self._source[key] = value

    def __delitem__(self, key: str) -> None:
        del self._source[key]

    def __iter__(self) -> Iterator[str]:
        yield "params"
        yield from (k for k, v in self._source.items() if k != "params" and _plain(v))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def parse(
    given: Any, heads: Sequence[str], frozen: Sequence[str], defaults: Mapping[str, Any], overrides: Mapping[str, Any]
) -> tuple[list[Group], str | None]:
    """The groups of ``given`` (None: every head; a list of names; a list of group dicts), or the error (local).

    ``overrides``: the constructor's keywords, which replace the defaults
    of every group that does not set its own.
    """
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        return [], f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; this optimizer takes {', '.join(defaults)}"
    base = {**defaults, **overrides}
    if given is None:
        given = [{"params": list(heads)}]
    elif isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        return [], f"groups_or_names must be None, a list of names or a list of group dicts, got {type(given).__name__}"
    elif given and all(isinstance(g, str) for g in given):
        given = [{"params": list(given)}]
    slot_of = {h: i for i, h in enumerate(heads)}
    taken: dict[str, int] = {}
    out: list[Group] = []
    for k, g in enumerate(given):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            return [], f"group {k} must be a dict with a list of names under 'params', got {g!r}"
        extra = sorted(set(g) - set(defaults) - {"params"})
        if extra:
            return [], f"group {k}: unknown hyperparameter(s) {', '.join(map(repr, extra))}"
        names = list(g["params"])
        for name in names:
            if name not in slot_of:
                what = "frozen" if name in frozen else "not the head name of a trainable tie group (see DataParallel.trainable)"
                return [], f"group {k}: parameter {name!r} is {what}"
            if name in taken:
                return [], f"parameter {name!r} is in groups {taken[name]} and {k}"
            taken[name] = k
        hp = {"params": names, **base, **{key: v for key, v in g.items() if key != "params"}}
        if isinstance(hp.get("betas"), list):
            hp["betas"] = tuple(hp["betas"])
        out.append(Group(names, [slot_of[n] for n in names], hp))
    return out, None


def describe(kind: str, groups: Sequence[Group]) -> dict[str, Any]:
    """The JSON-able description: kind, and per group its names, hyperparameters and step count."""
    return {
        "kind": kind,
        "groups": [
            {**{k: list(v) if isinstance(v, tuple) else v for k, v in g.hp.items()}, "params": list(g.names), "step": g.step}
            for g in groups
        ],
    }


def digest(description: Mapping[str, Any]) -> int:
    """A 63-bit digest of a description (equal descriptions, equal digests, on any rank)."""
    text = json.dumps(description, sort_keys=True, default=repr).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def difference(descriptions: Sequence[Any]) -> str:
    """Name the first field in which a rank's description differs from rank 0's (every rank computes the same)."""
    first = descriptions[0]
    for rank, d in enumerate(descriptions[1:], 1):
        where = _first(first, d, "")
        if where is not None:
            path, mine, theirs = where
            return f"rank {rank} has {path or 'the description'} = {theirs!r} where rank 0 has {mine!r}"
    return "the descriptions differ"


def first(a: Any, b: Any) -> str | None:
    """Where description ``b`` first differs from ``a``: ``path = b's value (a's value)``, or None where they are equal."""
    found = _first(a, b, "")
    return None if found is None else f"{found[0] or 'the description'} = {found[2]!r} (expected {found[1]!r})"


def _first(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:  # the description's own order: the kind first
            found = _first(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b and type(a) is type(b) else (path, a, b)
