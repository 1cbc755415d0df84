"""A checkpoint on disk: one safetensors file per writing rank, a manifest, checked reads of any slice (pure, no MPI).

A checkpoint is a folder::

    manifest.json                     what it holds: tensors, their pieces, the files' sizes and checksums, its id
    rank-00000-of-00004.safetensors   the pieces rank 0 wrote (flat 1-D runs of elements of logical tensors)
    ...

Every logical tensor (a parameter, an optimizer state of one parameter, a
buffer) is stored as *pieces*: runs ``[lo, hi)`` of its elements in C
order, each under the key ``"<tensor>@<lo>"`` of the file of the rank that
wrote it, in the tensor's own dtype. A reader of any world size reads only
the runs it needs (:class:`Reader`), through safetensors' slices. Each rank
file's metadata names the checkpoint's id and the logical tensors of its
pieces; each file's xxh3-64 checksum is computed by its writer right after
writing (from the page cache) and kept in the manifest. Nothing a manifest or ``latest`` says can name a
file outside the checkpoint's folder: file names are checked against the
one scheme before anything is opened (:func:`check_manifest`).
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors import safe_open  # build_manifest reads headers with it
from safetensors.numpy import save_file

from ..arrays import bfloat16
from ..cut import bounds, pieces, starts

__all__ = [
    "FORMAT", "LATEST", "MANIFEST", "Reader", "build_manifest", "check_files", "check_manifest", "checksum_file",
    "consolidate", "dtype_name", "plain_name", "rank_file", "read_manifest", "runs_of", "share", "write_json", "write_rank_file",
]

FORMAT = "mpidp-checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
#: a file in the checkpoints' folder naming the newest complete checkpoint
LATEST = "latest"
_KEY = re.compile(r"^(?P<tensor>.+)@(?P<lo>\d+)$")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "uint8")


def _dtype(name: str) -> np.dtype:
    """The dtype a manifest names (one of ``_DTYPES``; bfloat16 is ml_dtypes', imported when a checkpoint holds it)."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def dtype_name(dtype: Any) -> str:
    """The name a manifest gives ``dtype`` (``float32``, ``bfloat16``, ...)."""
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"checkpoints hold {', '.join(_DTYPES)} arrays, not {name}")
    return name


