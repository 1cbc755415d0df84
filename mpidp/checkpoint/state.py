"""A session's training state as checkpoint pieces: parameters, buffers, an optimizer, extras (collective).

The parameters are replicated: their tie-group heads (sorted by name), laid
end to end, are cut into one contiguous run per rank
(:func:`mpidp.checkpoint.files.share`), and each rank writes its run, so the
writing is shared whatever the world size. An optimizer serves the one
contract of :mod:`mpidp.optim.state` (what it writes, what it reads back,
its prepare and commit), whatever its kind. Buffers (an adapter's named
bytes) and extras are the root's. A load checks and reads everything,
prepares the optimizer, agrees, and only then writes: a refused load
changes nothing on any rank.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import arrays, records
from ..optim.state import OptimizerState, Piece, Run
from . import collective, files

__all__ = ["Loaded", "load", "prepare_load", "save"]


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


def shares(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], rank: int, size: int, key: Callable[[str], str]) -> list[Piece]:
    """This rank's runs of ``tensors`` (1-D, by name, in order) laid end to end and cut among ``size`` writers.

    Every tensor is named in every rank's file (its shape and dtype), a run
    of it or not, under ``key(name)``.
    """
    lo, hi = files.share(sum(v.size for v in tensors.values()), size, rank)
    empty = {n: Piece(key(n), tuple(shapes[n]), files.dtype_name(v.dtype), 0, v[:0]) for n, v in tensors.items()}
    runs = files.runs_of([(n, v.size) for n, v in tensors.items()], lo, hi)
    return list(empty.values()) + [empty[n]._replace(lo=a, data=tensors[n][a:b]) for n, a, b in runs]


def save(
    dp: Any, folder: str | os.PathLike[str], params: Mapping[str, Any], *, optimizer: OptimizerState | None = None,
    extras: Mapping[str, Any] | None = None, tag: str | None = None, replace: bool = False, buffers: Mapping[str, tuple[str, np.ndarray]] | None = None,
    error: str | None = None,
) -> Path:
    """Save ``params`` (the session's ``{name: array}``), ``optimizer``'s state and ``extras`` (collective).

    Every rank writes its own share into ``folder/tag`` (default tag:
    ``window-<n>``, ``n`` the run's reduce windows so far, counted on from
    the checkpoint a session loaded); the checkpoint is published whole or
    not at all, and ``folder/latest`` then names it. A tag that exists is
    refused unless ``replace=True``. ``extras`` (JSON values or NumPy
    arrays: a data position, RNG states) and ``buffers`` (an adapter's
    ``{name: (description, uint8 bytes)}``) are the root's. Returns the
    checkpoint's path. Raises ContractError on every rank if any rank
    failed (``error``: an adapter's own); the previous checkpoints are then
    untouched.
    """
    names, aliases = heads(params)
    plain, extra_arrays, problem = collective.extras_json(extras)
    error = error or problem
    pieces: list[Piece] = []
    described = None
    try:
        described = None if optimizer is None else {"kind": optimizer.kind, "description": optimizer.describe()}
        views = {n: host(params[n]).reshape(-1) for n in names}
        pieces = shares(views, {n: tuple(params[n].shape) for n in names}, dp.rank, dp.world_size, lambda n: f"param/{n}")
        pieces += [] if optimizer is None else optimizer.pieces(dp.rank, dp.world_size)
        if dp.rank == 0:
            pieces += [Piece(f"extra/{n}", a.shape, files.dtype_name(a.dtype), 0, a.reshape(-1)) for n, a in extra_arrays.items()]
            pieces += [Piece(f"buffer/{n}", (b.size,), "uint8", 0, b) for n, (_, b) in (buffers or {}).items()]
    except Exception as e:  # noqa: BLE001 - agreed in save_state's first exchange
        error = error or f"{type(e).__name__}: {e}"
    head = {
        "mpidp": version("mpidp"), "window": dp.window, "exact": dp.facts().exact is not None, "params": names, "aliases": aliases,
        "optimizer": described, "extras": plain, "extra_arrays": sorted(extra_arrays), "buffers": {n: d for n, (d, _) in (buffers or {}).items()},
    }
    tag = f"window-{dp.window:09d}" if tag is None else tag
    return collective.save_state(dp, Path(folder), tag, pieces, head, error, replace)


class Loaded(NamedTuple):
    """A load every rank has checked, read and prepared: its extras and buffers, and the commit that writes it."""

    path: Path
    extras: dict[str, Any]
    buffers: dict[str, np.ndarray]
    commit: Callable[[], None]


def _judge(manifest: Mapping[str, Any], params: Mapping[str, Any], optimizer: OptimizerState | None, buffers: Mapping[str, str]) -> str | None:
    """What in ``manifest`` does not fit this model, its buffers and optimizer kind, or None."""
    names, aliases = heads(params)
    if manifest["params"] != names:
        theirs, mine = set(manifest["params"]), set(names)
        extra = sorted(theirs - mine)[:1] or sorted(mine - theirs)[:1]
        which = "the checkpoint has" if extra and extra[0] in theirs else "this model has"
        return f"another model: {which} parameter {extra[0]!r} the other lacks" if extra else "another model: parameters in another order"
    if manifest["aliases"] != aliases:
        return f"another model: tied parameters differ (checkpoint {manifest['aliases']}, this model {aliases})"
    for name in sorted(set(manifest["buffers"]) | set(buffers)):
        if manifest["buffers"].get(name) != buffers.get(name):
            return f"another model: buffer {name!r} is {manifest['buffers'].get(name) or 'absent'} in the checkpoint, {buffers.get(name) or 'absent'} here"
    saved = manifest.get("optimizer")
    if optimizer is None:
        return None
    if saved is None:
        return "the checkpoint holds no optimizer state, yet an optimizer was passed"
    if saved["kind"] != optimizer.kind:
        return f"another optimizer: the checkpoint's is {saved['kind']!r}, this one is {optimizer.kind!r}"
    return None


def prepare_load(
    dp: Any, where: str | os.PathLike[str], params: Mapping[str, Any], *, optimizer: OptimizerState | None = None,
    buffers: Mapping[str, tuple[str, int]] | None = None, error: str | None = None,
) -> Loaded:
    """Check, read and prepare a checkpoint of any world size for ``params``, ``optimizer`` and ``buffers`` (collective).

    ``buffers``: ``{name: (description, bytes)}`` the checkpoint must hold
    alike; ``error``: an adapter's own. Nothing is written until the
    returned commit runs (it cannot fail); every refusal is one
    ContractError on every rank.
    """
    names, _ = heads(params)
    fixed: list[int] = []

    def plan(manifest: Mapping[str, Any]) -> list[Run]:
        runs = _runs(manifest, params, names, optimizer, buffers or {}, error)
        fixed.append(len(runs))
        return runs + ([] if optimizer is None else optimizer.wants(manifest["optimizer"]["description"]))

    path, manifest, got = collective.load_state(dp, where, plan)
    nb = len(buffers or {})
    commit_optimizer: Callable[[], None] = _nothing
    refused = None
    if optimizer is not None:
        try:
            commit_optimizer = optimizer.prepare(manifest["optimizer"]["description"], got[fixed[0] :])
        except ValueError as e:
            refused = f"{path / files.MANIFEST}: {e}"
    collective.agree(dp, records.LOAD, [], refused, f"checkpoint load {str(path)!r}: the optimizer's state")
    extras: dict[str, Any] = dict(manifest["extras"])
    extra_values = got[len(names) + nb : fixed[0]]
    extras.update({n: v.reshape(manifest["tensors"][f"extra/{n}"]["shape"]) for n, v in zip(manifest["extra_arrays"], extra_values)})

    def commit() -> None:
        commit_optimizer()
        for n, values in zip(names, got):
            v = arrays.view(params[n]).reshape(-1)
            if isinstance(v, np.ndarray):
                v[...] = values
            else:  # a device array (CuPy): one copy from the host
                v.set(values)
        dp.continue_count(manifest["window"])
        _warn_exact(dp, path, manifest)

    return Loaded(path, extras, dict(zip(buffers or {}, got[len(names) : len(names) + nb])), commit)


def _runs(
    manifest: Mapping[str, Any], params: Mapping[str, Any], names: list[str], optimizer: OptimizerState | None,
    buffers: Mapping[str, tuple[str, int]], error: str | None,
) -> list[Run]:
    """What every load reads of ``manifest``: the parameters whole, the buffers, the extra arrays (ValueError: refused)."""
    problem = error or _judge(manifest, params, optimizer, {n: d for n, (d, _) in buffers.items()})
    if problem is not None:
        raise ValueError(problem)
    runs = [Run(f"param/{n}", tuple(params[n].shape), files.dtype_name(host(params[n]).dtype), 0, files.numel(params[n].shape)) for n in names]
    runs += [Run(f"buffer/{n}", (size,), "uint8", 0, size) for n, (_, size) in buffers.items()]
    extra = [(n, manifest["tensors"][f"extra/{n}"]) for n in manifest["extra_arrays"]]
    return runs + [Run(f"extra/{n}", tuple(e["shape"]), e["dtype"], 0, files.numel(e["shape"])) for n, e in extra]


def _nothing() -> None:
    """The commit of no optimizer."""


def _warn_exact(dp: Any, path: Path, manifest: Mapping[str, Any]) -> None:
    """Warn (root) where an exact checkpoint loads into a session that is not exact, or the other way round."""
    exact = dp.facts().exact is not None
    if manifest["exact"] != exact and dp.rank == 0:
        saved, here = ("exact=True", "without it") if manifest["exact"] else ("without exact=True", "exact=True")
        warnings.warn(f"{path} was saved {saved}, this session runs {here}: the run goes on, but not with the bits it would have had", stacklevel=4)


def load(dp: Any, where: str | os.PathLike[str], params: Mapping[str, Any], *, optimizer: OptimizerState | None = None) -> dict[str, Any]:
    """Load a checkpoint written at any world size into ``params`` (in place) and ``optimizer``; returns the extras.

    Collective. ``where`` is a checkpoint or a folder of them (its
    ``latest``); every rank resolves it and the ranks agree on what they
    resolved. Every rank reads the parameters whole and the optimizer's
    runs it needs (a sharded optimizer: only the slices it owns at this
    world size). Raises ContractError on every rank, before anything is
    modified, when the checkpoint is incomplete, truncated, damaged or
    mixed (checksums, ids), malformed, of another model (a name, shape,
    dtype or tie differs) or of another optimizer. The session's window
    count goes on from the checkpoint's, so default tags never repeat.
    """
    loaded = prepare_load(dp, where, params, optimizer=optimizer)
    loaded.commit()
    return loaded.extras
