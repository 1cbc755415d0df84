"""Save and load a session's training state: every rank writes what it owns, any world size reads it (collective).

Saving takes four agreements of the session (:meth:`DataParallel.agree_record`),
so that a rank that fails, or is elsewhere, is one error on every rank and
never a hang, and a checkpoint is complete or absent::

    1. every rank saves the same tag into the same folder;        (SAVE: agreement; the root's random id for all)
       the root's id names the checkpoint in every file
    2. the root finishes a publish a crash interrupted, refuses   (SAVE: temporary folder)
       an existing tag unless asked to replace it, makes .tmp-<tag>
    3. every rank writes its own file there, fsyncs it, and       (SAVE: written)
       hands on its bytes' checksum
    4. the root publishes (:data:`PUBLISH`): the manifest into    (SAVE: published)
       .tmp-<tag>, the old <tag> (if replaced) to .old-<tag>,
       .tmp-<tag> to <tag>, then ``latest``, then removes .old-<tag>

A crash anywhere leaves ``latest`` naming a complete checkpoint: a tag
whose folder a crash left between two renames resolves to the complete
``.tmp-<tag>`` (new) or ``.old-<tag>`` (old) until the next save finishes
the publish. Loading (:func:`load_state`) resolves, agrees on what every
rank resolved, checks the manifest, the files' sizes, ids and checksums and
every wanted tensor, reads every run into new arrays, and agrees again:
only then may the caller prepare and commit. Nothing here imports MPI.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import records
from ..errors import ContractError
from ..optim.state import Piece, Run
from . import files

__all__ = ["PUBLISH", "agree", "consolidate", "latest", "load_state", "resolve", "save_state"]

#: the steps of a publish, in order (the root's, after every rank wrote its file)
PUBLISH = ("manifest", "retire", "rename", "latest", "clean")
#: how often ranks that resolved different checkpoints (a save raced the load) resolve again before they give up
RESOLVE_TRIES = 5


def agree(session: Any, kind: int, words: Sequence[int], error: str | None, operation: str) -> list[list[int]]:
    """One agreement of the session: every rank's words, or ContractError on every rank where one reported an error."""
    rows: list[list[int]] = session.agree_record(kind, list(words), error, operation)
    return rows


def save_state(
    session: Any, folder: Path, tag: str, pieces: Sequence[Piece], head: Mapping[str, Any], error: str | None = None, replace: bool = False
) -> Path:
    """Write this rank's ``pieces`` of a checkpoint ``folder/tag``; the root adds the manifest ``head`` (collective).

    ``error`` is this rank's own, found while it gathered its pieces.
    Every rank must pass the same folder, tag and ``replace``. Returns the
    published checkpoint's path. Raises ContractError on every rank when a
    rank's input or disk failed, or the tag exists and ``replace`` is
    False; the previous checkpoints and ``latest`` are then as they were.
    """
    error = error or _tag_problem(tag)
    rank, size, root = session.rank, session.world_size, 0
    word = zlib.crc32(f"{folder.resolve()}\0{tag}\0{bool(replace)}".encode())
    rows = agree(session, records.SAVE, [word, secrets.randbits(63)], error, f"checkpoint save {tag!r}: agreement")
    other = records.first_different([r[records.BODY] for r in rows])
    if other is not None:
        raise ContractError(f"ranks save into different folders or tags (or replace differs): rank {other}'s differs from rank 0's")
    ident = f"{rows[root][records.BODY + 1]:016x}"
    tmp, final = folder / f".tmp-{tag}", folder / tag
    error = _attempt(lambda: _fresh(folder, tag, replace)) if rank == root else None
    agree(session, records.SAVE, [], error, f"checkpoint save {tag!r}: temporary folder")
    check: list[int] = [0]
    error = _attempt(lambda: check.__setitem__(0, _write(tmp / files.rank_file(rank, size), pieces, ident)))
    rows = agree(session, records.SAVE, check, error, f"checkpoint save {tag!r}: written")
    checksums = [r[records.BODY] for r in rows]
    error = _attempt(lambda: publish(folder, tag, files.build_manifest(tmp, size, head, ident, checksums))) if rank == root else None
    agree(session, records.SAVE, [], error, f"checkpoint save {tag!r}: published")
    return final


def _tag_problem(tag: Any) -> str | None:
    if files.plain_name(tag) is not None or tag == files.LATEST:
        return f"a checkpoint's tag is a plain folder name (not hidden, not {files.LATEST!r}, no '/'), got {tag!r}"[:300]
    return None


