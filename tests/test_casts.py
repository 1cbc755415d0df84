"""The 16-bit casts of host values and the division by the global weight, without MPI."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpidp import casts
from mpidp.casts import Casts


def _adversarial(rng: np.random.Generator, n: int, dtype: np.dtype) -> np.ndarray:
    """Every kind of 16-bit value: random bit patterns (subnormals, infinities, extremes), no NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits[: 1 << 15] = np.arange(1 << 15, dtype=np.uint16)
    bits[1 << 15 : 1 << 16] = np.arange(1 << 15, dtype=np.uint16) | 0x8000
    a = bits.view(dtype)
    a[np.isnan(a.astype(np.float32))] = 1
    return a


@pytest.mark.parametrize("weight", [1, 2, 3, 4, 7, 8, 1 << 20, 1000003, 1 << 40, (1 << 64) - 1])
def test_the_division_is_bitwise_float32_by_float32(weight: int) -> None:
    """Powers of two multiply by the exact reciprocal, others divide: the bits of ``x / float32(weight)``, subnormals too."""
    rng = np.random.default_rng(weight % 1000)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32),
        np.arange(0, 1 << 16, dtype=np.uint32),  # subnormal inputs
        np.arange(0x00800000, 0x00810000, dtype=np.uint32),  # smallest normals: subnormal results
    ])
    x = bits.view(np.float32)
    by = casts.divisor(weight)
    assert by.multiply == (weight in (1, 2, 4, 8, 1 << 20, 1 << 40, (1 << 64) - 1))  # float32(2**64 - 1) is 2**64
    with np.errstate(all="ignore"):
        want = x / np.float32(weight)
        got = by(x, np.empty_like(x))
        once = casts.divide(x, weight)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all() and got[~nan].tobytes() == want[~nan].tobytes()
    assert once[~nan].tobytes() == want[~nan].tobytes()


def test_a_strategy_is_one_of_the_modes() -> None:
    assert Casts().mode == "auto" and casts.DEFAULT == Casts("auto")
    with pytest.raises(ValueError, match="MPIDP_CASTS must be one of auto, numba, numpy, got 'gpu'"):
        Casts("gpu")
    assert Casts("numpy").fastest() == "numpy"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_16_bit_upcasts_are_bitwise_numpys_for_every_pattern(dtype: str) -> None:
    """All 2**16 patterns (subnormals, infinities, NaN with payloads): the bit upcasts equal NumPy / ml_dtypes."""
    d = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    every = np.arange(1 << 16, dtype=np.uint16).view(d)
    got = np.full(every.size, 7, np.float32)
    (casts.bf16_to_f32 if dtype == "bfloat16" else casts.f16_to_f32)(every, got)
    want = every.astype(np.float32)
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def test_the_bfloat16_downcast_is_bitwise_ml_dtypes_on_edge_and_random_floats() -> None:
    """Round to nearest even on the bits: ties, subnormals, overflow to infinity; NaN stays NaN."""
    rng = np.random.default_rng(11)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),  # every kind of float32
        (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000,  # every tie
        (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x7FFF,
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x80000001, 0x007FFFFF, 0x7F800000], np.uint32),
    ])
    x = bits.view(np.float32)
    nan = np.isnan(x)
    with np.errstate(all="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    got = np.empty(x.size, ml_dtypes.bfloat16)
    finite = x[~nan]
    out = np.empty(finite.size, ml_dtypes.bfloat16)
    casts.f32_to_bf16(finite, out, np.empty(1 << 16, np.uint32))
    assert out.view(np.uint16).tobytes() == want[~nan].view(np.uint16).tobytes()
    with np.errstate(invalid="ignore"):
        casts.f32_to_bf16(x, got, np.empty(1 << 16, np.uint32))  # a segment with NaN: ml_dtypes' cast
    assert np.isnan(got[nan].astype(np.float32)).all()
    assert got[~nan].view(np.uint16).tobytes() == want[~nan].view(np.uint16).tobytes()


def test_compiled_kernels_are_bitwise_numpy_and_ml_dtypes() -> None:
    """Every 16-bit pattern up; float32 bit patterns (random, subnormal edges, overflow edge) down, scaled both ways."""
    kernels = pytest.importorskip("mpidp.kernels")
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    up = np.empty(every.size, np.float32)
    kernels.bf16_to_f32(every, up.view(np.uint32))
    assert up.tobytes() == every.view(ml_dtypes.bfloat16).astype(np.float32).tobytes()
    kernels.f16_to_f32(every, up)
    expected = every.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.isnan(up[nan]).all() and up[~nan].tobytes() == expected[~nan].tobytes()
    rng = np.random.default_rng(7)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000, 0x38900000, 61, dtype=np.uint32),  # float16's subnormal range and its top
        np.arange(0x477F0000, 0x47810000, dtype=np.uint32),  # around float16's overflow
        np.arange(0x7F7F0000, 0x7F800100, 7, dtype=np.uint32),  # around bfloat16's overflow, infinity, NaN
    ])
    x = np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)
    out = np.empty(x.size, np.uint16)
    for scale, multiply in ((3.0, False), (1000003.0, False), (0.25, True), (1.0, True)):
        with np.errstate(all="ignore"):
            v = x * np.float32(scale) if multiply else x / np.float32(scale)
            want16, wantb = v.astype(np.float16).view(np.uint16), v.astype(ml_dtypes.bfloat16).view(np.uint16)
        nan = np.isnan(v)
        kernels.f32_to_f16(x, out, np.float32(scale), multiply)
        assert np.array_equal(out[~nan], want16[~nan]), np.flatnonzero(out[~nan] != want16[~nan])[:5]
        assert np.isnan(out[nan].view(np.float16)).all() and np.array_equal(out[nan] >> 15, want16[nan] >> 15)
        kernels.f32_to_bf16(x, out, np.float32(scale), multiply)
        assert np.array_equal(out, wantb), np.flatnonzero(out != wantb)[:5]  # NaN: ml_dtypes' quiet NaN of its sign


