"""Save and load a session's training state: every rank writes what it owns, any world size reads it (collective).

Saving takes four agreements of the session (:meth:`DataParallel.agree_record`),
so that a rank that fails, or is elsewhere, is one error on every rank and
never a hang, and a checkpoint is complete or absent::

    1. every rank saves the same tag into the same folder         (SAVE: agreement)
    2. the root makes <folder>/.tmp-<tag>, empty                  (SAVE: temporary folder)
    3. every rank writes its own file there and fsyncs it          (SAVE: written)
    4. the root reads the files' headers, writes the manifest,     (SAVE: published)
       renames .tmp-<tag> to <tag>, then points <folder>/latest at it

A rank killed anywhere before step 4's rename leaves ``.tmp-<tag>`` behind
(removed by the next save) and ``latest`` on the previous checkpoint.
Loading checks everything before it touches anything: the manifest, the
files' sizes, every wanted tensor's name, shape and dtype, then reads every
run this rank needs into new arrays, and only then, agreed, hands them over.
Nothing here imports MPI: the session's agreement is the only collective.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import records
from ..errors import ContractError
from . import files

__all__ = ["Piece", "Want", "latest", "load_state", "resolve", "save_state"]


class Piece(NamedTuple):
    """A run of a logical tensor that this rank writes: elements ``[lo, lo + len(data))`` in C order."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    lo: int
    data: np.ndarray  # 1-D, the tensor's dtype


class Want(NamedTuple):
    """A run of a logical tensor this rank reads: ``key`` must be ``dtype`` of ``shape`` in the checkpoint."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    lo: int
    hi: int


def _agree(session: Any, kind: int, words: Sequence[int], error: str | None, operation: str) -> list[list[int]]:
    rows: list[list[int]] = session.agree_record(kind, list(words), error, operation)
    return rows


def save_state(
    session: Any, folder: str | Path, tag: str, pieces: Sequence[Piece], head: Mapping[str, Any], error: str | None = None
) -> Path:
    """Write this rank's ``pieces`` of a checkpoint ``folder/tag``; the root adds the manifest ``head`` (collective).

    ``error`` is this rank's own, found while it gathered its pieces.
    Every rank must pass the same folder and tag. Returns the published
    checkpoint's path. Raises ContractError on every rank when a rank's
    input or disk failed; the previous checkpoint and ``latest`` are then
    as they were.
    """
    folder, error = Path(folder), error or _tag_problem(tag)
    rank, size, root = session.rank, session.world_size, 0
    word = zlib.crc32(f"{folder.resolve()}\0{tag}".encode())
    rows = _agree(session, records.SAVE, [word], error, f"checkpoint save {tag!r}: agreement")
    other = records.first_different([r[records.BODY] for r in rows])
    if other is not None:
        raise ContractError(f"ranks save into different folders or tags: rank {other}'s folder or tag differs from rank 0's")
    tmp, final = folder / f".tmp-{tag}", folder / tag
    error = _attempt(lambda: _fresh(tmp)) if rank == root else None
    _agree(session, records.SAVE, [], error, f"checkpoint save {tag!r}: temporary folder")
    error = _attempt(lambda: _write(tmp / files.rank_file(rank, size), pieces))
    _agree(session, records.SAVE, [], error, f"checkpoint save {tag!r}: written")
    error = _attempt(lambda: _publish(folder, tmp, final, size, head)) if rank == root else None
    _agree(session, records.SAVE, [], error, f"checkpoint save {tag!r}: published")
    return final


def _tag_problem(tag: Any) -> str | None:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or tag == files.LATEST:
        return f"a checkpoint's tag is a plain folder name (not hidden, not {files.LATEST!r}), got {tag!r}"
    return None


def _attempt(fn: Callable[[], None]) -> str | None:
    """Run ``fn``; this rank's error text, or None (reported to every rank by the next agreement)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every rank raises it, from the agreement
        return f"{type(e).__name__}: {e}"
    return None