def _attempt(fn: Callable[[], None]) -> str | None:
    """Run ``fn``; this rank's error text, or None (reported to every rank by the next agreement)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every rank raises it, from the agreement
        return f"{type(e).__name__}: {e}"
    return None


def recover(folder: Path) -> None:
    """Finish every publish a crash interrupted in ``folder`` (the root's, before a save): a complete new one wins."""
    for tmp in folder.glob(".tmp-*"):
        tag = tmp.name.removeprefix(".tmp-")
        if (tmp / files.MANIFEST).is_file():  # every rank wrote it and the manifest is there: it replaces the old one
            old = folder / f".old-{tag}"
            if (folder / tag).exists():
                if old.exists():
                    shutil.rmtree(old)
                (folder / tag).rename(old)
            tmp.rename(folder / tag)
    for old in folder.glob(".old-*"):
        tag = old.name.removeprefix(".old-")
        if (folder / tag / files.MANIFEST).is_file():
            shutil.rmtree(old)
        elif not (folder / tag).exists() and (old / files.MANIFEST).is_file():
            old.rename(folder / tag)


def _fresh(folder: Path, tag: str, replace: bool) -> None:
    """Make ``folder/.tmp-<tag>`` empty, after recovering interrupted publishes; refuse an existing tag unless replacing."""
    folder.mkdir(parents=True, exist_ok=True)
    recover(folder)
    if (folder / tag).exists() and not replace:
        raise FileExistsError(f"{folder / tag} exists: save with another tag, or pass replace=True to replace it")
    tmp = folder / f".tmp-{tag}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a save that died before its manifest
    tmp.mkdir()


def _write(path: Path, pieces: Sequence[Piece], ident: str) -> int:
    tensors = {p.key: (p.shape, p.dtype) for p in pieces}
    return files.write_rank_file(path, {f"{p.key}@{p.lo}": p.data for p in pieces if p.data.size}, tensors, ident)


def publish(folder: Path, tag: str, manifest: Mapping[str, Any]) -> None:
    """The root's publish of ``folder/.tmp-<tag>`` as ``folder/tag``, step by step (:data:`PUBLISH`)."""
    tmp, final, old = folder / f".tmp-{tag}", folder / tag, folder / f".old-{tag}"
    for step in PUBLISH:
        if step == "manifest":
            files.write_json(tmp / files.MANIFEST, manifest)
        elif step == "retire" and final.exists():  # replacing: the old one stays complete under .old-<tag>
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        elif step == "rename":
            tmp.rename(final)
            files.fsync(folder)
        elif step == "latest":
            (folder / f".{files.LATEST}.tmp").write_text(tag + "\n")
            (folder / f".{files.LATEST}.tmp").replace(folder / files.LATEST)
            files.fsync(folder)
        elif step == "clean" and old.exists():
            shutil.rmtree(old)
        published(step)


def published(step: str) -> None:
    """Called after each step of a publish (a seam for tests that crash the root between steps)."""


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``folder`` (what ``folder/latest`` names), or None (local)."""
    try:
        name = (Path(folder) / files.LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if files.plain_name(name) is not None:
        return None
    return _complete(Path(folder), name)


def _complete(folder: Path, tag: str) -> Path | None:
    """Where tag ``tag`` of ``folder`` is complete: its folder, or while a publish is interrupted .tmp-/.old-<tag>."""
    for name in (tag, f".tmp-{tag}", f".old-{tag}"):
        if (folder / name / files.MANIFEST).is_file():
            return folder / name
    return None


def resolve(where: str | os.PathLike[str]) -> Path:
    """A checkpoint's path from ``where``: a checkpoint itself, or a folder whose ``latest`` names one (local)."""
    where = Path(where)
    if (where / files.MANIFEST).is_file():
        return where
    found = _complete(where.parent, where.name) if where.name and not (where / files.LATEST).exists() else None
    if found is not None:
        return found
    try:
        name = (where / files.LATEST).read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"{where}: neither a checkpoint (no {files.MANIFEST}) nor a folder of them (no {files.LATEST})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where / files.LATEST}: unreadable ({e})") from None
    problem = files.plain_name(name)
    if problem is not None:
        raise ValueError(f"{where / files.LATEST}: {problem}")
    found = _complete(where, name)
    if found is None:
        raise ValueError(f"{where / files.LATEST} names {name!r}, which is no complete checkpoint of {where}")
    return found


