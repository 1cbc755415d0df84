"""What an array is to mpidp: backend, dtype, shape, device and a host/device view.

Supports NumPy arrays, CuPy arrays and PyTorch tensors without importing
torch or cupy: a backend is recognised by the module its type comes from.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "FLOATING", "ArrayInfo", "bfloat16", "describe", "dtype_name", "empty_like", "fingerprint", "flat_zeros", "host_bytes", "synchronize", "to_host", "view",
    "write_device", "zeros_like",
]


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use: ml_dtypes 0.7's import takes about a second of CPU, in every rank.

    Until a process has imported ml_dtypes, none of its arrays is bfloat16, so the checks compare dtype names
    (:func:`dtype_name`).
    """
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def __getattr__(name: str) -> Any:
    """``BFLOAT16``: :func:`bfloat16`, for the callers that name the dtype (PEP 562: resolved on first use)."""
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: dtypes mpidp synchronises; everything else is refused.
FLOATING = ("float32", "float16", "bfloat16")
_INTEGER_KINDS = "biu"


@dataclass(frozen=True)
class ArrayInfo:
    """The backend-neutral description of one array."""

    backend: str  # "numpy", "torch" or "cupy"
    dtype: str  # "float32", "bfloat16", "int64", "bool", ...
    shape: tuple[int, ...]
    device: str  # "cpu" or "cuda:N"

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_integer(self) -> bool:
        return self.dtype == "bool" or self.dtype.startswith(("int", "uint"))


def _backend(x: Any) -> str | None:
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".", 1)[0]
    if module == "torch" and hasattr(x, "data_ptr"):
        return "torch"
    if module == "cupy" and hasattr(x, "data"):
        return "cupy"
    return None


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """A NumPy dtype's name, cached (``dtype.name`` runs Python code in NumPy: 1-5 us, against 0.1-0.2 here)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        # a non-native byte order is named by its code ('>f4'), which no check accepts
        name = _DTYPE_NAMES[dtype] = dtype.name if dtype.isnative else dtype.str
    return name


def describe(x: Any) -> ArrayInfo | None:
    """Return ``x``'s description, or None when ``x`` is not a supported array."""
    backend = _backend(x)
    if backend is None:
        return None
    if backend == "torch":
        dtype = str(x.dtype).removeprefix("torch.")
        device = "cpu" if x.device.type == "cpu" else f"{x.device.type}:{x.device.index or 0}"
        return ArrayInfo("torch", dtype, tuple(x.shape), device)
    dtype = dtype_name(x.dtype)
    if backend == "cupy":
        return ArrayInfo("cupy", dtype, tuple(x.shape), f"cuda:{x.device.id}")
    return ArrayInfo("numpy", dtype, x.shape, "cpu")


def problem(x: Any) -> str | None:
    """Say why mpidp cannot read and write ``x`` in place, or None (local).

    Properties a rank may not share with the others (alignment, strides,
    an ndarray subclass, writability) are either handled alike on every
    rank (:func:`view`, the packing's stage) or named here, so that the
    ranks agree on an error instead of issuing different collectives.
    """
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):
            return "it is a masked array (mpidp would ignore its mask); pass .filled(0) or .data"
        flags = x.flags
        if not flags.writeable:
            return "it is read-only (mpidp writes into it in place)"
        return None if flags.c_contiguous else _overlapping(x.shape, x.strides, x.itemsize)
    backend = _backend(x)
    if backend == "torch":
        if str(x.layout) != "torch.strided":
            return f"it is a {x.layout} tensor; pass a dense one (.to_dense())"
        if x.device.type not in ("cpu", "cuda"):
            return f"it is on {x.device}; mpidp supports cpu and cuda"
        if x.is_neg() or x.is_conj():
            return "it is a lazy negated or conjugated view; call .resolve_neg() first"
        if x.is_contiguous():
            return None
        size = x.element_size()
        return _overlapping(tuple(x.shape), tuple(s * size for s in x.stride()), size)
    if backend == "cupy":
        return None if x.flags.c_contiguous else _overlapping(x.shape, x.strides, x.itemsize)
    return None


