"""mpidp.layout: memory geometry and flat storage (pure: one process, no communication)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import snapshot
from replicas import BF16, model

import mpidp
from mpidp import arrays, layout

BYTE_BOUNDS = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds


def test_flat_parameters_copies_into_one_buffer_per_dtype() -> None:
    params = model(3)
    before = snapshot(params)
    flat = mpidp.flat_parameters(params)
    assert list(flat) == list(params)  # same names, same order
    assert snapshot(flat) == before  # same values
    assert snapshot(params) == before  # the originals are untouched
    assert flat["embed"] is flat["head"]  # the tie survives
    assert all(not np.shares_memory(flat[k], params[k]) for k in params)
    for dtype in (np.float32, np.float16, BF16):
        views = [v for k, v in flat.items() if v.dtype == dtype and k != "head"]
        bases = {id(v.base) for v in views}
        assert len(bases) == 1, dtype  # one flat buffer per dtype
        base = views[0].base
        assert sum(v.size for v in views) == base.size  # nothing else in it


def test_flat_parameters_refuses_non_arrays() -> None:
    with pytest.raises(TypeError, match="parameter 'b': list is not a NumPy"):
        mpidp.flat_parameters({"a": np.zeros(2, np.float32), "b": [1.0]})
    with pytest.raises(TypeError, match="mapping"):
        mpidp.flat_parameters([np.zeros(2)])  # type: ignore[arg-type]


def test_strided_bounds_match_numpy_byte_bounds() -> None:
    # the overlap check's bounds, checked against NumPy's
    base = np.zeros((6, 10, 4), dtype=np.float32)
    views = [base, base[1:4, ::3], base[::-1], base[:, ::-2, 1:3], base.transpose(2, 0, 1), base[5:6, 9:, 3:], base.reshape(-1)[7:8]]
    for v in views:
        address = v.__array_interface__["data"][0]
        assert layout.strided_bounds(address, v.shape, v.strides, v.itemsize) == tuple(BYTE_BOUNDS(v)), v.strides


def test_runs_join_adjacent_arrays_whatever_order_they_lie_in() -> None:
    flat = np.zeros(10, np.float32)
    a, b, c = flat[:3], flat[3:7], flat[7:]
    alone = np.zeros(4, np.float32)
    assert layout.runs([a, b, c, alone], "cpu") == ((0, 1, 2), (3,))
    assert layout.runs([c, alone, a, b], "cpu") == ((1,), (2, 3, 0))  # positions in address order, runs sorted
    assert layout.runs([a, np.zeros((3, 4), np.float32).T], "cpu") is None  # a strided head: no runs
    assert layout.runs([a], "cuda:0") is None  # device arrays are broadcast array by array
    region = layout.region([a, b, c], (0, 1, 2))
    assert region.dtype == np.uint8 and region.size == flat.nbytes
    region[:4] = 255
    assert np.isnan(flat[0]) and flat[1] == 0  # the region is the arrays' memory


def test_overlap_names_the_first_two_gradients_that_share_memory() -> None:
    base = np.zeros(20, np.float32)
    assert layout.overlap([base[:10], base[10:], np.zeros(0, np.float32)], ["a", "b", "empty"]) is None
    assert layout.overlap([base[:10], base[5:15]], ["a", "b"]) == "gradients 'a' and 'b' share memory (each needs its own)"
    assert layout.overlap([base[::2], base[1::2]], ["even", "odd"]) is None  # interleaved: the ranges overlap, no element does


def test_flat_gradients_follow_the_reduce_plan_and_are_recognised_unchanged() -> None:
    params = [np.ones(5, np.float32), np.ones((2, 3), np.float16), np.ones(0, np.float32), np.ones(4, np.float32)]
    infos = [arrays.describe(p) for p in params]
    flat = layout.FlatGradients(params, infos, [p.size for p in params], 1 << 20)  # type: ignore[arg-type]
    assert sorted(flat.flat) == ["float16", "float32"]
    assert flat.flat["float32"].size == 9 and flat.flat["float16"].size == 6
    assert [g.shape for g in flat.arrays] == [(5,), (2, 3), (0,), (4,)]
    assert np.shares_memory(flat.arrays[0], flat.flat["float32"]) and np.shares_memory(flat.arrays[3], flat.flat["float32"])
    flat.arrays[0][...] = 7
    assert flat.prepared(0, flat.arrays[0]) is flat.slots[0]  # its values changed, not its memory
    assert flat.prepared(0, flat.arrays[0].copy()) is None  # another array
    assert flat.prepared(0, flat.arrays[3]) is None  # another slot's
    flat.zero()
    assert all(not g.any() for g in flat.arrays)


def test_crc_bytes_reads_any_layout() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert bytes(layout.crc_bytes(a.T)) == np.ascontiguousarray(a.T).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_flat_parameters_keeps_values_and_ties_per_dtype(dtype: str) -> None:
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    w = np.arange(6, dtype=np.float32).astype(dt)
    flat = mpidp.flat_parameters({"w": w, "tied": w, "b": np.ones(2, dt)})
    assert flat["w"] is flat["tied"] and flat["w"].dtype == dt
    assert flat["w"].tobytes() == w.tobytes()


def test_overlap_accepts_interleaved_views_and_names_shared_memory() -> None:
    buf = np.zeros((8, 6), np.float32)
    apart = {"even": buf.reshape(-1)[0::2], "odd": buf.reshape(-1)[1::2], "col": buf[:, 2::2].T}
    assert layout.overlap([apart["even"], apart["odd"]], ["even", "odd"]) is None  # interleaved, no element shared
    assert layout.overlap([buf[:, 0::3], buf[:, 1::3], buf[:, 2::3]], ["a", "b", "c"]) is None
    assert layout.overlap([apart["even"], apart["col"]], ["even", "col"]) == "gradients 'even' and 'col' share memory (each needs its own)"
    assert layout.overlap([buf[1:3], buf[:2], np.zeros(3, np.float32)], ["x", "y", "z"]) == "gradients 'y' and 'x' share memory (each needs its own)"
    # a range that starts inside an earlier long one, past a neighbour that shares nothing, is still compared
    assert layout.overlap([buf.reshape(-1)[0::2], buf.reshape(-1)[1:4:2], buf.reshape(-1)[10:12]], ["a", "b", "c"]) is not None