def consolidate(where: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every parameter of a checkpoint (or a folder's newest), whole, by name, checksums verified (local; no MPI)."""
    return files.consolidate(resolve(where))


def _resolved(where: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], int, str | None]:
    """This rank's resolution of ``where``: path, manifest, the manifest's checksum, or the error (local)."""
    try:
        path = resolve(where)
        manifest, digest = files.read_manifest(path)
    except ValueError as e:
        return Path(where), {}, 0, str(e)
    return path, manifest, digest, None


def load_state(session: Any, where: str | os.PathLike[str], plan: Callable[[Mapping[str, Any]], list[Run]]) -> tuple[Path, dict[str, Any], list[np.ndarray]]:
    """Read this rank's runs of the checkpoint at ``where`` (collective): (path, manifest, one array per run).

    Every rank resolves ``where`` and the ranks agree on the checkpoint and
    its manifest's checksum (resolving again while a save into the folder
    races them). ``plan(manifest)`` returns the runs this rank reads, or
    raises ValueError saying what in the manifest does not fit this session.
    Each rank verifies the checksums of its share of the files and the id
    of every file it opens. Every check and read happens before this
    returns: a missing, truncated, damaged or mixed file, a malformed
    manifest, a name, shape or dtype that differs, another model or
    optimizer is one ContractError on every rank, naming the file.
    """
    path, manifest = _agreed(session, where)
    out: list[np.ndarray] = []
    try:
        wants = plan(manifest)
        error = files.check_files(path, manifest) or _missing(path, manifest, wants)
        if error is None:
            error = files.verify(path, manifest, range(session.rank, manifest["world_size"], session.world_size))  # this rank's share
        if error is None:
            with files.Reader(path, manifest) as reader:
                out = [reader.read(w.key, w.lo, w.hi, w.out) for w in wants]
    except ValueError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a file the manifest said was whole, yet unreadable: every rank raises
        error = f"{path}: {type(e).__name__}: {e}"
    agree(session, records.LOAD, [], error, f"checkpoint load {str(path)!r}: checks and reads")
    return path, manifest, out


def _agreed(session: Any, where: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint every rank resolved from ``where``, and its manifest, agreed (collective)."""
    for attempt in range(RESOLVE_TRIES):
        path, manifest, digest, error = _resolved(where)
        word = zlib.crc32(str(path.resolve()).encode()) if error is None else 0
        rows = agree(session, records.LOAD, [word, digest], error, f"checkpoint load {str(path)!r}: what every rank resolved")
        other = records.first_different([r[records.BODY : records.BODY + 2] for r in rows])
        if other is None:
            return path, manifest
        time.sleep(0.05 * (attempt + 1))
    raise ContractError(
        f"checkpoint load: rank {other} resolved another checkpoint than rank 0 (another folder, tag or manifest), "
        f"{RESOLVE_TRIES} times: every rank must load the same one; where a save into the same folder raced the load, "
        "load a tag, or retry when it is done"
    )


def _missing(path: Path, manifest: Mapping[str, Any], wants: Sequence[Run]) -> str | None:
    """The first wanted tensor the checkpoint lacks or holds with another shape or dtype, or None."""
    tensors = manifest["tensors"]
    for w in wants:
        have = tensors.get(w.key)
        if have is None:
            return f"{path / files.MANIFEST}: holds no {w.key!r}"
        if tuple(have["shape"]) != tuple(w.shape) or have["dtype"] != w.dtype:
            return f"{path / files.MANIFEST}: {w.key!r} is {have['dtype']}{list(have['shape'])}, this session's is {w.dtype}{list(w.shape)}"
        if not 0 <= w.lo <= w.hi <= files.numel(have["shape"]):
            return f"{path / files.MANIFEST}: {w.key!r} has no elements [{w.lo}, {w.hi})"
    return None


def stop_requested(session: Any, mine: bool) -> bool:
    """Whether any rank asks to stop (``mine``: this rank's word), the same answer on every rank (collective)."""
    rows = agree(session, records.STOP, [int(bool(mine))], None, "checkpoint stop request")
    return any(r[records.BODY] for r in rows)


def extras_json(extras: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, np.ndarray], str | None]:
    """Split a user's extras into JSON values and arrays (stored as tensors); the error for anything else."""
    plain: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, value in (extras or {}).items():
        if not isinstance(name, str):
            return {}, {}, f"extras are named by strings, got {name!r}"
        if isinstance(value, np.ndarray):
            arrays[name] = value
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return {}, {}, f"extra {name!r} is a {type(value).__name__}: extras are JSON values (numbers, strings, lists, dicts) or NumPy arrays"
        plain[name] = value
    return plain, arrays, None
