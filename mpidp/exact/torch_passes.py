"""The exact reduction's passes on torch tensors over the same memory, for processes that imported torch.

:mod:`mpidp.exact` gives its passes to this room only where the process
has imported torch itself (mpidp never imports it) and numba is not
installed, as with the README's ``pip install "mpidp[mpich,torch]"``:
torch's vectorized loops then replace NumPy's, which take several passes
over the whole array and a temporary each. The arrays stay NumPy's
(:func:`torch.from_numpy`: no copy); a pass with several operations runs
block by block, so that a block's scratch stays in a core's cache between
them. The same five passes as :mod:`mpidp.exact.compiled`, with the same
arguments.

The bits are those of the compiled passes and of NumPy's forms
(:mod:`mpidp.exact.numpy_passes`), element by element, whatever torch's thread
count: every operation is elementwise, or a maximum, and exact or
correctly rounded once as theirs:

- ``maxabs``: torch's minimum and maximum in one pass; the largest
  magnitude is the larger of their magnitudes (a comparison of finite
  values is exact, subnormals included); where one is not finite, the
  integer maximum of the bits with the sign cleared, as theirs;
- ``pack``: a float32 product by the power of two (exact for every product
  of 2**-126 or more; below it the float64 product and this one both round
  to zero), rounded half to even, converted to int64 (exact: integral,
  below 2**36); a shift by ``k`` is a product by ``2**k`` (two's
  complement, no overflow within the agreed span);
- ``pack_float``: the same integers as float64 values, rounded by adding and
  subtracting 1.5 * 2**52 (round half to even, +0.0 for zero);
- ``pack32``: ``pack``'s rounded product times the step, plus 0.0 (a
  zero is +0.0), kept as float32 (a fold's integers have at most 24
  significant bits and lie below 2**53 at the agreed quantum: exact);
- ``combine``: the rows converted to float64 and added (integers of one
  quantum below 2**53: exact in any order; no -0.0 is sent), then
  ``unpack``'s quotient;
- ``unpack`` and ``unpack_float``: float64 values (``int64`` converted
  with rounding to nearest, as NumPy's ``astype``) divided by ``weight /
  scale`` and rounded once to float32: ``scale`` is a power of two and the
  quotients are normal float64 values, so this is bitwise ``values * scale
  / weight`` (torch divides in float64 and casts the result to the float32
  output, as NumPy's ``astype`` does).
"""

from __future__ import annotations

import sys

import numpy as np

torch = sys.modules["torch"]  # reached only where the process has imported torch: mpidp never imports it here

__all__ = ["BLOCK", "BLOCK32", "combine", "maxabs", "pack", "pack32", "pack_float", "unpack", "unpack_float"]

#: values per block: 512 KiB of float64 or int64 scratch (a core's L2 cache holds it and the block it writes)
BLOCK = 1 << 16
#: values per block of :func:`pack32` and :func:`combine`: fewer operations (each costs microseconds to dispatch),
#: while a block and its float64 scratch stay in a core's L2 cache
BLOCK32 = 1 << 17
#: adding and subtracting it rounds a float64 of magnitude below 2**51 to an integer, half to even
_ROUND = 1.5 * 2.0**52
_FINITE = 0x7F800000


def maxabs(bits: np.ndarray) -> tuple[int, bool]:
    """The bits of the largest finite magnitude of float32 values given as bits, and whether some value is not finite."""
    if bits.size == 0:
        return 0, False
    low, high = (float(v) for v in torch.aminmax(torch.from_numpy(bits.view(np.float32))))
    top = np.float32(max(abs(low), abs(high))).view(np.uint32)
    if top < _FINITE:  # inf and NaN compare above (NaN propagates): all finite
        return int(top), False
    magnitudes = torch.bitwise_and(torch.from_numpy(bits.view(np.int32)), 0x7FFFFFFF)
    finite = magnitudes[magnitudes < _FINITE]
    return (int(finite.max()) if finite.numel() else 0), True


def _factors(scale: float) -> tuple[float, ...]:
    """``scale`` (a power of two) as float32 factors applied in turn, each product exact: above 2**127, two."""
    return (scale,) if scale <= 2.0**127 else (2.0**100, scale / 2.0**100)