def _overlapping(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> str | None:
    """Say that an array's own elements share memory (a stride of 0, ``expand``, ``as_strided``), or None."""
    if internal_overlap(shape, strides, itemsize):
        return (
            f"its elements overlap in memory (shape {tuple(shape)}, strides {tuple(strides)}: a broadcast or "
            "expanded view); each element needs its own memory, pass a copy"
        )
    return None


#: arrays up to this many elements whose strides do not prove them free of self-overlap are checked element by element
_OVERLAP_ENUMERATE = 1 << 20


def internal_overlap(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two elements of a strided array share a byte (pure arithmetic on the layout; reads no memory).

    Strides sorted by size, each at least the extent of the smaller ones,
    prove there is none: that covers every view made by slicing,
    transposing or reshaping. Other layouts are checked element by element
    up to a million elements, and counted as overlapping beyond.
    """
    dims = [(abs(s), n) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for _, n in dims):
        return False
    dims.sort()
    extent = itemsize
    for stride, n in dims:
        if stride < extent:
            break
        extent += stride * (n - 1)
    else:
        return False
    count = 1
    for _, n in dims:
        count *= n
    if count > _OVERLAP_ENUMERATE:
        return True
    offsets = np.zeros(1, dtype=np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < itemsize).any())


def signature(x: Any) -> tuple[Any, ...]:
    """A cheap identity of ``x``'s type, dtype, shape and device, to compare every window."""
    if isinstance(x, np.ndarray):
        return (np.ndarray, x.dtype, x.shape)
    return (type(x), x.dtype, tuple(x.shape), x.device)


def fingerprint(x: Any) -> tuple[Any, ...]:
    """Everything about ``x`` that a gradient check depends on, cheap to compare every window.

    With the object's identity it pins down dtype, shape, layout, memory and
    writability: two equal fingerprints of the same object mean an earlier
    check of it still holds.
    """
    if isinstance(x, np.ndarray):  # a NumPy array's memory only moves with its shape (resize)
        return (x.dtype, x.shape, x.strides, x.flags.writeable)
    backend = _backend(x)
    if backend == "torch":  # a tensor's storage can be swapped under it (.data =, .set_)
        return (x.dtype, x.shape, x.stride(), x.device, x.data_ptr(), x.layout, x.is_neg(), x.is_conj())
    if backend == "cupy":
        return (x.dtype, x.shape, x.strides, x.data.ptr, x.device.id)
    return (type(x), id(x))  # not an array: never equal to an accepted gradient's


def current_device(backend: str) -> str:
    """Return the CUDA device that ``backend`` (torch or cupy) currently allocates on."""
    if backend == "torch":
        torch = sys.modules["torch"]  # a torch array was handed in: torch is imported

        return f"cuda:{torch.cuda.current_device()}"
    import cupy

    return f"cuda:{cupy.cuda.runtime.getDevice()}"


@functools.cache
def device_bfloat16_problem() -> str | None:
    """Say why CuPy cannot cast bfloat16 on the current device as the host does, or None (local).

    CuPy 14 casts ``ml_dtypes.bfloat16`` arrays on the device (CuPy 13 has
    no bfloat16). The probe runs both casts the reduction needs on a few
    values, round-to-nearest-even ties and the largest finite value
    included, and compares them bitwise with ml_dtypes' host casts, which
    are what the results of host arrays are defined by. It runs once per
    process.
    """
    answer: str | None = None
    try:
        import cupy

        wide = np.array([1.5, -2.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38, 2**-130], dtype=np.float32)
        narrow = cupy.asarray(wide.astype(bfloat16()))
        up = cupy.empty(wide.size, dtype=cupy.float32)
        up[...] = narrow  # the upcast into the stage, as the reduction does it
        down = cupy.empty(wide.size, dtype=bfloat16())
        down[...] = cupy.asarray(wide)  # the cast back
        if up.get().tobytes() != wide.astype(bfloat16()).astype(np.float32).tobytes():
            answer = "CuPy's bfloat16 to float32 cast differs from ml_dtypes' on this device"
        elif down.get().tobytes() != wide.astype(bfloat16()).tobytes():
            answer = "CuPy's float32 to bfloat16 cast does not round to nearest even as ml_dtypes does on this device"
    except Exception as e:  # noqa: BLE001 - any failure means: not supported here
        answer = f"{type(e).__name__}: {e}"
    if answer is None:
        return None
    return f"bfloat16 GPU arrays need CuPy 14 or newer with ml_dtypes, whose device casts agree with the host's ({answer})"


def view(x: Any) -> Any:
    """Return a NumPy (host) or CuPy (device) array sharing ``x``'s memory.

    Writes to the view are writes to ``x``. PyTorch tensors are detached
    first; bfloat16 tensors are viewed through their bits; an ndarray
    subclass (``np.matrix``) is viewed as a plain ndarray.
    """
    if isinstance(x, np.ndarray):
        # a subclass (np.matrix keeps 2-D through reshape(-1)) would make this rank cut chunks unlike the others
        return x if type(x) is np.ndarray else x.view(np.ndarray)
    backend = _backend(x)
    if backend == "cupy":
        return x
    if backend == "torch":
        t = x.detach()
        if t.device.type == "cpu":
            if str(t.dtype) == "torch.bfloat16":
                torch = sys.modules["torch"]  # a torch array was handed in: torch is imported

                return t.view(torch.int16).numpy().view(bfloat16())
            return t.numpy()
        import cupy

        if str(t.dtype) == "torch.bfloat16":  # through its bits: CuPy's DLPack import of bfloat16 is newer than its dtype
            torch = sys.modules["torch"]  # a torch array was handed in: torch is imported

            return cupy.from_dlpack(t.view(torch.int16)).view(bfloat16())
        return cupy.from_dlpack(t)
    raise TypeError(f"not an array: {type(x).__name__}")


def empty_like(x: Any) -> Any:
    """Return a new uninitialised array of ``x``'s backend, dtype, shape and device."""
    backend = _backend(x)
    if backend == "torch":
        torch = sys.modules["torch"]  # a torch array was handed in: torch is imported

        return torch.empty_like(x, memory_format=torch.contiguous_format, requires_grad=False)
    if backend == "cupy":
        import cupy

        return cupy.empty_like(x, order="C")
    return np.empty_like(x, order="C")


def zeros_like(x: Any) -> Any:
    """Return a new zero array of ``x``'s backend, dtype, shape and device."""
    out = empty_like(x)
    view(out)[...] = 0
    return out


def flat_zeros(like: Any, count: int) -> Any:
    """Return a new 1-D zero array of ``count`` elements, of ``like``'s backend, dtype and device."""
    backend = _backend(like)
    if backend == "torch":
        torch = sys.modules["torch"]  # a torch array was handed in: torch is imported

        if like.device.type != "cpu":
            return torch.zeros(count, dtype=like.dtype, device=like.device)
        return torch.from_numpy(host_bytes(count * like.element_size())).view(like.dtype)
    if backend == "cupy":
        import cupy

        with like.device:
            return cupy.zeros(count, dtype=like.dtype)
    return np.zeros(count, dtype=like.dtype)


def host_bytes(nbytes: int) -> np.ndarray:
    """Return ``nbytes`` zeroed bytes of host memory from NumPy's allocator, 64-byte aligned.

    NumPy advises the kernel to back large arrays with transparent huge
    pages (unless ``NUMPY_MADVISE_HUGEPAGE=0``); torch's CPU allocator does
    not. Measured at 2 ranks on a VM: MPICH's Allreduce of 29 M float32 took
    9-11 ms from NumPy's memory and 15-17 ms from torch's, so persistent flat
    buffers come from here.
    """
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes]


def xp(v: Any) -> Any:
    """Return the array module (numpy or cupy) of a view."""
    if isinstance(v, np.ndarray):
        return np
    import cupy

    return cupy


_char = ctypes.c_char


def address(v: Any) -> int:
    """Return the address of a view's first element."""
    if isinstance(v, np.ndarray):
        flags = v.flags
        if flags.c_contiguous and flags.writeable and v.dtype.isbuiltin == 1:  # what ctypes can take as a buffer
            return ctypes.addressof(_char.from_buffer(v))  # type: ignore[arg-type]  # 3x cheaper than __array_interface__
        return int(v.__array_interface__["data"][0])
    return int(v.data.ptr)


def host_region(start: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """A host array over ``nbytes`` of memory at address ``start``, owned by whoever owns that memory."""
    raw: Any = (_char * nbytes).from_address(start)
    return np.frombuffer(raw, dtype=dtype)


def to_host(v: Any) -> np.ndarray:
    """A host copy of device view ``v`` (after the current stream's queued work), or host ``v`` itself."""
    return v if isinstance(v, np.ndarray) else v.get()


def write_device(dst: Any, host: np.ndarray) -> None:
    """Copy host ``host`` into device view ``dst`` (same shape and dtype) on the current stream; ``host`` may be reused at once."""
    dst.set(np.ascontiguousarray(host))  # pageable memory: the driver stages it before the call returns


def synchronize(v: Any) -> None:
    """Wait for the current stream of device view ``v``'s device (nothing for a host array)."""
    if not isinstance(v, np.ndarray):
        with v.device:  # that device's current stream, whichever device is current here
            xp(v).cuda.get_current_stream().synchronize()