def rank_file(rank: int, size: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint written by ``size`` ranks."""
    return f"rank-{rank:05d}-of-{size:05d}.safetensors"


def plain_name(name: Any) -> str | None:
    """Why ``name`` is not a plain name of an entry of a folder (a tag, a file), or None."""
    bad = not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".") or len(name) > 255
    if bad or any(c in name for c in "/\\\0\n"):
        return f"not a plain name inside the folder: {name!r}"[:200]
    return None


def share(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s run ``[lo, hi)`` of ``total`` elements cut into ``size`` runs (:func:`mpidp.cut.bounds`)."""
    b = bounds(total, size)
    return b[rank], b[rank + 1]


def runs_of(lengths: list[tuple[str, int]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The parts ``(name, start, stop)`` of tensors laid end to end (``(name, numel)`` in order) that ``[lo, hi)`` covers."""
    begin = starts([n for _, n in lengths])
    return [(lengths[p.slot][0], p.a, p.b) for p in pieces(begin, lo, hi)]


def write_rank_file(path: Path, runs: Mapping[str, np.ndarray], tensors: Mapping[str, tuple[tuple[int, ...], str]], ident: str) -> int:
    """Write one rank's runs (``{"<tensor>@<lo>": 1-D array}``), their tensors and the checkpoint id; fsync; its checksum."""
    meta = {"format": FORMAT, "id": ident, "tensors": json.dumps({k: [list(s), d] for k, (s, d) in tensors.items()})}
    save_file({k: np.ascontiguousarray(v).reshape(-1) for k, v in runs.items()}, str(path), metadata=meta)
    fsync(path)
    return checksum_file(path)  # the bytes just written, from the page cache: no copy of the file in memory


def checksum_file(path: Path) -> int:
    """The xxh3-64 checksum of a file's bytes (63 bits: one word of an agreement), as :func:`write_rank_file` returns it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_intdigest(b"") >> 1
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # hashed where the page cache holds it: no copy
            return xxhash.xxh3_64_intdigest(m) >> 1


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON under ``path`` atomically: a temporary file, fsync, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def fsync(path: Path) -> None:
    """fsync a file or folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_manifest(folder: Path, size: int, head: Mapping[str, Any], ident: str, checksums: list[int]) -> dict[str, Any]:
    """The manifest of the rank files in ``folder`` (written by ``size`` ranks): ``head`` plus tensors, pieces, files.

    Reads only the files' headers. Raises ValueError naming a file that is
    missing or unreadable, or a tensor whose pieces leave elements out.
    """
    names = [rank_file(r, size) for r in range(size)]
    tensors: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(names):
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
    sizes = [(folder / name).stat().st_size for name in names]
    checks = [f"{c:016x}" for c in checksums]
    return {**head, "format": FORMAT, "version": VERSION, "id": ident, "world_size": size, "files": names, "bytes": sizes, "checksums": checks, "tensors": tensors}


def numel(shape: Any) -> int:
    """The element count of a shape (a list or tuple of non-negative ints), exact."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _coverage(key: str, entry: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``entry``'s pieces (sorted) cover its elements once each."""
    total = numel(entry["shape"])
    at = 0
    for _, lo, hi in entry["pieces"]:
        if lo != at:
            raise ValueError(f"tensor {key!r}: elements [{at}, {lo}) are in no file" if lo > at else f"tensor {key!r}: elements from {lo} are in two files")
        at = hi
    if at != total:
        raise ValueError(f"tensor {key!r}: elements [{at}, {total}) are in no file")


def read_manifest(path: Path) -> tuple[dict[str, Any], int]:
    """Read and check the manifest of the checkpoint at ``path``, and its bytes' checksum; ValueError names what is wrong."""
    file = path / MANIFEST
    try:
        text = file.read_bytes()
        manifest = json.loads(text)
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file: not a complete mpidp checkpoint") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: not an mpidp checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{file}: format version {manifest.get('version')!r}, this mpidp reads version {VERSION}")
    problem = check_manifest(manifest)
    if problem is not None:
        raise ValueError(f"{file}: {problem}")
    return manifest, xxhash.xxh3_64_intdigest(text) >> 1


_TOP: dict[str, Any] = {
    "id": str, "world_size": int, "files": list, "bytes": list, "checksums": list, "tensors": dict, "mpidp": str, "window": int,
    "exact": bool, "params": list, "aliases": dict, "extras": dict, "extra_arrays": list, "buffers": dict,
}


def check_manifest(m: Mapping[str, Any]) -> str | None:
    """The first field of a manifest that is missing, of another type, or out of bounds, named; or None."""
    for field, kind in _TOP.items():
        if field not in m:
            return f"field {field!r} is missing"
        if not isinstance(m[field], kind) or (kind is int and isinstance(m[field], bool)):
            return f"field {field!r} is a {type(m[field]).__name__}, not a {kind.__name__}"
    size = m["world_size"]
    if not 1 <= size <= 1 << 20 or m["window"] < 0:
        return f"field 'world_size' or 'window' is out of range ({size}, {m['window']})"
    if m["files"] != [rank_file(r, size) for r in range(size)]:
        return f"field 'files' must name the {size} rank files {rank_file(0, size)!r}, ... of this folder, got {str(m['files'])[:200]}"
    if len(m["bytes"]) != size or not all(_count(b) for b in m["bytes"]):
        return "field 'bytes' must hold one non-negative int per file"
    if len(m["checksums"]) != size or not all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{16}", c) for c in m["checksums"]):
        return "field 'checksums' must hold one 16-digit hex checksum per file"
    names = [*m["params"], *m["aliases"], *m["aliases"].values(), *m["extra_arrays"], *m["buffers"]]
    if not all(isinstance(n, str) for n in names) or not all(isinstance(v, str) for v in m["buffers"].values()):
        return "fields 'params', 'aliases', 'extra_arrays' and 'buffers' hold names (strings)"
    if m.get("optimizer") is not None and not (isinstance(m["optimizer"], dict) and isinstance(m["optimizer"].get("kind"), str) and isinstance(m["optimizer"].get("description"), dict)):
        return "field 'optimizer' must be null or hold a 'kind' (string) and a 'description' (object)"
    wanted = [f"param/{n}" for n in m["params"]] + [f"extra/{n}" for n in m["extra_arrays"]] + [f"buffer/{n}" for n in m["buffers"]]
    missing = [k for k in wanted if k not in m["tensors"]] + [h for h in m["aliases"].values() if h not in m["params"]]
    if missing:
        return f"it names {missing[0]!r}, which it does not hold"
    used = [0] * size
    for key, entry in m["tensors"].items():
        problem = _entry(key, entry, size, used)
        if problem is not None:
            return problem
    over = [r for r in range(size) if used[r] > m["bytes"][r]]
    return None if not over else f"the tensors' pieces need {used[over[0]]} bytes of {m['files'][over[0]]}, which has {m['bytes'][over[0]]}"


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(key: str, entry: Any, size: int, used: list[int]) -> str | None:
    """What is wrong with one tensor's entry (shape, dtype, pieces in bounds and covering it once), or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or not all(_count(d) for d in entry["shape"]):
        return f"tensor {key!r}: 'shape' must be a list of non-negative ints"
    if entry.get("dtype") not in _DTYPES or not isinstance(entry.get("pieces"), list):
        return f"tensor {key!r}: 'dtype' must be one of {', '.join(_DTYPES)} and 'pieces' a list"
    total, itemsize = numel(entry["shape"]), _dtype(entry["dtype"]).itemsize
    for p in entry["pieces"]:
        if not (isinstance(p, list) and len(p) == 3 and all(_count(x) for x in p) and p[0] < size and p[1] < p[2] <= total):
            return f"tensor {key!r}: a piece {str(p)[:80]} is not [file index, lo, hi] within the tensor and the files"
        used[p[0]] += (p[2] - p[1]) * itemsize
    try:
        _coverage(key, entry)
    except ValueError as e:
        return str(e)
    return None


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


def verify(path: Path, manifest: Mapping[str, Any], which: range) -> str | None:
    """The first of the files ``which`` (indices) whose bytes' checksum differs from the manifest's, named; or None."""
    for index in which:
        name = manifest["files"][index]
        have, want = f"{checksum_file(path / name):016x}", manifest["checksums"][index]
        if have != want:
            return f"{path / name}: checksum {have}, the manifest says {want}: the file is damaged or was replaced"
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
            f.close()
        self._open.clear()

    def entry(self, tensor: str) -> Mapping[str, Any]:
        """The manifest's entry of ``tensor`` (shape, dtype, pieces); KeyError if it holds none."""
        return self.manifest["tensors"][tensor]

    def read(self, tensor: str, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[lo, hi)`` (C order) of ``tensor``, read straight into ``out`` (1-D, contiguous) or a new array."""
        entry = self.entry(tensor)
        if hi is None:
            hi = numel(entry["shape"])
        if out is None:
            out = np.empty(hi - lo, dtype=_dtype(entry["dtype"]))
        elif out.shape != (hi - lo,) or out.dtype != _dtype(entry["dtype"]) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{tensor}: cannot read {hi - lo} {entry['dtype']} values into {out.dtype}{list(out.shape)}")
        for index, a, b in entry["pieces"]:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                self._file(index).read_into(f"{tensor}@{a}", entry["dtype"], s - a, out[s - lo : e - lo])
        return out

    def _file(self, index: int) -> _RankFile:
        if index not in self._open:
            name = self.path / self.manifest["files"][index]
            f = _RankFile(name)
            if f.meta.get("id") != self.manifest["id"]:
                f.close()
                raise ValueError(f"{name}: belongs to checkpoint {f.meta.get('id')!r}, the manifest is checkpoint {self.manifest['id']!r}: files of two checkpoints are mixed")
            self._open[index] = f
        return self._open[index]


#: safetensors' names of the dtypes a manifest names
_SAFETENSORS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "uint8": "U8"}


class _RankFile:
    """One rank file open for reading: its safetensors header, and runs of its pieces read straight into arrays."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115 - closed by the Reader
        try:
            n = int.from_bytes(self._f.read(8), "little")
            size = os.fstat(self._f.fileno()).st_size
            if not 2 <= n <= size - 8:
                raise ValueError(f"{path}: not a safetensors file (header of {n} bytes in {size})")
            header = json.loads(self._f.read(n))
            self.meta = header.pop("__metadata__", None) or {}
        except (OSError, ValueError) as e:
            self._f.close()
            raise ValueError(f"{path}: unreadable header ({e})") from None
        self._entries = header
        self._base, self._size = 8 + n, size

    def read_into(self, key: str, dtype: str, start: int, out: np.ndarray) -> None:
        """Elements ``[start, start + out.size)`` of piece ``key`` (of ``dtype``) into contiguous ``out``."""
        e = self._entries.get(key)
        if not isinstance(e, dict) or e.get("dtype") != _SAFETENSORS[dtype]:
            raise ValueError(f"{self.path}: holds no {dtype} piece {key!r}")
        lo, hi = e["data_offsets"]
        at = self._base + lo + start * out.itemsize
        if at + out.nbytes > min(self._base + hi, self._size):
            raise ValueError(f"{self.path}: piece {key!r} ends before element {start + out.size}")
        self._f.seek(at)
        if self._f.readinto(out.view(np.uint8).data) != out.nbytes:
            raise ValueError(f"{self.path}: truncated in piece {key!r}")

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def consolidate(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every parameter of the checkpoint at ``path`` (tied names included), whole, by name (local; no MPI).

    Every file's checksum is verified first; ValueError names what is wrong.
    """
    path = Path(path)
    manifest, _ = read_manifest(path)
    problem = check_files(path, manifest) or verify(path, manifest, range(manifest["world_size"]))
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
