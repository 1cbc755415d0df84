"""Compiled passes of the exact reduction (numba; optional, ``pip install mpidp[numba]``): one pass each.

Imported by :mod:`mpidp.exact` on first use, when numba is installed; the
NumPy forms there give the same bits (the same IEEE operations: a product
by a power of two, round half to even, a shift, an int64 sum; a float64
product and quotient, rounded once to float32). Arrays are contiguous and
one-dimensional.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["combine", "maxabs", "pack", "pack32", "pack_float", "unpack", "unpack_float"]


def _compiled(signature: str) -> Any:
    """Compile for ``signature`` now (cached on disk), releasing the GIL while it runs."""
    return njit(signature, nogil=True, cache=True, boundscheck=False, error_model="numpy")


@_compiled("Tuple((uint32, boolean))(uint32[::1])")
def maxabs(bits: np.ndarray) -> tuple[int, bool]:  # pragma: no cover - compiled
    """The bits of the largest finite magnitude of float32 values given as bits, and whether some value is not finite.

    A magnitude's bits order as its value, and inf and NaN above every
    finite one: one pass of an integer max (vectorized), a second only
    where a value is not finite.
    """
    top = np.uint32(0)
    for i in range(bits.size):
        v = bits[i] & np.uint32(0x7FFFFFFF)
        top = max(top, v)
    if top < np.uint32(0x7F800000):
        return top, False
    top = np.uint32(0)
    for i in range(bits.size):
        v = bits[i] & np.uint32(0x7FFFFFFF)
        top = v if v > top and v < np.uint32(0x7F800000) else top
    return top, True


@_compiled("void(float32[::1], float64, int64, int64[::1], int64, int64[::1])")
def pack(x: np.ndarray, scale: float, t: int, acc: np.ndarray, s: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = (acc << s) + (rint(x * scale) << t)``; ``acc`` may be empty (zeros) and may be ``out``; ``x`` may be empty."""
    n = out.size
    if acc.size and x.size:
        for i in range(n):
            out[i] = (acc[i] << s) + (np.int64(np.rint(np.float64(x[i]) * scale)) << t)
    elif x.size:
        for i in range(n):
            out[i] = np.int64(np.rint(np.float64(x[i]) * scale)) << t
    elif acc.size:
        for i in range(n):
            out[i] = acc[i] << s
    else:
        for i in range(n):
            out[i] = 0


@_compiled("void(float32[::1], float64, float64, int64[::1], float64, float64[::1])")
def pack_float(x: np.ndarray, scale: float, step: float, acc: np.ndarray, shift: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = float64(acc) * shift + (rint(x * scale) + 0.0) * step``: :func:`pack`'s integers as float64 (exact within 2**53).

    ``+ 0.0`` makes a zero +0.0 (``rint(-0.3)`` is -0.0), as the integer's
    conversion would: a sum of float64 integers then has the integer sum's bits.
    """
    n = out.size
    if acc.size and x.size:
        for i in range(n):
            out[i] = np.float64(acc[i]) * shift + (np.rint(np.float64(x[i]) * scale) + 0.0) * step
    elif x.size:
        for i in range(n):
            out[i] = (np.rint(np.float64(x[i]) * scale) + 0.0) * step
    elif acc.size:
        for i in range(n):
            out[i] = np.float64(acc[i]) * shift
    else:
        for i in range(n):
            out[i] = 0.0


@_compiled("void(float64[::1], float64, float64, float32[::1])")
def unpack_float(values: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = float32(values * scale / weight)`` of float64 ``values`` (integers; ``scale`` a power of two: exact)."""
    for i in range(values.size):
        out[i] = np.float32(values[i] * scale / weight)


@_compiled("void(int64[::1], float64, float64, float32[::1])")
def unpack(ints: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = float32(float64(ints) * scale / weight)`` (``scale`` a power of two: exact)."""
    for i in range(ints.size):
        out[i] = np.float32(np.float64(ints[i]) * scale / weight)


@_compiled("void(float32[::1], float64, float64, float32[::1])")
def pack32(x: np.ndarray, scale: float, step: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = float32(rint(x * scale) * step + 0.0)``: one fold's integers at the agreed quantum (24 significant bits,
    below 2**53: exact as float32; a zero is +0.0, so that a sum of zeros is +0.0 as an integer's conversion)."""
    for i in range(x.size):
        out[i] = np.float32(np.rint(np.float64(x[i]) * scale) * step + 0.0)


#: values per block of :func:`combine`'s float64 sums past two rows (32 KiB: a core's L1 cache)
_SUMS = 4096


@_compiled("void(float32[::1], int64, int64[::1], float64, float32[::1])")
def _combine(flat: np.ndarray, stride: int, rows: np.ndarray, divisor: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    n = out.size
    a = flat[rows[0] * stride : rows[0] * stride + n]
    if rows.size == 1:
        for i in range(n):
            out[i] = np.float32((0.0 + np.float64(a[i])) / divisor)
        return
    if rows.size == 2:  # one loop, vectorized: 2 ranks, the common case
        b = flat[rows[1] * stride : rows[1] * stride + n]
        for i in range(n):
            out[i] = np.float32((0.0 + np.float64(a[i]) + np.float64(b[i])) / divisor)
        return
    sums = np.empty(min(n, _SUMS), np.float64)
    for lo in range(0, n, _SUMS):
        m = min(_SUMS, n - lo)
        s = sums[:m]
        first = a[lo : lo + m]
        for i in range(m):
            s[i] = 0.0 + np.float64(first[i])
        for k in range(1, rows.size):
            row = flat[rows[k] * stride + lo : rows[k] * stride + lo + m]
            for i in range(m):
                s[i] += np.float64(row[i])
        o = out[lo : lo + m]
        for i in range(m):
            o[i] = np.float32(s[i] / divisor)


def combine(parts: np.ndarray, rows: tuple[int, ...], divisor: float, out: np.ndarray) -> None:
    """``out = float32((0.0 + sum of float64(parts[j]) for j in rows) / divisor)``; ``parts``: rows of contiguous float32.

    One loop for one or two rows, else block by block, each a loop the
    compiler vectorizes: a float64 sum per row, then the quotient. The terms are integers of one quantum and every
    partial sum is exact (below 2**53), so the order does not matter; the
    sum starts at +0.0, so a zero sum is +0.0, as an integer's conversion.
    """
    if parts.shape[1] == 0:
        return
    if not rows:
        out[...] = 0
        return
    stride = parts.strides[0] // 4 if parts.shape[0] > 1 else parts.shape[1]
    flat = np.lib.stride_tricks.as_strided(parts, shape=((parts.shape[0] - 1) * stride + parts.shape[1],), strides=(4,))
    _combine(flat, stride, np.asarray(rows, np.int64), divisor, out)
