"""Per-entry contracts, tie groups, and the diff that names the first difference.

A contract is plain data (tuples of str, int and bool) so that it pickles
without any class and can be decoded by the restricted unpickler.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from . import arrays
from .arrays import FLOATING, ArrayInfo, describe

__all__ = ["Contract", "Entry", "Region", "Regions", "build", "diff", "diff_regions"]


class Entry(NamedTuple):
    """One named array: ``(name, shape, dtype, trainable, alias)``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    alias: int  # index of the first entry holding the same array


Contract = tuple[Entry, ...]


class Region(NamedTuple):
    """One named byte region moved from root as it is (a torch buffer): ``(name, shape, dtype, tie)``.

    Regions of every dtype are copied byte for byte, never reduced.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    tie: str  # the first name of the same tensor (its own name when it is not shared)


Regions = tuple[Region, ...]


class Local(NamedTuple):
    """What one rank found about its own replica."""

    contract: Contract
    arrays: tuple[Any, ...]  # contract order
    infos: tuple[ArrayInfo, ...]
    error: str | None
    device: str = "cpu"  # this rank's device


def build(params: Any, frozen: Any, device: str | None) -> Local:
    """Build this rank's contract and the first local error, communicating nothing.

    Entries are ordered by name, so ranks agree whatever order their
    mappings were filled in. ``device`` None means "cpu" for host arrays and
    the current CUDA device of the first array's backend for GPU arrays;
    every array must be on it.
    """
    if not isinstance(params, Mapping):
        return Local((), (), (), f"params must be a mapping of names to arrays, got {type(params).__name__}")
    names = list(params)
    bad = next((n for n in names if not isinstance(n, str)), None)
    if bad is not None:
        return Local((), (), (), f"parameter names must be str, got {bad!r}")
    names.sort()
    try:
        frozen_set = set(frozen)
    except TypeError:
        return Local((), (), (), f"frozen must be a collection of names, got {type(frozen).__name__}")
    if device is not None and device != "cpu" and (not isinstance(device, str) or re.fullmatch(r"cuda:\d+", device) is None):
        return Local((), (), (), f"device must be 'cpu' or 'cuda:N', got {device!r}")
    unknown = sorted(str(n) for n in frozen_set - set(names))
    error = f"frozen names unknown parameter {unknown[0]!r}" if unknown else None
    entries: list[Entry] = []
    values: list[Any] = []
    infos: list[ArrayInfo] = []
    first: dict[int, int] = {}
    for index, name in enumerate(names):
        array = params[name]
        info = describe(array)
        why = _array_problem(name, array, info)
        if info is None:
            info = ArrayInfo("?", type(array).__name__, (), "?")
        elif why is None and device is None:
            device = info.device if info.device == "cpu" else arrays.current_device(info.backend)
        error = error or why or _placement_problem(name, info, device)
        alias = first.setdefault(id(array), index)
        trainable = name not in frozen_set
        if alias != index and error is None and entries[alias].trainable != trainable:
            error = (
                f"tied parameters {entries[alias].name!r} and {name!r} disagree on the trainable flag "
                "(freeze all names of a tied array or none)"
            )
        entries.append(Entry(name, info.shape, info.dtype, trainable, alias))
        values.append(array)
        infos.append(info)
    if error is None and device is not None:
        error = _device_problem(device, infos)
    return Local(tuple(entries), tuple(values), tuple(infos), error, device or "cpu")


def _array_problem(name: str, array: Any, info: ArrayInfo | None) -> str | None:
    """Why ``array`` cannot be a parameter, or None."""
    if info is None:
        return f"parameter {name!r}: {type(array).__name__} is not a NumPy, CuPy or PyTorch array"
    if info.is_integer:
        return (
            f"parameter {name!r}: {info.dtype} arrays need explicit synchronization "
            "(mpidp moves only float32, float16 and bfloat16)"
        )
    if info.dtype not in FLOATING:
        return f"parameter {name!r}: dtype {info.dtype} is not supported (float32, float16, bfloat16)"
    why = arrays.problem(array)
    return None if why is None else f"parameter {name!r}: {why}"


def _placement_problem(name: str, info: ArrayInfo, device: str | None) -> str | None:
    """Why parameter ``name`` cannot live where it does on this rank's ``device``, or None."""
    if info.dtype == "bfloat16" and info.device.startswith("cuda"):
        why = arrays.device_bfloat16_problem()
        if why is not None:
            return f"parameter {name!r}: {why}"
    if info.device != device:
        return f"parameter {name!r} is on {info.device}, but this rank's device is {device}"
    return None


def _device_problem(device: Any, infos: Sequence[ArrayInfo]) -> str | None:
    """Why ``device`` cannot be this rank's device, or None.

    The device work (casts, scaling, staging copies, stream synchronization)
    runs on the current CUDA device, so an explicit ``cuda:N`` must be it.
    """
    if device == "cpu":
        return None
    gpu = next((i for i in infos if i.device.startswith("cuda")), None)
    if gpu is None:
        return None
    current = arrays.current_device(gpu.backend)
    if current != device:
        index = device.split(":")[1]
        return (
            f"device {device} is not the current CUDA device ({current}): call "
            f"mpidp.cuda.select_device(device={index}) before initialize"
        )
    return None


def diff(mine: Contract, theirs: Contract) -> str | None:
    """Name the first difference between two contracts, or None if they are equal."""
    if mine == theirs:
        return None
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a == b:
            continue
        if a.name != b.name:
            return f"entry {index} is {b.name!r}, expected {a.name!r}"
        for field in ("shape", "dtype", "trainable"):
            if getattr(a, field) != getattr(b, field):
                return f"parameter {a.name!r}: {field} {getattr(b, field)} differs from {getattr(a, field)}"
        return f"parameter {a.name!r}: {_tie(theirs, index)}, expected {_tie(mine, index)}"
    return _count(mine, theirs, "parameters", "expected")


def _tie(contract: Contract, index: int) -> str:
    alias = contract[index].alias
    return "untied" if alias == index else f"tied to {contract[alias].name!r}"


def diff_regions(mine: Regions, theirs: Regions) -> str | None:
    """Name the first region (buffer) of ``theirs`` that differs from rank 0's ``mine``, or None."""
    if mine == theirs:
        return None
    for a, b in zip(mine, theirs):
        if a.name != b.name:
            return f"buffer {b.name!r} where rank 0 has {a.name!r}"
        if a[:3] != b[:3]:
            return f"buffer {a.name!r} is {b.dtype} of shape {b.shape}, on rank 0 {a.dtype} of shape {a.shape}"
        if a != b:
            return f"buffer {a.name!r} is {_shared(b)}, on rank 0 {_shared(a)}"
    return _count(mine, theirs, "buffers", "rank 0 has")


def _shared(region: Region) -> str:
    return "a tensor of its own" if region.tie == region.name else f"the same tensor as {region.tie!r}"


def _count(mine: Sequence[Any], theirs: Sequence[Any], noun: str, expected: str) -> str:
    """The difference of two lists that agree on their common prefix: an extra or a missing name."""
    if len(mine) < len(theirs):
        return f"{len(theirs)} {noun}, {expected} {len(mine)} (extra {theirs[len(mine)].name!r})"
    return f"{len(theirs)} {noun}, {expected} {len(mine)} (missing {mine[len(theirs)].name!r})"
