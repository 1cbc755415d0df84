"""A checkpoint on disk: one safetensors file per writing rank, a manifest, and the reads of any slice (pure, no MPI).

A checkpoint is a folder::

    manifest.json                     what it holds: tensors, their pieces, the optimizer, extras, world size
    rank-00000-of-00004.safetensors   the pieces rank 0 wrote (flat 1-D runs of elements of logical tensors)
    ...

Every logical tensor (a parameter, an optimizer state of one parameter, a
buffer) is stored as *pieces*: runs ``[lo, hi)`` of its elements in C
order, each under the key ``"<tensor>@<lo>"`` of the file of the rank that
wrote it, in the tensor's own dtype. A reader of any world size reads only
the runs it needs (:class:`Reader`), through safetensors' slices, which
read those bytes and no others. Each rank file's metadata says which
logical tensors its pieces belong to (``"tensors"``: shape and dtype);
the root builds the manifest from the files' headers after every rank has
written its own, so nothing is gathered through MPI.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

__all__ = ["FORMAT", "LATEST", "MANIFEST", "Reader", "build_manifest", "check_files", "consolidate", "cut", "dtype_name", "pieces_of", "rank_file", "read_manifest", "write_json", "write_rank_file"]

FORMAT = "mpidp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
#: a file in the checkpoints' folder naming the newest complete checkpoint
LATEST = "latest"
_KEY = re.compile(r"^(?P<tensor>.+)@(?P<lo>\d+)$")
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "int64": np.int64, "uint8": np.uint8}


def dtype_name(dtype: Any) -> str:
    """The name a manifest gives ``dtype`` (``float32``, ``bfloat16``, ...)."""
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"checkpoints hold {', '.join(_DTYPES)} arrays, not {name}")
    return name


def rank_file(rank: int, size: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint written by ``size`` ranks."""
    return f"rank-{rank:05d}-of-{size:05d}.safetensors"


def cut(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s share ``[lo, hi)`` of ``total`` elements cut into ``size`` contiguous runs (sizes only)."""
    return total * rank // size, total * (rank + 1) // size


def pieces_of(lengths: Iterable[tuple[str, int]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The parts ``(name, start, stop)`` of tensors laid end to end (``(name, numel)`` in order) that ``[lo, hi)`` covers."""
    out, base = [], 0
    for name, n in lengths:
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            out.append((name, a - base, b - base))
        base += n
    return out


def write_rank_file(path: Path, pieces: Mapping[str, np.ndarray], tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Write one rank's pieces (``{"<tensor>@<lo>": 1-D array}``) and their tensors' shapes and dtypes, then fsync."""
    meta = {"format": FORMAT, "tensors": json.dumps({k: [list(s), d] for k, (s, d) in tensors.items()})}
    save_file({k: np.ascontiguousarray(v).reshape(-1) for k, v in pieces.items()}, str(path), metadata=meta)
    _fsync(path)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON under ``path`` atomically: a temporary file, fsync, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_manifest(folder: Path, size: int, head: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of the rank files in ``folder`` (written by ``size`` ranks): ``head`` plus tensors, pieces, files.

    Reads only the files' headers. Raises ValueError naming a file that is
    missing or unreadable, or a tensor whose pieces leave elements out.
    """
    files = [rank_file(r, size) for r in range(size)]
    tensors: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(files):
        with safe_open(str(folder / name), "np") as f:
            for key, (shape, dtype) in json.loads((f.metadata() or {})["tensors"]).items():
                entry = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
                if (entry["shape"], entry["dtype"]) != (shape, dtype):
                    raise ValueError(f"{name}: {key} is {dtype}{shape}, another file says {entry['dtype']}{entry['shape']}")
            for key in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                m = _KEY.match(key)
                if m is None or m["tensor"] not in tensors:
                    raise ValueError(f"{name}: a piece {key!r} of no tensor")
                lo = int(m["lo"])
                tensors[m["tensor"]]["pieces"].append([index, lo, lo + f.get_slice(key).get_shape()[0]])
    for key, entry in tensors.items():
        entry["pieces"].sort(key=lambda p: p[1])
        _coverage(key, entry)
    sizes = [(folder / name).stat().st_size for name in files]
    return {**head, "format": FORMAT, "version": VERSION, "world_size": size, "files": files, "bytes": sizes, "tensors": tensors}


def _coverage(key: str, entry: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``entry``'s pieces (sorted) cover its elements once each."""
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    at = 0
    for _, lo, hi in entry["pieces"]:
        if lo != at:
            raise ValueError(f"tensor {key!r}: elements [{at}, {lo}) are in no file" if lo > at else f"tensor {key!r}: elements from {lo} are in two files")
        at = hi
    if at != numel:
        raise ValueError(f"tensor {key!r}: elements [{at}, {numel}) are in no file")


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check the manifest of the checkpoint at ``path``; ValueError names what is wrong."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file: not a complete mpidp checkpoint") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: not an mpidp checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{file}: format version {manifest.get('version')}, this mpidp reads version {VERSION}")
    for key, entry in manifest["tensors"].items():
        _coverage(key, entry)
    return manifest


def check_files(path: Path, manifest: Mapping[str, Any]) -> str | None:
    """The first rank file that is missing or of another size than the manifest says, or None."""
    for name, size in zip(manifest["files"], manifest["bytes"]):
        try:
            have = (path / name).stat().st_size
        except OSError as e:
            return f"{path / name}: {e.strerror or e}"
        if have != size:
            return f"{path / name}: {have} bytes, the manifest says {size} (truncated or replaced)"
    return None


class Reader:
    """Reads runs of elements of a checkpoint's tensors, touching only the pieces that hold them."""

    def __init__(self, path: Path, manifest: Mapping[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._open: dict[int, Any] = {}

    def __enter__(self) -> Reader:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def entry(self, tensor: str) -> Mapping[str, Any]:
        """The manifest's entry of ``tensor`` (shape, dtype, pieces); KeyError if it holds none."""
        return self.manifest["tensors"][tensor]

    def read(self, tensor: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Elements ``[lo, hi)`` (C order) of ``tensor``, as a new 1-D array of its dtype."""
        entry = self.entry(tensor)
        if hi is None:
            hi = int(np.prod(entry["shape"], dtype=np.int64))
        out = np.empty(hi - lo, dtype=_DTYPES[entry["dtype"]])
        for index, a, b in entry["pieces"]:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out[s - lo : e - lo] = self._file(index).get_slice(f"{tensor}@{a}")[s - a : e - a]
        return out

    def _file(self, index: int) -> Any:
        if index not in self._open:
            name = self.path / self.manifest["files"][index]
            handle = safe_open(str(name), "np")
            self._open[index] = handle.__enter__()
        return self._open[index]


def consolidate(path: Path) -> dict[str, np.ndarray]:
    """Every parameter of the checkpoint at ``path`` (tied names included), whole, by name (local; no MPI)."""
    manifest = read_manifest(path)
    problem = check_files(path, manifest)
    if problem is not None:
        raise ValueError(problem)
    out: dict[str, np.ndarray] = {}
    with Reader(path, manifest) as reader:
        for name in manifest["params"]:
            entry = reader.entry(f"param/{name}")
            out[name] = reader.read(f"param/{name}").reshape(entry["shape"])
        for alias, head in manifest["aliases"].items():
            out[alias] = out[head]
    return out
