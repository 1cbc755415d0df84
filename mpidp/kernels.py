"""Compiled 16-bit casts for host arrays, for processes without torch (numba; optional: ``pip install mpidp[numba]``).

Imported by :mod:`mpidp.casts` on the first cast that can use it, only
when numba is installed. Each kernel is one pass over the values, compiled
by LLVM for this machine's vector unit (float16 through the processor's
own conversion instructions where it has them, F16C on x86-64): measured on
one core of the development machine, about as fast as torch's casts
(docs/performance.md), where NumPy's float16 casts are scalar loops and its
bit-arithmetic replacements take several passes. Every non-NaN result is
bitwise NumPy's (float16) or ml_dtypes' (bfloat16): round to nearest even,
overflow to infinity, subnormals on their own grid. A NaN stays a NaN of the
same sign; its payload may differ, as with torch's casts. The downcasts
divide (or multiply, by an exact reciprocal) in float32 first, as
``x / scale`` in NumPy does, so the division and the cast are one pass.

Arrays are contiguous and one-dimensional; the 16-bit side is passed as a
``uint16`` view, as numba has no float16 type (and bfloat16's float32 side as
``uint32``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["bf16_to_f32", "f16_to_f32", "f32_to_bf16", "f32_to_f16"]


def _intrinsic(codegen_for: Callable[..., object]) -> Any:
    """numba's ``intrinsic`` (typed as Any: the compiled functions call it with the value only)."""
    return intrinsic(codegen_for)


def _compiled(signature: str) -> Any:
    """Compile for ``signature`` now (cached on disk), releasing the GIL while it runs."""
    return njit(signature, nogil=True, cache=True, boundscheck=False, error_model="numpy")


@_intrinsic
def _widen(typingctx: object, x: types.Type) -> object:
    """The float32 value of float16 bits (exact; LLVM's ``fpext``)."""

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list[ir.Value]) -> ir.Value:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@_intrinsic
def _narrow(typingctx: object, x: types.Type) -> object:
    """The float16 bits of a float32, rounded to nearest even (LLVM's ``fptrunc``)."""

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list[ir.Value]) -> ir.Value:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@_intrinsic
def _bits(typingctx: object, x: types.Type) -> object:
    """The bits of a float32 as a uint32 (a bitcast, no instruction)."""

    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list[ir.Value]) -> ir.Value:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@_compiled("void(uint16[::1], uint32[::1])")
def bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover - compiled
    """bfloat16 bits into float32 bits: the high half (exact, NaN payloads too)."""
    for i in range(src.size):
        dst[i] = np.uint32(src[i]) << np.uint32(16)


@_compiled("void(uint16[::1], float32[::1])")
def f16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover - compiled
    """float16 bits into float32 values (exact)."""
    for i in range(src.size):
        dst[i] = _widen(src[i])


@_compiled("void(float32[::1], uint16[::1], float32, boolean)")
def f32_to_bf16(src: np.ndarray, dst: np.ndarray, operand: np.float32, multiply: bool) -> None:  # pragma: no cover - compiled
    """``src / operand`` (``src * operand`` if ``multiply``) as bfloat16 bits, bitwise ml_dtypes' cast.

    ``(bits + 0x7FFF + lowest kept bit) >> 16`` rounds to nearest even; a NaN
    becomes ml_dtypes' quiet NaN of its sign. (Written as statements, not
    one conditional expression: LLVM vectorizes this form 2x better.)
    """
    for i in range(src.size):
        u = _bits(src[i] * operand if multiply else src[i] / operand)
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            dst[i] = np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
        else:
            dst[i] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_compiled("void(float32[::1], uint16[::1], float32, boolean)")
def f32_to_f16(src: np.ndarray, dst: np.ndarray, operand: np.float32, multiply: bool) -> None:  # pragma: no cover - compiled
    """``src / operand`` (``src * operand`` if ``multiply``) as float16 bits, bitwise NumPy's cast but for NaN payloads."""
    if multiply:
        for i in range(src.size):
            dst[i] = _narrow(src[i] * operand)
    else:
        for i in range(src.size):
            dst[i] = _narrow(src[i] / operand)
