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

__all__ = ["maxabs", "pack", "pack_float", "unpack", "unpack_float"]


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
