"""16-bit casts of host values, and the one division by the global weight.

A reduction sums in float32: each float16 or bfloat16 segment is upcast
into the float32 stage, summed, divided by the global weight and cast back.
There are four ways to cast a segment, and a :class:`Casts` strategy, chosen
once per session (``MPIDP_CASTS``, read by ``initialize``), gives each
segment to the first that takes it:

1. torch's vectorized casts, when the process has imported torch (mpidp
   never imports it) and the segment has at least :data:`MIN_FAST` values;
2. the compiled kernels of :mod:`mpidp.kernels` (numba, ``pip install
   mpidp[numba]``), same threshold, contiguous aligned native 1-D arrays;
3. NumPy bit arithmetic on the float32 bits, for segments of at least
   :data:`MIN_BITS` values;
4. NumPy's / ml_dtypes' own cast (``astype``).

All four give bitwise NumPy's / ml_dtypes' results for every non-NaN value
(a NaN stays a NaN of its sign; its payload may differ). :class:`Divisor`
is the one division by the global weight, for host and device arrays.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .arrays import dtype_name

__all__ = ["DEFAULT", "MIN_BITS", "MIN_FAST", "MODES", "Casts", "Divisor", "divide", "divisor"]

#: values of ``MPIDP_CASTS``: ``auto`` (torch's when imported, else numba's when installed, else
#: NumPy's), ``numba`` (never torch's), ``numpy`` (NumPy bit arithmetic and ``astype`` only)
MODES = ("auto", "numba", "numpy")
#: Shorter segments are not given to torch or numba: one torch call costs about 2 us.
MIN_FAST = 1 << 12
#: Shorter bfloat16 and float16 segments use ``astype`` (one call) instead of the integer passes
#: below (several calls, each faster per element).
MIN_BITS = 1 << 13
#: Elements per sub-block of the host conversion loops: small enough that a sub-block and its
#: scratch stay in a core's L2 cache between passes.
BLOCK = 1 << 16
#: Elements per sub-block of the float16 upcast (measured best of 2**12 to 2**16 on the development machine).
_BLOCK16 = 1 << 14
#: float16 magnitude bits moved to float32's place, from exponent 31 (infinity, NaN) up
_F16_SPECIAL = np.uint32(0x1F << 23)


class Divisor(NamedTuple):
    """Division by ``float32(weight)``: ``ufunc(x, operand)`` is bitwise ``x / float32(weight)``.

    A power of two is a multiplication by its (exact) reciprocal: both are
    the correctly rounded value of the same real number, subnormal results
    included, and a multiplication is several times cheaper than a division.
    The host loops call ``ufunc(x, operand, out=...)`` themselves: one
    Python frame less per segment (about 0.2 us, 5% of a small window).
    """

    ufunc: Callable[..., Any]  # np.divide, or np.multiply by the exact reciprocal
    operand: np.float32
    multiply: bool  # ``operand`` is the reciprocal

    def __call__(self, x: Any, out: Any = None, xp: Any = None, **kwargs: Any) -> Any:
        """``x / float32(weight)`` into ``out`` (NumPy keywords pass on); ``xp``: CuPy for device arrays."""
        ufunc = self.ufunc if xp is None else xp.multiply if self.multiply else xp.divide
        return ufunc(x, self.operand, out=out, **kwargs)


@functools.lru_cache(maxsize=64)  # windows repeat their global weight: a hit costs less than the frexp
def divisor(weight: float) -> Divisor:
    """The division by ``float32(weight)`` (the global weight): every gradient mpidp divides goes through it."""
    f = np.float32(weight)
    mantissa, exponent = math.frexp(float(f))  # f == mantissa * 2**exponent
    if mantissa == 0.5 and -125 <= exponent <= 127:  # 2**k with k and -k normal exponents
        return Divisor(np.multiply, np.float32(2.0 ** (1 - exponent)), True)
    return Divisor(np.divide, f, False)


def divide(x: Any, weight: float, out: Any = None, xp: Any = None) -> Any:
    """``x / float32(weight)``, float32 by float32, into ``out`` (:func:`divisor` once, for one array)."""
    return divisor(weight)(x, out, xp)


#: the kernels module once imported; False when numba is absent or the kernels failed to build (a fact of the process)
_kernels: Any = None


@dataclass(frozen=True)
class Casts:
    """One session's way to cast 16-bit host values (``mode``: one of :data:`MODES`).

    ``auto`` gives long segments to torch's casts when the process has
    imported torch (looked up at each cast, as torch may be imported
    later), else to numba's; ``numba`` never to torch's; ``numpy`` to
    neither. Where numba is absent, or its kernels fail to build, NumPy's
    serve (with a warning where ``numba`` was asked for, or the build failed).
    torch's and numba's are, per cast on one core of the development
    machine, 2-9 (bfloat16) and 25-45 (float16) times faster than NumPy's,
    whose float16 casts are scalar loops (docs/performance.md).
    """

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MPIDP_CASTS must be one of {', '.join(MODES)}, got {self.mode!r}")

    def fastest(self) -> str:
        """Whose casts a long segment gets in this process now: ``torch``, ``numba`` or ``numpy`` (may load numba)."""
        if self._torch(MIN_FAST) is not None:
            return "torch"
        probe = np.empty(MIN_FAST, np.float32)
        return "numba" if self._kernels(probe, probe) is not None else "numpy"

    def _torch(self, n: int) -> Any:
        """The torch module to cast ``n`` elements with, or None."""
        return sys.modules.get("torch") if self.mode == "auto" and n >= MIN_FAST else None

    def _kernels(self, *pair: np.ndarray) -> Any:
        """The compiled kernels to cast between ``pair`` with, or None (not wanted, absent, or arrays they do not take)."""
        global _kernels
        if self.mode == "numpy" or pair[0].size < MIN_FAST or _kernels is False:
            return None
        if not all(a.flags.c_contiguous and a.flags.aligned and a.dtype.isnative and a.ndim == 1 for a in pair):
            return None
        if _kernels is None:
            try:
                from . import kernels
            except Exception as e:  # noqa: BLE001 - numba absent (ImportError), or it could not build them: NumPy casts
                _kernels = False
                if self.mode == "numba" or not isinstance(e, ImportError):
                    warnings.warn(f"mpidp: compiled 16-bit casts unavailable, using NumPy's: {type(e).__name__}: {e}", stacklevel=3)
                return None
            _kernels = kernels
        return _kernels

    def upcast(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Upcast one host segment ``src`` into float32 ``dst`` (exact)."""
        if src.dtype != np.float32:
            torch = self._torch(src.size)
            if torch is not None:
                _tensor(torch, dst).copy_(_tensor(torch, src))
                return
            kernels = self._kernels(src, dst)
            if kernels is not None:
                if src.dtype == np.float16:
                    kernels.f16_to_f32(src.view(np.uint16), dst)
                else:
                    kernels.bf16_to_f32(src.view(np.uint16), dst.view(np.uint32))
                return
        if dtype_name(src.dtype) == "bfloat16" and src.size >= MIN_BITS:
            bf16_to_f32(src, dst)
        elif src.dtype == np.float16 and src.size >= MIN_BITS:
            f16_to_f32(src, dst)
        else:
            dst[...] = src

    def downcast(self, dst: np.ndarray, src: np.ndarray, by: Divisor, scratch: list[np.ndarray]) -> None:
        """Divide one summed float32 segment ``src`` (``by``) and cast it into ``dst``, bitwise ``(src / w).astype``.

        float32 is divided straight into ``dst``. 16-bit: torch divides in
        the stage, then casts; numba's kernels divide and cast in one pass;
        otherwise bfloat16 is divided and rounded per sub-block while the
        sub-block is in cache, and float16 divided straight into ``dst`` (the
        ufunc computes in float32 and casts its output, as ``astype`` does).
        ``scratch``: one sub-block of uint32, allocated on first use and kept
        by the caller across segments.
        """
        divide, operand, multiply = by
        if dst.dtype == np.float32:
            divide(src, operand, out=dst)
            return
        torch = self._torch(src.size)
        if torch is not None:
            divide(src, operand, out=src)  # whole segments: the torch calls cost more than the cache misses
            _tensor(torch, dst).copy_(_tensor(torch, src))
            return
        kernels = self._kernels(src, dst)
        if kernels is not None:  # the division and the cast in one pass
            cast = kernels.f32_to_f16 if dst.dtype == np.float16 else kernels.f32_to_bf16
            cast(src, dst.view(np.uint16), operand, multiply)
        elif dtype_name(dst.dtype) == "bfloat16" and src.size >= MIN_BITS:
            if not scratch:
                scratch.append(np.empty(BLOCK, np.uint32))
            for lo in range(0, src.size, BLOCK):
                s = src[lo : lo + BLOCK]
                divide(s, operand, out=s)
                f32_to_bf16(s, dst[lo : lo + BLOCK], scratch[0])
        elif dst.dtype == np.float16:
            divide(src, operand, out=dst, casting="unsafe")
        else:
            divide(src, operand, out=src)
            dst[...] = src


