"""A core session's training state as checkpoint pieces: parameters, a sharded optimizer's slices, extras (collective).

The parameters are replicated: their tie-group heads (sorted by name), laid
end to end, are cut into one contiguous run per rank
(:func:`mpidp.checkpoint.files.cut`), and each rank writes its run, so the
writing is shared whatever the world size. A sharded optimizer
(:mod:`mpidp.optim`) writes the slices each rank owns, under its own state
names; any other world size reads back the slices it owns then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from .. import arrays
from . import collective, files
from .collective import Piece, Want

__all__ = ["load", "save"]


def heads(params: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The first name (sorted) of every tied group, and every other name's head."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name in sorted(params):
        head = first.setdefault(id(params[name]), name)
        if head != name:
            aliases[name] = head
    return list(first.values()), aliases


def host(x: Any) -> np.ndarray:
    """A host NumPy array with ``x``'s elements (a view where ``x`` is host memory)."""
    v = arrays.view(x)
    return v if isinstance(v, np.ndarray) else v.get()


def param_pieces(params: Mapping[str, Any], names: list[str], rank: int, size: int, prefix: str = "param/") -> list[Piece]:
    """This rank's runs of the tensors ``names`` of ``params`` laid end to end (:func:`files.cut`)."""
    views = {n: host(params[n]).reshape(-1) for n in names}
    lo, hi = files.cut(sum(v.size for v in views.values()), size, rank)
    # every tensor is named in every rank's file (its shape and dtype), a piece or not
    empty = {n: Piece(f"{prefix}{n}", tuple(params[n].shape), files.dtype_name(v.dtype), 0, v[:0]) for n, v in views.items()}
    runs = files.pieces_of([(n, v.size) for n, v in views.items()], lo, hi)
    return list(empty.values()) + [empty[n]._replace(lo=a, data=views[n][a:b]) for n, a, b in runs]


def optimizer_pieces(optimizer: Any, params: Mapping[str, Any]) -> list[Piece]:
    """A sharded optimizer's owned slices of every state, under ``state/<state name>/<parameter>``."""
    out = []
    for state, by_name in optimizer.state_pieces().items():
        for name, lo, _ in optimizer.owned():
            if name not in by_name:  # a state only some parameters have ("master": 16-bit ones)
                continue
            out.append(Piece(f"state/{state}/{name}", tuple(params[name].shape), "float32", lo, np.asarray(by_name[name]).reshape(-1)))
    return out


def save(
    dp: Any, folder: str | Path, params: Mapping[str, Any], *, optimizer: Any = None, extras: Mapping[str, Any] | None = None, tag: str | None = None
) -> Path:
    """Save ``params`` (the session's ``{name: array}``), a sharded ``optimizer``'s state and ``extras`` (collective).

    Every rank writes its own share into ``folder/tag`` (default tag:
    ``window-<n>``, ``n`` the session's reduce windows so far); the
    checkpoint is published whole or not at all, and ``folder/latest``
    then names it. ``extras`` (JSON values or NumPy arrays: a data
    position, RNG states) are the root's. Returns the checkpoint's path.
    Raises ContractError on every rank if any rank failed; the previous
    checkpoint is then untouched.
    """
    head = None if optimizer is None else {"kind": optimizer.kind, "hyperparameters": optimizer.hyperparameters(), "state_names": list(optimizer.state_names())}
    return write(dp, folder, params, extras, tag, head, lambda: [] if optimizer is None else optimizer_pieces(optimizer, params))


def write(
    dp: Any, folder: str | Path, params: Mapping[str, Any], extras: Mapping[str, Any] | None, tag: str | None,
    optimizer: Mapping[str, Any] | None, more: Callable[[], list[Piece]], adapter: Mapping[str, Any] | None = None,
) -> Path:
    """:func:`save` for any optimizer: its manifest entry ``optimizer``, its pieces ``more()``, an adapter's own entry (collective)."""
    names, aliases = heads(params)
    plain, extra_arrays, error = collective.extras_json(extras)
    pieces: list[Piece] = []
    try:
        pieces = param_pieces(params, names, dp.rank, dp.world_size) + more()
        if dp.rank == 0:
            pieces += [Piece(f"extra/{n}", a.shape, files.dtype_name(a.dtype), 0, a.reshape(-1)) for n, a in extra_arrays.items()]
    except Exception as e:  # noqa: BLE001 - agreed in save_state's first exchange
        error = error or f"{type(e).__name__}: {e}"
    head = {
        "mpidp": version("mpidp"), "window": dp.window, "exact": dp.facts().exact is not None, "params": names, "aliases": aliases,
        "optimizer": optimizer, "extras": plain, "extra_arrays": sorted(extra_arrays), "adapter": adapter,
    }
    tag = f"window-{dp.window:09d}" if tag is None else tag
    return collective.save_state(dp, folder, tag, pieces, head, error)