def _downcast(strategy: Casts, a: np.ndarray, weight: int) -> None:
    """``a`` upcast, divided by ``weight`` and cast back in place through ``strategy`` (as the loop does)."""
    stage = np.empty(a.size, np.float32)
    strategy.upcast(stage, a)
    strategy.downcast(a, stage, casts.divisor(weight), [])


def test_without_numba_the_numpy_casts_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba absent (or its kernels failing to build): NumPy casts, the same bits, no warning unless asked for."""
    import sys
    import warnings

    import mpidp

    monkeypatch.setitem(sys.modules, "torch", None)  # a process without torch: auto tries numba
    monkeypatch.setattr(casts, "_kernels", None)
    monkeypatch.setitem(sys.modules, "mpidp.kernels", None)  # import fails with ImportError
    monkeypatch.delattr(mpidp, "kernels", raising=False)  # an earlier import's attribute would serve it
    a = _adversarial(np.random.default_rng(1), 100_000, np.dtype(np.float16))
    expected = (a.astype(np.float32) / np.float32(3)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Casts("auto").fastest() == "numpy"
        _downcast(Casts("auto"), a, 3)
    assert a.tobytes() == expected.tobytes()
    assert casts._kernels is False
    monkeypatch.setattr(casts, "_kernels", None)
    with pytest.warns(UserWarning, match="compiled 16-bit casts unavailable"):
        _downcast(Casts("numba"), a, 1)  # asked for by name: told why not
    assert a.tobytes() == expected.tobytes()


def test_a_session_reads_its_strategy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPIDP_CASTS (initialize reads it through checks.cast_strategy); the removed module switches are named when set."""
    from mpidp import checks, packing

    monkeypatch.delenv("MPIDP_CASTS", raising=False)
    assert checks.cast_strategy() == (Casts("auto"), None)
    variable = "MPIDP_CASTS"
    monkeypatch.setenv(variable, " NumPy ")  # case and blanks do not matter
    assert checks.cast_strategy() == (Casts("numpy"), None)
    monkeypatch.setenv(variable, "torch")
    assert checks.cast_strategy() == (casts.DEFAULT, "MPIDP_CASTS must be one of auto, numba, numpy, got 'torch'")
    monkeypatch.setattr(packing, "NUMBA_CASTS", False, raising=False)  # an earlier release's switch, set by a user
    with pytest.warns(UserWarning, match="NUMBA_CASTS are no longer read: set MPIDP_CASTS=numba or numpy"):
        checks.cast_strategy()