#: the strategy of a session that sets no ``MPIDP_CASTS``, and of callers of the loops that pass none
DEFAULT = Casts()


def _tensor(torch: Any, a: np.ndarray) -> Any:
    """A tensor sharing the memory of host array ``a`` (bfloat16 through its bits)."""
    if dtype_name(a.dtype) == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """Upcast bfloat16 ``src`` into float32 ``dst``: the bits shifted into the high half (exact)."""
    s16, d32 = src.view(np.uint16), dst.view(np.uint32)
    for lo in range(0, s16.size, BLOCK):
        d = d32[lo : lo + BLOCK]
        np.copyto(d, s16[lo : lo + BLOCK])
        np.left_shift(d, 16, out=d)


def f16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """Upcast float16 ``src`` into float32 ``dst`` exactly, bitwise as NumPy casts it (NaN payloads too).

    The magnitude bits moved into float32's place are a float32 of the same
    mantissa with the exponent 112 lower (a float16 subnormal a float32 one),
    so one multiplication by 2**112 (exact) rebiases every finite value;
    infinity and NaN get float32's all-ones exponent instead; then the sign.
    About twice as fast as NumPy's scalar cast loop.
    """
    s16, d32 = src.view(np.uint16), dst.view(np.uint32)
    sign = np.empty(min(_BLOCK16, s16.size), np.uint32)
    for lo in range(0, s16.size, _BLOCK16):
        d = d32[lo : lo + _BLOCK16]
        t = sign[: d.size]
        np.copyto(d, s16[lo : lo + _BLOCK16])
        np.left_shift(d, 16, out=d)
        np.bitwise_and(d, np.uint32(0x80000000), out=t)
        np.bitwise_and(d, np.uint32(0x7FFF0000), out=d)
        np.right_shift(d, 3, out=d)
        special = d >= _F16_SPECIAL if d.max() >= _F16_SPECIAL else None
        f = d.view(np.float32)
        np.multiply(f, np.float32(2.0**112), out=f)
        if special is not None:
            np.bitwise_or(d, np.uint32(0x7F800000), out=d, where=special)
        np.bitwise_or(d, t, out=d)


def f32_to_bf16(src: np.ndarray, dst: np.ndarray, scratch: np.ndarray) -> None:
    """Round float32 ``src`` to nearest even bfloat16 into ``dst``, bitwise as ml_dtypes casts it.

    ``(bits + 0x7FFF + lowest kept bit) >> 16`` is round-to-nearest-even on
    the bits for every finite value and infinity (overflow rounds to
    infinity, subnormals round on the same grid). Only NaN needs care: a
    segment holding one is cast by ml_dtypes instead. ``scratch``: uint32,
    at least :data:`BLOCK` values (or ``src``'s size).
    """
    if np.isnan(np.max(src)):
        dst[...] = src
        return
    u32, d16 = src.view(np.uint32), dst.view(np.uint16)
    for lo in range(0, u32.size, BLOCK):
        u = u32[lo : lo + BLOCK]
        t = scratch[: u.size]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(d16[lo : lo + BLOCK], t, casting="unsafe")
