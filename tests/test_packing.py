"""Chunk plans and the pack / reduce / scale / unpack loop, without MPI traffic."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpidp import casts as cast_room
from mpidp.casts import Casts
from mpidp.packing import Segment, bcast_calls, plan, reduce_calls, slot


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_plan_covers_every_present_element_once(chunk: int) -> None:
    rng = np.random.default_rng(chunk)
    sizes = [int(s) for s in rng.integers(0, 300, 40)]
    present = [bool(b) for b in rng.random(40) < 0.8]
    calls = plan(sizes, present, chunk)
    seen = {i: np.zeros(s, int) for i, s in enumerate(sizes)}
    for call in calls:
        assert 0 < call.length <= max(1, chunk)
        assert sum(s.length for s in call.segments) == call.length
        dst = 0
        for seg in call.segments:
            assert seg.dst == dst
            dst += seg.length
            seen[seg.slot][seg.src : seg.src + seg.length] += 1
            if len(call.segments) > 1:
                assert sizes[seg.slot] < max(1, chunk // 4), "large slots get calls of their own"
    for i, s in enumerate(sizes):
        assert (seen[i] == (1 if present[i] else 0)).all()


def test_plan_gives_slots_from_large_units_calls_of_their_own() -> None:
    """The default threshold is a quarter chunk; initialize's Bcast plan passes a lower one."""
    sizes, present = [5, 20, 3, 30, 9], [True] * 5
    assert [c.segments for c in plan(sizes, present, 40)] == [
        (Segment(1, 0, 0, 20),),
        (Segment(3, 0, 0, 30),),
        (Segment(0, 0, 0, 5), Segment(2, 0, 5, 3), Segment(4, 0, 8, 9)),
    ]
    assert [c.segments for c in plan(sizes, present, 40, large=9)] == [
        (Segment(1, 0, 0, 20),),
        (Segment(3, 0, 0, 30),),
        (Segment(4, 0, 0, 9),),
        (Segment(0, 0, 0, 5), Segment(2, 0, 5, 3)),
    ]
    assert plan(sizes, present, 40, large=100) == plan(sizes, present, 40, large=40)  # never above a chunk


def test_plan_depends_only_on_sizes_and_presence() -> None:
    assert plan([5, 100, 3], [True, True, True], 40) == plan([5, 100, 3], [True, True, True], 40)
    assert plan([5, 100, 3], [True, False, True], 40) != plan([5, 100, 3], [True, True, True], 40)


def _run(arrays: list[np.ndarray], chunk: int, scale: float, casts: Casts = cast_room.DEFAULT) -> list[np.ndarray]:
    calls = plan([a.size for a in arrays], [True] * len(arrays), chunk)
    stage = np.empty(chunk, np.float32)
    seen: list[int] = []
    reduce_calls(calls, [slot(a) for a in arrays], stage, lambda b: seen.append(b.size), np.float32(scale), casts=casts)
    assert seen == [c.length for c in calls]
    return arrays


def test_reduce_calls_scales_and_casts_back_every_dtype() -> None:
    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16]
    arrays = [rng.standard_normal(int(n)).astype(dtypes[i % 3]) for i, n in enumerate(rng.integers(1, 500, 30))]
    expected = [(a.astype(np.float32) / np.float32(3)).astype(a.dtype) for a in arrays]
    _run(arrays, 97, 3)
    for a, e in zip(arrays, expected):
        assert a.tobytes() == e.tobytes()


def test_adjacent_float32_views_are_reduced_in_place() -> None:
    flat = np.arange(1000, dtype=np.float32)
    views = [flat[0:10], flat[10:30], flat[30:1000]]
    calls = plan([v.size for v in views], [True] * 3, 256)
    regions: list[np.ndarray] = []
    stage = np.zeros(256, np.float32)
    reduce_calls(calls, [slot(v) for v in views], stage, regions.append, np.float32(2))
    assert not stage.any(), "nothing was staged"
    assert all(np.shares_memory(r, flat) for r in regions)
    assert np.array_equal(flat, np.arange(1000, dtype=np.float32) / 2)