def judge_model(manifest: Mapping[str, Any], params: Mapping[str, Any], kind: str | None) -> str | None:
    """What in ``manifest`` does not fit this model and optimizer kind (names, ties, the kind), or None."""
    names, aliases = heads(params)
    if manifest["params"] != names:
        theirs, mine = set(manifest["params"]), set(names)
        extra = sorted(theirs - mine)[:1] or sorted(mine - theirs)[:1]
        which = "the checkpoint has" if extra and extra[0] in theirs else "this model has"
        return f"another model: {which} parameter {extra[0]!r} the other lacks" if extra else "another model: parameters in another order"
    if manifest["aliases"] != aliases:
        return f"another model: tied parameters differ (checkpoint {manifest['aliases']}, this model {aliases})"
    saved = manifest.get("optimizer")
    if kind is None:
        return None
    if saved is None:
        return "the checkpoint holds no optimizer state, yet an optimizer was passed"
    if saved["kind"] != kind:
        return f"another optimizer: the checkpoint's is {saved['kind']!r}, this one is {kind!r}"
    return None


def load(dp: Any, where: str | Path, params: Mapping[str, Any], *, optimizer: Any = None) -> dict[str, Any]:
    """Load a checkpoint written at any world size into ``params`` (in place) and ``optimizer``; returns the extras.

    Collective. ``where`` is a checkpoint or a folder of them (its
    ``latest``). Every rank reads the parameters whole and, of a sharded
    optimizer, only the slices it owns at this world size. Raises
    ContractError on every rank, before anything is modified, when the
    checkpoint is incomplete, truncated, of another model (a name, shape,
    dtype or tie differs) or of another optimizer kind.
    """

    def state(path: Path, manifest: Mapping[str, Any], got: list[np.ndarray]) -> None:
        with files.Reader(path, manifest) as reader:  # it checks and agrees on its own hyperparameters before it changes anything
            optimizer.load(manifest["optimizer"]["hyperparameters"], lambda state, name, lo, hi: reader.read(f"state/{state}/{name}", lo, hi))

    return read(dp, where, params, None if optimizer is None else optimizer.kind, [], None if optimizer is None else state)


def read(
    dp: Any, where: str | Path, params: Mapping[str, Any], kind: str | None, more: list[Want],
    then: Callable[[Path, Mapping[str, Any], list[np.ndarray]], None] | None,
    judge: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> dict[str, Any]:
    """:func:`load` for any optimizer: reads ``more`` too and hands them to ``then`` before the parameters are written.

    ``judge`` adds the caller's own checks of the manifest to the core's.
    """
    names, _ = heads(params)
    wants = [Want(f"param/{n}", tuple(params[n].shape), files.dtype_name(host(params[n]).dtype), 0, _numel(params[n].shape)) for n in names]
    path, manifest, got = collective.load_state(dp, where, wants + more, lambda m: judge_model(m, params, kind) or (None if judge is None else judge(m)))
    extras: dict[str, Any] = dict(manifest["extras"])
    with files.Reader(path, manifest) as reader:
        extras.update({n: reader.read(f"extra/{n}").reshape(reader.entry(f"extra/{n}")["shape"]) for n in manifest["extra_arrays"]})
    if then is not None:
        then(path, manifest, got[len(wants):])
    for n, values in zip(names, got):
        v = arrays.view(params[n]).reshape(-1)
        if isinstance(v, np.ndarray):
            v[...] = values
        else:  # a device array (CuPy): one copy from the host
            v.set(values)
    return extras


def _numel(shape: Any) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64))
