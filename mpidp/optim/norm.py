"""The global gradient norm as an exact sum of squares, and clip_grad_norm_'s coefficient (pure).

A float32 value ``x`` is ``M * 2**E`` with an integer ``|M| < 2**24``, so
``x * x`` is the integer ``M * M < 2**48`` times ``2**(2 E)``. Each square
is split into three 16-bit parts, and the parts are summed per exponent
``E`` and part (:func:`squares`: sums of integers below ``2**53``, exact
in float64 up to ``2**37`` values per rank). The bins of every rank are
summed as int64 (exact), then :func:`total` adds them as one Python integer
and converts it once, correctly rounded, to float64: the sum of squares,
whatever the world size, the cut or the order. One square root follows.
inf and NaN are counted apart: the norm is NaN where any value is NaN, else
inf where any is infinite, as ``torch.nn.utils.clip_grad_norm_`` finds it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["WORDS", "clip_coefficient", "norm", "squares"]

#: the exponents ``E`` of float32 values: ``2**-149`` is ``2**23 * 2**-172``; the largest is below ``2**24 * 2**104``
E_MIN, E_MAX = -172, 104
BINS = E_MAX - E_MIN + 1
PARTS = 3
#: int64 words of one rank's sums: the bins, then the counts of NaN and of infinite values
WORDS = BINS * PARTS + 2


def squares(x: np.ndarray, out: np.ndarray) -> None:
    """Add the squares of float32 ``x`` (1-D, host) into ``out`` (int64, :data:`WORDS`): exact, in any order."""
    finite = np.isfinite(x)
    if not finite.all():
        out[-2] += int(np.isnan(x).sum())
        out[-1] += int(np.isinf(x).sum())
        x = x[finite]
    if not x.size:
        return
    m, e = np.frexp(x)
    big = (m * np.float32(1 << 24)).astype(np.int64)
    big *= big
    where = e.astype(np.intp) - (24 + E_MIN)
    bins = out[: BINS * PARTS].reshape(BINS, PARTS)
    for k in range(PARTS):
        part = (big >> (16 * k)) & 0xFFFF
        bins[:, k] += np.bincount(where, weights=part, minlength=BINS).astype(np.int64)


def total(words: np.ndarray) -> float:
    """The sum of squares the summed ``words`` hold, correctly rounded to float64 (NaN and inf as counted)."""
    if words[-2]:
        return math.nan
    if words[-1]:
        return math.inf
    acc = 0
    bins = words[: BINS * PARTS].reshape(BINS, PARTS)
    for b, k in zip(*np.nonzero(bins)):
        acc += int(bins[b, k]) << (16 * int(k) + 2 * int(b))
    return acc / (1 << (-2 * E_MIN))  # int / int: correctly rounded


def norm(words: np.ndarray) -> np.float32:
    """The global 2-norm as float32 (as clip_grad_norm_ returns it for float32 gradients): one square root of :func:`total`."""
    with np.errstate(over="ignore"):
        return np.float32(math.sqrt(total(words)))


def clip_coefficient(max_norm: float, total_norm: np.float32) -> np.float32:
    """``clamp(max_norm / (total_norm + 1e-6), max=1)`` in float32, NaN kept: what every gradient is multiplied by."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        coef = np.float32(max_norm) / (total_norm + np.float32(1e-6))
    return np.float32(np.minimum(coef, np.float32(1.0)))
