"""The passes of :mod:`mpidp.exact.compiled` in NumPy: the same bits, more passes and temporaries (the last resort).

:mod:`mpidp.exact` runs them where numba is not installed and the process
has not imported torch (``initialize`` then warns once), and the tests
take them as the reference every other route must match byte for byte.
"""

from __future__ import annotations

import numpy as np

__all__ = ["combine", "maxabs", "pack", "pack32", "pack_float", "unpack", "unpack_float"]


def maxabs(bits: np.ndarray) -> tuple[int, bool]:
    """The bits of the largest finite magnitude of float32 values given as bits, and whether some value is not finite."""
    if bits.size == 0:
        return 0, False
    magnitudes = bits & np.uint32(0x7FFFFFFF)
    top = int(magnitudes.max())
    if top < 0x7F800000:
        return top, False
    finite = magnitudes[magnitudes < 0x7F800000]
    return (int(finite.max()) if finite.size else 0), True


def pack(x: np.ndarray, scale: float, t: int, acc: np.ndarray, s: int, out: np.ndarray) -> None:
    """``out = (acc << s) + (rint(x * scale) << t)``; ``acc`` may be empty (zeros) and may be ``out``; ``x`` may be empty."""
    ints = np.rint(x.astype(np.float64) * scale).astype(np.int64) << t if x.size else 0
    base = acc << s if acc.size else 0
    out[...] = base + ints


def pack_float(x: np.ndarray, scale: float, step: float, acc: np.ndarray, shift: float, out: np.ndarray) -> None:
    """``out = float64(acc) * shift + (rint(x * scale) + 0.0) * step``: :func:`pack`'s integers as float64."""
    ints = (np.rint(x.astype(np.float64) * scale) + 0.0) * step if x.size else 0.0  # + 0.0: zeros are +0.0
    base = acc.astype(np.float64) * shift if acc.size else 0.0
    out[...] = base + ints


def pack32(x: np.ndarray, scale: float, step: float, out: np.ndarray) -> None:
    """``out = float32(rint(x * scale) * step + 0.0)``: one fold's integers at the agreed quantum, exact as float32."""
    out[...] = np.rint(x.astype(np.float64) * scale) * step + 0.0  # 24 significant bits, below 2**53: exact as float32


def combine(parts: np.ndarray, rows: tuple[int, ...], divisor: float, out: np.ndarray) -> None:
    """``out = float32((0.0 + sum of float64(parts[j]) for j in rows) / divisor)``."""
    total = np.zeros(out.size)  # +0.0 first: a zero sum is +0.0, as an integer's conversion
    for j in rows:
        total += parts[j]
    out[...] = (total / divisor).astype(np.float32)


def unpack(ints: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:
    """``out = float32(float64(ints) * scale / weight)`` (``scale`` a power of two: exact)."""
    out[...] = (ints.astype(np.float64) * scale / weight).astype(np.float32)


def unpack_float(values: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:
    """``out = float32(values * scale / weight)`` of float64 ``values``."""
    out[...] = (values * scale / weight).astype(np.float32)