def test_noncontiguous_arrays_are_written_back() -> None:
    base = np.arange(200, dtype=np.float32).reshape(10, 20)
    t = base.T
    _run([t], 16, 4)
    assert np.array_equal(base, np.arange(200, dtype=np.float32).reshape(10, 20) / 4)


def test_bcast_calls_moves_bytes_into_non_root_slots() -> None:
    rng = np.random.default_rng(1)
    src = [rng.standard_normal(n).astype(d) for n, d in [(3, np.float16), (500, np.float32), (9, ml_dtypes.bfloat16)]]
    dst = [np.zeros_like(a) for a in src]
    calls = plan([a.nbytes for a in src], [True] * 3, 256)
    stage_root, stage_other = np.empty(256, np.uint8), np.empty(256, np.uint8)
    sent: list[bytes] = []
    bcast_calls(calls, [slot(a) for a in src], stage_root, lambda b: sent.append(b.tobytes()), True)
    replay = iter(sent)

    def receive(b: np.ndarray) -> None:
        b[...] = np.frombuffer(next(replay), np.uint8)

    bcast_calls(calls, [slot(a) for a in dst], stage_other, receive, False)
    for a, b in zip(src, dst):
        assert a.tobytes() == b.tobytes()


#: whose 16-bit casts the loop uses: NumPy / ml_dtypes only, mpidp.kernels (numba), torch's
CASTS = ["numpy", "numba", "torch"]


def _use_casts(casts: str) -> Casts:
    """The strategy that casts long 16-bit segments with ``casts`` (skip where it is not installed)."""
    if casts == "torch":
        pytest.importorskip("torch")  # imported: the auto strategy casts with it
        strategy = Casts("auto")
    else:
        if casts == "numba":
            pytest.importorskip("numba")
        strategy = Casts(casts)
    assert strategy.fastest() == casts
    return strategy


def _adversarial(rng: np.random.Generator, n: int, dtype: np.dtype) -> np.ndarray:
    """Every kind of 16-bit value: random bit patterns (subnormals, infinities, extremes), no NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits[: 1 << 15] = np.arange(1 << 15, dtype=np.uint16)  # every positive pattern, then some negatives
    bits[1 << 15 : 1 << 16] = np.arange(1 << 15, dtype=np.uint16) | 0x8000
    a = bits.view(dtype)
    a[np.isnan(a.astype(np.float32))] = 1
    return a


@pytest.mark.parametrize("casts", CASTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [3, 8, 1000003])
def test_large_16_bit_segments_are_bitwise_the_reference_casts(casts: str, dtype: str, scale: int) -> None:
    """The fast casts (integer passes, compiled kernels, torch's) equal astype(float32) / scale -> astype(dtype)."""

    strategy = _use_casts(casts)
    d = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(scale)
    big = _adversarial(rng, 300_000, d)
    small = _adversarial(rng, 70_000, d)[-5000:]  # packed with others into one call
    tiny = _adversarial(rng, 70_000, d)[-100:]  # below the torch threshold
    f32 = rng.standard_normal(3000).astype(np.float32)
    arrays = [big, small, tiny, f32]
    with np.errstate(all="ignore"):
        expected = [(a.astype(np.float32) / np.float32(scale)).astype(a.dtype) for a in arrays]
    _run(arrays, 1 << 17, scale, strategy)
    for a, e in zip(arrays, expected):
        assert a.tobytes() == e.tobytes(), (a.dtype, np.flatnonzero(a.view(np.uint8) != e.view(np.uint8))[:5])


@pytest.mark.parametrize("casts", CASTS)
def test_nan_stays_nan_through_the_fast_casts(casts: str) -> None:
    strategy = _use_casts(casts)
    for dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        a = np.full(200_000, 2.0, dtype=dtype)
        a[[0, 77, 199_999]] = np.nan
        _run([a], 1 << 16, 3, strategy)
        f = a.astype(np.float32)
        assert np.isnan(f[[0, 77, 199_999]]).all()
        keep = np.ones(a.size, bool)
        keep[[0, 77, 199_999]] = False
        assert (a[keep] == (np.float32(2) / np.float32(3)).astype(dtype)).all()
