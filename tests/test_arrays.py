"""mpidp.arrays: what an array is to mpidp, and its memory (pure: one process, no MPI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpidp import arrays
from mpidp.arrays import BFLOAT16, ArrayInfo


def test_describe_numpy_and_torch() -> None:
    assert arrays.describe(np.zeros((2, 3), np.float16)) == ArrayInfo("numpy", "float16", (2, 3), "cpu")
    assert arrays.describe(np.zeros(2, BFLOAT16)) == ArrayInfo("numpy", "bfloat16", (2,), "cpu")
    assert arrays.describe(np.zeros(2, ">f4")).dtype == ">f4"  # a foreign byte order: named by its code, refused later
    assert arrays.describe(torch.zeros(4, dtype=torch.bfloat16)) == ArrayInfo("torch", "bfloat16", (4,), "cpu")
    assert arrays.describe([1.0]) is None
    assert ArrayInfo("numpy", "int8", (2, 5), "cpu").size == 10 and ArrayInfo("numpy", "bool", (), "cpu").is_integer


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16, np.int64, np.bool_, ">f4"])
@pytest.mark.parametrize("writeable", [True, False])
def test_address_is_the_first_element_whatever_the_dtype_or_flags(dtype: object, writeable: bool) -> None:
    a = np.zeros(16, dtype)
    a.flags.writeable = writeable
    for v in (a, a[3:], a[::2]):
        assert arrays.address(v) == v.__array_interface__["data"][0]


def test_host_region_is_the_memory_at_an_address() -> None:
    a = np.arange(8, dtype=np.float32)
    r = arrays.host_region(arrays.address(a[2:]), 8, np.float32)
    assert r.tolist() == [2.0, 3.0]
    r[0] = -1
    assert a[2] == -1


def test_view_shares_memory_with_torch_tensors_bfloat16_included() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    v = arrays.view(t)
    assert v.dtype == BFLOAT16 and v.tolist() == t.float().tolist()
    v[0] = 5
    assert t[0].item() == 5


def test_problem_says_why_an_array_cannot_be_written_in_place() -> None:
    a = np.zeros(3, np.float32)
    assert arrays.problem(a) is None
    a.flags.writeable = False
    assert arrays.problem(a) == "it is read-only (mpidp writes into it in place)"
    assert "resolve_neg" in (arrays.problem(torch.zeros(2)._neg_view()) or "")
    assert "dense" in (arrays.problem(torch.zeros(2, 2).to_sparse()) or "")


def test_fingerprint_changes_with_memory_shape_and_writability() -> None:
    a = np.zeros(6, np.float32)
    before = arrays.fingerprint(a)
    a[...] = 1
    assert arrays.fingerprint(a) == before  # values are not part of it
    a.shape = (2, 3)
    assert arrays.fingerprint(a) != before
    t = torch.zeros(4)
    fp = arrays.fingerprint(t)
    t.data = torch.zeros(4)
    assert arrays.fingerprint(t) != fp  # the storage was swapped under the same object


def test_new_arrays_of_the_same_kind() -> None:
    t = torch.ones(2, 3, dtype=torch.float16).t()
    z = arrays.zeros_like(t)
    assert isinstance(z, torch.Tensor) and z.shape == (3, 2) and z.is_contiguous() and not z.any()
    f = arrays.flat_zeros(np.ones(1, BFLOAT16), 5)
    assert f.dtype == BFLOAT16 and f.shape == (5,)
    assert arrays.xp(np.zeros(1)) is np


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_flat_torch_storage_is_numpy_memory_aligned_and_zeroed(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: NumPy's allocator advises huge pages (MPI moves such memory 1.5x faster here); torch's does not."""
    made: list[np.ndarray] = []
    real = arrays.host_bytes
    monkeypatch.setattr(arrays, "host_bytes", lambda n: made.append(real(n)) or made[-1])
    count = (5 << 20) + 3  # over NumPy's huge-page threshold (4 MiB), an odd count
    f = arrays.flat_zeros(torch.ones(1, dtype=dtype), count)
    assert isinstance(f, torch.Tensor) and f.dtype == dtype and f.shape == (count,) and not f.any()
    [host] = made  # the tensor is NumPy's memory
    assert f.data_ptr() == host.ctypes.data and f.data_ptr() % 64 == 0 and host.nbytes == count * f.element_size()
    f[-1] = 1  # writable to the last element, and no neighbour shares it
    assert int(f.to(torch.float64).sum()) == 1 and host.view(np.uint8)[-f.element_size():].any()


@pytest.mark.parametrize(
    ("shape", "strides", "itemsize", "overlaps"),
    [
        ((4,), (0,), 4, True),  # np.broadcast_to, torch's expand
        ((4, 3), (4, 0), 4, True),
        ((4, 3), (12, 4), 4, False),  # C order
        ((4, 3), (4, 16), 4, False),  # F order
        ((3, 2), (8, 12), 4, False),  # interleaved in itself: proven element by element
        ((3, 2), (8, 10), 4, True),  # elements 8 + 0 and 0 + 10 ... overlap by two bytes
        ((2, 2), (4, 4), 4, True),  # as_strided: (0, 1) and (1, 0) are one element
        ((5,), (-4,), 4, False),
        ((0, 3), (0, 0), 4, False),  # empty
        ((1, 3), (0, 4), 4, False),  # a dimension of 1 never repeats an element
        ((2000, 2000), (4, 4), 4, True),  # too many to enumerate: counted as overlapping
    ],
)
def test_internal_overlap(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, overlaps: bool) -> None:
    assert arrays.internal_overlap(shape, strides, itemsize) is overlaps


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_views_of_subclasses_are_plain_arrays_and_self_overlap_is_a_problem() -> None:
    m = np.asmatrix(np.zeros((2, 3), np.float32))
    v = arrays.view(m)
    assert type(v) is np.ndarray and v.reshape(-1).shape == (6,) and np.shares_memory(v, m)
    assert arrays.problem(m) is None
    assert "masked array" in str(arrays.problem(np.ma.zeros(3, np.float32)))
    tiled = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), shape=(4, 4), strides=(4, 0))
    assert "its elements overlap in memory (shape (4, 4), strides (4, 0)" in str(arrays.problem(tiled))
    assert "strides (0,)" in str(arrays.problem(torch.zeros(1, dtype=torch.float16).expand(4)))
    assert arrays.problem(torch.zeros(4, 6)[:, ::2].t()) is None
