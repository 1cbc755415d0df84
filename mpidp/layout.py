"""Memory geometry and flat storage: where arrays lie, and laying them out so that nothing needs packing.

Pure and local: no communication. :func:`runs` finds parameters that lie
back to back (one Bcast region each); :func:`overlap` refuses gradients
that share memory; :class:`FlatGradients` is the persistent gradient
storage of :meth:`mpidp.DataParallel.gradient_buffers`; :func:`flat_parameters`
copies parameters into the same kind of storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import arrays
from .packing import Slot, plan, slot

__all__ = ["FlatGradients", "Prepared", "crc_bytes", "flat_parameters", "overlap", "region", "runs", "strided_bounds"]


def strided_bounds(address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``[lo, hi)`` byte range of a non-empty strided array starting at ``address`` (as ``numpy.byte_bounds``)."""
    lo = hi = address
    for n, stride in zip(shape, strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + itemsize


def overlap(views: Sequence[Any], names: Sequence[str]) -> str | None:
    """Name two gradients that share memory (each result needs its own memory), or None.

    Views whose byte ranges intersect are compared exactly, so that
    interleaved views that share no element (``buf[0::2]`` and
    ``buf[1::2]``) are accepted.
    """
    ranges = []
    for v, name in zip(views, names):
        if not v.size:
            continue
        address = arrays.address(v)  # a CuPy view: device addresses (one device per rank), compared alike
        ranges.append((*strided_bounds(address, v.shape, v.strides, v.itemsize), name, v, address))
    ranges.sort(key=lambda r: r[0])
    for i, (_, hi, a, v, address) in enumerate(ranges):
        for lo, _, b, w, other in ranges[i + 1 :]:
            if lo >= hi:  # sorted by start: no later range reaches into this one
                break
            if np.shares_memory(_layout(v, address), _layout(w, other)):  # exact; arithmetic only
                return f"gradients {a!r} and {b!r} share memory (each needs its own)"
    return None


class _Layout:
    """An address, shape and strides as NumPy sees an array, for :func:`numpy.shares_memory` (never read)."""

    def __init__(self, v: Any, address: int) -> None:
        self.__array_interface__ = {
            "data": (address, False), "shape": tuple(v.shape), "strides": tuple(v.strides), "typestr": f"|V{v.itemsize}", "version": 3,
        }


def _layout(v: Any, address: int) -> np.ndarray:
    return np.asarray(_Layout(v, address))


def runs(heads: Sequence[Any], device: str) -> tuple[tuple[int, ...], ...] | None:
    """Group the non-empty tie-group heads into runs of adjacent contiguous host memory, or None.

    A run is a tuple of positions in ``heads`` whose arrays are
    C-contiguous and follow one another in memory, in address order: one
    region of bytes. Runs are listed in the order of their first head, not
    by address, so that buffers allocated in another order on another rank
    still match. Exchanged in the initialize record: ranks with equal runs
    broadcast region by region, with no packing.
    """
    if device != "cpu":
        return None
    extents = []
    for position, array in enumerate(heads):
        v = arrays.view(array)
        if v.size:
            if not v.flags.c_contiguous:
                return None
            extents.append((arrays.address(v), v.nbytes, position))
    extents.sort()
    found: list[list[int]] = []
    end = -1
    for address, nbytes, k in extents:
        if address == end:
            found[-1].append(k)
        else:
            found.append([k])
        end = address + nbytes
    return tuple(sorted(tuple(r) for r in found))  # in head order: where each buffer lies must not matter


def region(heads: Sequence[Any], run: tuple[int, ...]) -> np.ndarray:
    """A uint8 view of the memory of one run (positions into ``heads``, in address order)."""
    first = arrays.view(heads[run[0]])
    nbytes = sum(arrays.view(heads[k]).nbytes for k in run)
    return arrays.host_region(arrays.address(first), nbytes)


def crc_bytes(v: Any) -> memoryview:
    """Return the bytes of a host view (device arrays are copied to the host)."""
    if not isinstance(v, np.ndarray):
        v = v.get()
    data: Any = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
    return memoryview(data)


class Prepared(NamedTuple):
    """One persistent gradient as the reduce window takes it, built once."""

    array: Any  # the gradient array handed to the caller
    fingerprint: tuple[Any, ...]  # :func:`mpidp.arrays.fingerprint` of ``array`` when it was made
    view: Any  # NumPy or CuPy view of ``array``
    slot: Slot  # the chunk loop's description of ``view``


def flat_order(sizes: Sequence[int], kinds: Sequence[Any], chunk: int) -> list[int]:
    """Every slot, in the order the full reduce plan moves them (empty ones last): the order of :class:`FlatGradients`."""
    order = dict.fromkeys(seg.slot for call in plan(sizes, [True] * len(sizes), chunk, kinds=kinds) for seg in call.segments)
    return [*order, *(i for i in range(len(sizes)) if i not in order)]


class FlatGradients:
    """Persistent gradient arrays, one per reduction slot, views into one flat buffer per dtype.

    Laid out in the order the full reduce plan moves them, so that reducing
    them needs no packing. ``slots[i]`` is the :class:`Prepared` record of
    reduction slot ``i``: a gradient that is that array, unchanged, is
    reduced through the Slot built here once.
    """

    def __init__(self, likes: Sequence[Any], infos: Sequence[arrays.ArrayInfo], sizes: Sequence[int], chunk: int) -> None:
        order = flat_order(sizes, [info.dtype for info in infos], chunk)
        offsets: dict[int, tuple[str, int]] = {}
        totals: dict[str, int] = {}
        first: dict[str, Any] = {}
        for index in order:
            if not sizes[index]:
                continue
            dtype = infos[index].dtype
            offsets[index] = (dtype, totals.get(dtype, 0))
            totals[dtype] = totals.get(dtype, 0) + sizes[index]
            first.setdefault(dtype, likes[index])
        #: dtype -> flat storage
        self.flat = {d: arrays.flat_zeros(first[d], n) for d, n in totals.items()}
        self.arrays: list[Any] = []
        self.slots: dict[int, Prepared] = {}
        for index, info in enumerate(infos):
            if index in offsets:
                dtype, start = offsets[index]
                g = self.flat[dtype][start : start + info.size].reshape(info.shape)
            else:  # an empty array
                g = arrays.zeros_like(likes[index])
            self.arrays.append(g)
            v = arrays.view(g)
            self.slots[index] = Prepared(g, arrays.fingerprint(g), v, slot(v))

    def zero(self) -> None:
        """Set every gradient to zero (one fill per dtype)."""
        for flat in self.flat.values():
            arrays.view(flat)[...] = 0

    def prepared(self, index: int, g: Any) -> Prepared | None:
        """The prepared view and Slot of ``g`` if it is slot ``index``'s array, unchanged."""
        entry = self.slots.get(index)
        return entry if entry is not None and entry.array is g and arrays.fingerprint(g) == entry.fingerprint else None


def flat_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """Copy ``params`` into flat storage: one contiguous buffer per backend, dtype and device.

    Local; no communication. Returns a new mapping with the same names whose
    arrays are views into the flat buffers, holding the same values, in the
    order :meth:`DataParallel.initialize` broadcasts them; a tied array (one
    object under several names) becomes one view under the same names. When
    every rank passes parameters laid out like this, ``initialize``
    broadcasts each buffer as one region, in chunk-sized calls with no
    packing, instead of array by array (the same holds for any caller-made layout of adjacent, contiguous
    arrays). Torch tensors keep their ``requires_grad`` flag. Raises
    TypeError for a value that is not a NumPy, CuPy or PyTorch array.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, got {type(params).__name__}")
    groups: dict[tuple[str, str, str], dict[int, Any]] = {}
    for name in sorted(params, key=str):
        a = params[name]
        info = arrays.describe(a)
        if info is None:
            raise TypeError(f"parameter {name!r}: {type(a).__name__} is not a NumPy, CuPy or PyTorch array")
        groups.setdefault((info.backend, info.dtype, info.device), {}).setdefault(id(a), a)
    moved: dict[int, Any] = {}
    for members in groups.values():
        moved.update(_copy_flat(list(members.values())))
    return {name: moved[id(a)] for name, a in params.items()}


def _copy_flat(members: list[Any]) -> dict[int, Any]:
    """Copy arrays of one backend, dtype and device into one new flat buffer: id of each -> its view."""
    sizes = [arrays.describe(a).size for a in members]  # type: ignore[union-attr]
    flat = arrays.flat_zeros(members[0], sum(sizes))
    out: dict[int, Any] = {}
    start = 0
    for a, n in zip(members, sizes):
        v = flat[start : start + n].reshape(tuple(a.shape))
        arrays.view(v)[...] = arrays.view(a)
        if getattr(a, "requires_grad", False):
            v.requires_grad_(True)
        out[id(a)] = v
        start += n
    return out