def pack(x: np.ndarray, scale: float, t: int, acc: np.ndarray, s: int, out: np.ndarray) -> None:
    """``out = (acc << s) + (rint(x * scale) << t)``; ``acc`` may be empty (zeros) and may be ``out``; ``x`` may be empty."""
    o = torch.from_numpy(out)
    a = torch.from_numpy(acc) if acc.size else None
    if not x.size:
        if a is None:
            o.zero_()
        else:
            torch.mul(a, 1 << s, out=o)
        return
    xs, n = torch.from_numpy(x), out.size
    floats = torch.empty(min(BLOCK, n), dtype=torch.float32)
    ints = torch.empty(min(BLOCK, n), dtype=torch.int64) if a is not None else None
    factors = _factors(scale)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        f, ob = floats[: hi - lo], o[lo:hi]
        torch.mul(xs[lo:hi], factors[0], out=f)
        for factor in factors[1:]:
            f.mul_(factor)
        f.round_()  # half to even
        if ints is None:
            ob.copy_(f)
            if t:
                ob.mul_(1 << t)
            continue
        k = ints[: hi - lo]
        k.copy_(f)
        ab = a[lo:hi]  # type: ignore[index]
        if s:
            torch.mul(ab, 1 << s, out=ob)
            ob.add_(k, alpha=1 << t)
        else:
            torch.add(ab, k, alpha=1 << t, out=ob)


def pack_float(x: np.ndarray, scale: float, step: float, acc: np.ndarray, shift: float, out: np.ndarray) -> None:
    """``out = float64(acc) * shift + (rint(x * scale) + 0.0) * step`` (float64, exact within 2**53); as :func:`pack`."""
    o = torch.from_numpy(out)
    a = torch.from_numpy(acc) if acc.size else None
    n = out.size
    ints = torch.empty(min(BLOCK, n), dtype=torch.float64) if a is not None and x.size else None
    xs = torch.from_numpy(x) if x.size else None
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        ob = o[lo:hi]
        k = ob if ints is None else ints[: hi - lo]
        if xs is not None:
            k.copy_(xs[lo:hi])
            k.mul_(scale)
            k.add_(_ROUND)
            k.sub_(_ROUND)
            if step != 1.0:
                k.mul_(step)
        if a is None:
            if xs is None:
                ob.zero_()
            continue
        if ints is None:  # the folds alone
            ob.copy_(a[lo:hi])
            ob.mul_(shift)
        else:
            ob.copy_(a[lo:hi])
            if shift != 1.0:
                ob.mul_(shift)
            ob.add_(k)


def unpack(ints: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:
    """``out = float32(float64(ints) * scale / weight)`` (``scale`` a power of two: exact)."""
    n = ints.size
    i, o = torch.from_numpy(ints), torch.from_numpy(out)
    doubles = torch.empty(min(BLOCK, n), dtype=torch.float64)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        d = doubles[: hi - lo]
        d.copy_(i[lo:hi])
        o[lo:hi].copy_(d.div_(weight / scale))


def unpack_float(values: np.ndarray, scale: float, weight: float, out: np.ndarray) -> None:
    """``out = float32(values * scale / weight)`` of float64 ``values`` (``scale`` a power of two: exact)."""
    n = values.size
    v, o = torch.from_numpy(values), torch.from_numpy(out)
    doubles = torch.empty(min(BLOCK, n), dtype=torch.float64)  # a float32 ``out=`` of a float64 quotient: a whole-size temporary
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        o[lo:hi].copy_(torch.div(v[lo:hi], weight / scale, out=doubles[: hi - lo]))


def pack32(x: np.ndarray, scale: float, step: float, out: np.ndarray) -> None:
    """``out = float32(rint(x * scale) * step + 0.0)``: one fold's integers at the agreed quantum (exact as float32)."""
    xs, o = torch.from_numpy(x), torch.from_numpy(out)
    factors = _factors(scale)
    for lo in range(0, x.size, BLOCK32):
        ob = o[lo : lo + BLOCK32]
        torch.mul(xs[lo : lo + BLOCK32], factors[0], out=ob)
        for factor in factors[1:]:
            ob.mul_(factor)
        ob.round_()  # half to even
        if step != 1.0:
            ob.mul_(step)
        ob.add_(0.0)  # -0.0 becomes +0.0


def combine(parts: np.ndarray, rows: tuple[int, ...], divisor: float, out: np.ndarray) -> None:
    """``out = float32((0.0 + sum of float64(parts[j]) for j in rows) / divisor)``; ``parts``: rows of contiguous float32.

    Every operation has one dtype or is a copy that converts: torch makes
    a temporary for an operation that mixes dtypes (``add_`` of float32
    into float64, a float64 quotient into float32), and that costs more
    than the operation. The sum starts from the first row: :func:`pack32`
    sends no -0.0.
    """
    p, o, n = torch.from_numpy(parts), torch.from_numpy(out), out.size
    if not rows:
        o.zero_()
        return
    m = min(BLOCK32, n)
    doubles, term = torch.empty(m, dtype=torch.float64), torch.empty(m if len(rows) > 1 else 0, dtype=torch.float64)
    for lo in range(0, n, BLOCK32):
        hi = min(n, lo + BLOCK32)
        d = doubles[: hi - lo]
        d.copy_(p[rows[0], lo:hi])
        for j in rows[1:]:
            t = term[: hi - lo]
            t.copy_(p[j, lo:hi])
            d.add_(t)
        d.div_(divisor)  # in float64, rounded once
        o[lo:hi].copy_(d)  # and once to float32
