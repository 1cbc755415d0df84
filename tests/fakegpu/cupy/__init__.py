"""A CPU stand-in for the part of CuPy that mpidp uses, to run its GPU code paths without a GPU.

Put ``tests/fakegpu`` first on ``PYTHONPATH`` and ``import cupy`` gets this
module (``scripts/test`` runs ``tests/test_cuda.py`` that way). It is not a
GPU emulator; it is a strict model of the rules that GPU code gets wrong:

* **Device memory is not host memory to Python.** A device array has no
  buffer protocol and refuses ``numpy.asarray`` (as CuPy does); only MPI,
  through ``__cuda_array_interface__``, and explicit copies (``get``,
  ``set``, ``asnumpy``) reach its bytes. So mpi4py takes its device-buffer
  path, and the MPI library (which here reads the pointer as host memory)
  stands in for a CUDA-aware one.
* **Kernels run late.** Every operation on device arrays (fills, copies,
  casts, arithmetic, ``get`` / ``set`` with ``blocking=False`` or a pinned
  source) is queued on the current stream and runs only when something
  waits for it: ``Stream.synchronize``, ``Event.synchronize``, a blocking
  copy to the host, or a stream that waits on an event of another stream.
  This is a schedule a real GPU may choose, and the one where a missing
  synchronisation shows: MPI reading device memory before the stream that
  writes it was synchronised sees the old bytes, and so does a host buffer
  reused before the copy out of it has run.
* **Streams do not order each other implicitly** (as streams created with
  ``non_blocking=True``): only events do. Code that is correct here is
  correct with CuPy's blocking streams too, which only add ordering.
  ``MPIDP_FAKE_SCHEDULE=random:SEED`` also lets queued work run early: each
  time work is queued, the first queued operation of a random stream runs
  with probability 1/2 (what it waits for first), another legal schedule,
  the one where work that should have waited for an event and did not
  shows.
* **Devices are checked** (``MPIDP_FAKE_GPUS`` of them, default 2): a kernel
  on an array of another device than the current one raises, as CuPy does
  without peer access; so do a copy on a stream of another device and an
  event recorded on one. Each device has its own current stream.

``cupy._mpidp_fake`` is True, so that tests can tell.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from . import cuda
from .cuda import MemoryPointer

_mpidp_fake = True
__version__ = "0+fake"

float16 = np.float16
float32 = np.float32
float64 = np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
bool_ = np.bool_
dtype = np.dtype


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = False

    def __getitem__(self, key: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[key]


def _host_at(ptr: int, shape: tuple[int, ...], dt: np.dtype, strides: tuple[int, ...] | None, keep: Any) -> np.ndarray:
    """A NumPy array over ``ptr`` that keeps ``keep`` (the memory) alive: queued kernels hold only these."""
    dt = np.dtype(dt)
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, dtype=dt).strides) if all(shape) else (dt.itemsize,) * len(shape)
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return np.empty(shape, dtype=dt)
    if any(s < 0 for s in strides):
        raise NotImplementedError("the fake CuPy does not build negative-stride arrays from pointers")
    span = sum((d - 1) * s for d, s in zip(shape, strides)) + dt.itemsize
    memory = (ctypes.c_char * span).from_address(ptr)
    memory._keep = keep  # type: ignore[attr-defined]
    raw = np.frombuffer(memory, dtype=np.uint8)
    return np.ndarray(shape, dtype=dt, buffer=raw, offset=0, strides=strides)


def _value(v: Any) -> Any:
    """The host stand-in of an operand, as a kernel reads it when it runs."""
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, np.ndarray):
        # CuPy refuses host arrays as kernel operands
        raise TypeError(f"Unsupported type {type(v)}")
    return v


class ndarray:
    """A device array: metadata now, data only through queued kernels, copies and MPI."""

    __array_priority__ = 100  # NumPy's binary operators defer to us (and then raise below)

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None, strides: Any = None, order: str = "C") -> None:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        if order != "C":
            raise NotImplementedError("the fake CuPy makes C-order arrays only")
        if memptr is None:
            nbytes = int(np.prod(shape)) * dt.itemsize if shape else dt.itemsize
            memptr = MemoryPointer(cuda.Memory(nbytes), 0)
        self.data = memptr
        self._a = _host_at(memptr.ptr, shape, dt, None if strides is None else tuple(strides), memptr)

    @classmethod
    def _over(cls, base: ndarray, a: np.ndarray) -> ndarray:
        """A view of ``base``'s memory described by NumPy view ``a``."""
        out = cls.__new__(cls)
        offset = (a.__array_interface__["data"][0] - base._a.__array_interface__["data"][0]) if a.size else 0
        out.data = MemoryPointer(base.data.mem, base.data.ptr - base.data.mem.ptr + offset)
        out._a = a
        return out

    # ----------------------------------------------------------- metadata
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: int(self._a.size))
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: int(self._a.nbytes))
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    device = property(lambda self: cuda.Device(self.data.device_id))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self._a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "descr": a.dtype.descr,
            "data": (self.data.ptr if a.size else 0, False),
            "version": 3,
            "strides": None if a.flags.c_contiguous else a.strides,
            "stream": cuda.get_current_stream().ptr or 1,  # the legacy default stream is 1 in version 3
        }

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly.")

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"<fake cupy.ndarray shape={self.shape} dtype={self.dtype} device={self.data.device_id}>"

    # ----------------------------------------------------------- views
    def __getitem__(self, key: Any) -> ndarray:
        keys = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, (slice, int, np.integer, type(Ellipsis), type(None))) for k in keys):
            raise NotImplementedError("the fake CuPy supports basic indexing only")
        return ndarray._over(self, self._a[key])

    def view(self, dtype: Any) -> ndarray:
        return ndarray._over(self, self._a.view(dtype))

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        v = self._a.view()
        try:
            v.shape = shape
        except AttributeError:  # needs a copy, as in CuPy
            return self.copy().reshape(*shape)
        return ndarray._over(self, v)

    def ravel(self) -> ndarray:
        return self.reshape(-1)

    @property
    def T(self) -> ndarray:
        return ndarray._over(self, self._a.T)

    # ----------------------------------------------------------- kernels
    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]._a
        if isinstance(value, np.ndarray):
            if value.ndim:  # CuPy fills with scalars only: a host array is not copied in this way
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        source = value
        cuda._kernel(lambda: target.__setitem__(Ellipsis, _value(source)), self, source)

    def copy(self, order: str = "C") -> ndarray:
        out = empty(self.shape, self.dtype)
        src = self._a
        cuda._kernel(lambda: out._a.__setitem__(Ellipsis, src), self)
        return out

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        out = empty(self.shape, dtype)
        src = self._a
        cuda._kernel(lambda: out._a.__setitem__(Ellipsis, src), self)
        return out

    def fill(self, value: Any) -> None:
        self[...] = value

    def sum(self, axis: Any = None, dtype: Any = None) -> ndarray:
        return _reduction(np.sum, self, axis, dtype)

    def max(self, axis: Any = None) -> ndarray:
        return _reduction(np.max, self, axis, None)

    def min(self, axis: Any = None) -> ndarray:
        return _reduction(np.min, self, axis, None)

    def any(self) -> ndarray:
        return _reduction(np.any, self, None, None)

    def all(self) -> ndarray:
        return _reduction(np.all, self, None, None)

    def _binary(self, op: Callable[..., Any], other: Any, reflected: bool = False) -> ndarray:
        a, b = (other, self) if reflected else (self, other)
        return _ufunc(op, a, b)

    __add__ = lambda self, o: self._binary(np.add, o)
    __radd__ = lambda self, o: self._binary(np.add, o, True)
    __sub__ = lambda self, o: self._binary(np.subtract, o)
    __rsub__ = lambda self, o: self._binary(np.subtract, o, True)
    __mul__ = lambda self, o: self._binary(np.multiply, o)
    __rmul__ = lambda self, o: self._binary(np.multiply, o, True)
    __truediv__ = lambda self, o: self._binary(np.divide, o)
    __rtruediv__ = lambda self, o: self._binary(np.divide, o, True)
    __eq__ = lambda self, o: self._binary(np.equal, o)  # type: ignore[assignment]
    __ne__ = lambda self, o: self._binary(np.not_equal, o)  # type: ignore[assignment]
    __neg__ = lambda self: _ufunc(np.negative, self)
    __abs__ = lambda self: _ufunc(np.absolute, self)
    __hash__ = None  # type: ignore[assignment]

    def __iadd__(self, other: Any) -> ndarray:  # noqa: PYI034 - Self needs Python 3.11
        add(self, other, out=self)
        return self

    def __imul__(self, other: Any) -> ndarray:  # noqa: PYI034 - Self needs Python 3.11
        multiply(self, other, out=self)
        return self

    def __itruediv__(self, other: Any) -> ndarray:  # noqa: PYI034 - Self needs Python 3.11
        divide(self, other, out=self)
        return self

    # ----------------------------------------------------------- copies to and from the host
    def get(self, stream: cuda.Stream | None = None, order: str = "C", out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        """Copy to the host on ``stream`` (default: current); wait for it unless ``blocking=False``."""
        stream = cuda._copy_stream(stream, self)
        if out is None:
            out = np.empty(self.shape, self.dtype)
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if self.dtype != out.dtype:
                raise TypeError(f"{self.dtype} array cannot be obtained from {out.dtype} array")
            if self.shape != out.shape:
                raise ValueError(f"Shape mismatch. Old shape: {out.shape}, new shape: {self.shape}")
            if not out.flags.c_contiguous:
                raise RuntimeError("Non-contiguous output is not supported yet")
            if not blocking and not cuda._is_pinned(out):
                blocking = True  # a copy into pageable memory is synchronous
        src, dst = self._a, out
        stream._enqueue(lambda: dst.__setitem__(Ellipsis, src))
        if blocking:
            stream.synchronize()
        return out

    def set(self, arr: np.ndarray, stream: cuda.Stream | None = None) -> None:
        """Copy host ``arr`` in on ``stream`` (default: current); a pinned ``arr`` is read when the copy runs."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        stream = cuda._copy_stream(stream, self)
        src = arr if cuda._is_pinned(arr) else np.array(arr, copy=True)  # pageable: staged by the driver at once
        dst = self._a
        stream._enqueue(lambda: dst.__setitem__(Ellipsis, src))

    # ----------------------------------------------------------- host reads (wait for the current stream)
    def _scalar(self) -> Any:
        if self.size != 1:
            raise ValueError("only one-element arrays can be converted to Python scalars")
        return self.get().reshape(()).item()

    __float__ = lambda self: float(self._scalar())
    __int__ = lambda self: int(self._scalar())
    __bool__ = lambda self: bool(self._scalar())
    item = _scalar

    def tolist(self) -> Any:
        return self.get().tolist()


def _ufunc(op: Callable[..., Any], *args: Any, out: ndarray | None = None, dtype: Any = None) -> ndarray:
    for a in args:
        if isinstance(a, np.ndarray):
            raise TypeError(f"Unsupported type {type(a)}")
    devs = [a for a in args if isinstance(a, ndarray)]
    if out is None:
        probe = op(*[np.empty((0,) * a.ndim, a.dtype) if isinstance(a, ndarray) else a for a in args])
        shape = np.broadcast_shapes(*[a.shape for a in devs])
        out = empty(shape, dtype or probe.dtype)
    elif not isinstance(out, ndarray):
        raise TypeError("out must be a cupy.ndarray")
    target = out._a
    kwargs = {} if dtype is None else {"dtype": dtype}
    cuda._kernel(lambda: op(*[_value(a) for a in args], out=target, casting="unsafe", **kwargs), out, *args)
    return out


def _reduction(op: Callable[..., Any], a: ndarray, axis: Any, dt: Any) -> ndarray:
    probe = np.asarray(op(np.zeros((1,) * a.ndim, a.dtype), axis=axis, **({"dtype": dt} if dt else {})))
    shape = np.asarray(op(np.zeros(a.shape, a.dtype), axis=axis, **({"dtype": dt} if dt else {}))).shape if a.size else probe.shape
    out = empty(shape, probe.dtype)
    src = a._a
    cuda._kernel(lambda: out._a.__setitem__(Ellipsis, op(src, axis=axis, **({"dtype": dt} if dt else {}))), a)
    return out


add = lambda *a, **k: _ufunc(np.add, *a, **k)
subtract = lambda *a, **k: _ufunc(np.subtract, *a, **k)
multiply = lambda *a, **k: _ufunc(np.multiply, *a, **k)
divide = true_divide = lambda *a, **k: _ufunc(np.divide, *a, **k)
negative = lambda *a, **k: _ufunc(np.negative, *a, **k)
abs = absolute = lambda *a, **k: _ufunc(np.absolute, *a, **k)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = empty(shape, dtype, order)
    out[...] = 0
    return out


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    out = empty(shape, dtype, order)
    out[...] = 1
    return out


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    out = empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype, order)
    out[...] = fill_value
    return out


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return asarray(np.arange(*args, dtype=dtype))


def empty_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    """On the current device, as CuPy's (not the prototype's)."""
    if order not in ("C", "K", "A"):
        raise NotImplementedError("the fake CuPy makes C-order arrays only")
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    out = empty_like(a, dtype, order, shape)
    out[...] = 0
    return out


def ones_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    out = empty_like(a, dtype, order, shape)
    out[...] = 1
    return out


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return a.astype(dtype or a.dtype)


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.ascontiguousarray(np.asarray(a, dtype=dtype))
    out = empty(host.shape, host.dtype)
    out.set(host)
    return out


array = asarray


def asnumpy(a: Any, stream: cuda.Stream | None = None, order: str = "C", out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a)


def from_dlpack(x: Any) -> ndarray:
    raise NotImplementedError("the fake CuPy has no DLPack (no CUDA tensors to import)")


def get_array_module(*args: Any) -> Any:
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np