def _fresh(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # a save that died here before
    tmp.mkdir()


def _write(path: Path, pieces: Sequence[Piece]) -> None:
    tensors = {p.key: (p.shape, p.dtype) for p in pieces}
    files.write_rank_file(path, {f"{p.key}@{p.lo}": p.data for p in pieces if p.data.size}, tensors)


def _publish(folder: Path, tmp: Path, final: Path, size: int, head: Mapping[str, Any]) -> None:
    manifest = files.build_manifest(tmp, size, head)
    files.write_json(tmp / files.MANIFEST, manifest)
    old = folder / f".old-{final.name}"
    if final.exists():  # saving the same tag again: the new one replaces it whole
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    (folder / f".{files.LATEST}.tmp").write_text(final.name + "\n")
    (folder / f".{files.LATEST}.tmp").replace(folder / files.LATEST)
    if old.exists():
        shutil.rmtree(old)


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (what ``folder/latest`` names), or None (local)."""
    try:
        name = (Path(folder) / files.LATEST).read_text().strip()
    except OSError:
        return None
    path = Path(folder) / name
    return path if (path / files.MANIFEST).is_file() else None


def resolve(where: str | Path) -> Path:
    """A checkpoint's path from ``where``: a checkpoint itself, or a folder whose ``latest`` names one (local)."""
    where = Path(where)
    if (where / files.MANIFEST).is_file():
        return where
    found = latest(where)
    if found is None:
        raise ValueError(f"{where}: neither a checkpoint (no {files.MANIFEST}) nor a folder of them (no {files.LATEST})")
    return found


def load_state(
    session: Any, where: str | Path, wants: Sequence[Want], judge: Callable[[Mapping[str, Any]], str | None]
) -> tuple[Path, dict[str, Any], list[np.ndarray]]:
    """Read this rank's runs ``wants`` of the checkpoint at ``where`` (collective): (path, manifest, one array per want).

    ``judge`` says what in the manifest does not fit this session (another
    model, optimizer kind), or None. Every check and every read happens
    before this returns and before the caller touches anything: a missing or
    truncated file, a name, shape or dtype that differs, or another
    optimizer is one ContractError on every rank, naming the file and the
    first difference.
    """
    path, manifest, error = Path(where), {}, None
    try:
        path = resolve(where)
        manifest = files.read_manifest(path)
        error = files.check_files(path, manifest) or judge(manifest) or _missing(path, manifest, wants)
    except ValueError as e:
        error = str(e)
    _agree(session, records.LOAD, [], error, f"checkpoint load {str(path)!r}: checks")
    out: list[np.ndarray] = []
    try:
        with files.Reader(path, manifest) as reader:
            out = [reader.read(w.key, w.lo, w.hi) for w in wants]
    except Exception as e:  # noqa: BLE001 - a file the headers said was whole, yet unreadable: every rank raises
        error = f"{path}: {type(e).__name__}: {e}"
    _agree(session, records.LOAD, [], error, f"checkpoint load {str(path)!r}: reads")
    return path, manifest, out


def _missing(path: Path, manifest: Mapping[str, Any], wants: Sequence[Want]) -> str | None:
    """The first wanted tensor the checkpoint lacks or holds with another shape or dtype, or None."""
    tensors = manifest["tensors"]
    for w in wants:
        have = tensors.get(w.key)
        if have is None:
            return f"{path / files.MANIFEST}: holds no {w.key!r}"
        if tuple(have["shape"]) != tuple(w.shape) or have["dtype"] != w.dtype:
            return f"{path / files.MANIFEST}: {w.key!r} is {have['dtype']}{list(have['shape'])}, this session's is {w.dtype}{list(w.shape)}"
    return None


def stop_requested(session: Any, mine: bool) -> bool:
    """Whether any rank asks to stop (``mine``: this rank's word), the same answer on every rank (collective)."""
    rows = _agree(session, records.STOP, [int(bool(mine))], None, "checkpoint stop request")
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
