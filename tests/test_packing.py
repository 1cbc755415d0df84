"""Chunk plans and the pack / reduce / scale / unpack loop, without MPI traffic."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpidp.packing import bcast_calls, plan, reduce_calls, slot


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


def test_plan_depends_only_on_sizes_and_presence() -> None:
    assert plan([5, 100, 3], [True, True, True], 40) == plan([5, 100, 3], [True, True, True], 40)
    assert plan([5, 100, 3], [True, False, True], 40) != plan([5, 100, 3], [True, True, True], 40)


def _run(arrays: list[np.ndarray], chunk: int, scale: float) -> list[np.ndarray]:
    calls = plan([a.size for a in arrays], [True] * len(arrays), chunk)
    stage = np.empty(chunk, np.float32)
    seen: list[int] = []
    reduce_calls(calls, [slot(a) for a in arrays], stage, lambda b: seen.append(b.size), np.float32(scale))
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
