"""mpidp.contract: one rank's contract, its local errors, and the diff that names the first difference (pure)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from replicas import model

from mpidp import contract
from mpidp.contract import Entry, Region


def test_build_orders_by_name_and_records_ties_and_frozen_flags() -> None:
    params = model(0)
    found = contract.build(dict(reversed(list(params.items()))), ["frozen"], None)
    assert found.error is None and found.device == "cpu"
    assert [e.name for e in found.contract] == sorted(params)
    by_name = {e.name: (i, e) for i, e in enumerate(found.contract)}
    embed, head = by_name["embed"], by_name["head"]
    assert head[1].alias == embed[0] and embed[1].alias == embed[0]  # tied: the first name in order heads it
    assert not by_name["frozen"][1].trainable and by_name["big"][1] == Entry("big", (300_000,), "float32", True, by_name["big"][0])
    assert found.arrays[embed[0]] is params["embed"]


@pytest.mark.parametrize(
    ("params", "frozen", "device", "message"),
    [
        ([1], (), None, "params must be a mapping of names to arrays, got list"),
        ({1: np.zeros(2, np.float32)}, (), None, "parameter names must be str, got 1"),
        ({"a": np.zeros(2, np.float32)}, 3, None, "frozen must be a collection of names, got int"),
        ({"a": np.zeros(2, np.float32)}, (), "gpu", "device must be 'cpu' or 'cuda:N', got 'gpu'"),
        ({"a": np.zeros(2, np.float32)}, ["b"], None, "frozen names unknown parameter 'b'"),
        ({"a": np.zeros(2, np.int32)}, (), None, "parameter 'a': int32 arrays need explicit synchronization"),
        ({"a": np.zeros(2)}, (), None, "parameter 'a': dtype float64 is not supported (float32, float16, bfloat16)"),
        ({"a": "x"}, (), None, "parameter 'a': str is not a NumPy, CuPy or PyTorch array"),
        ({"a": np.zeros(2, np.float32)}, (), "cuda:0", "parameter 'a' is on cpu, but this rank's device is cuda:0"),
    ],
)
def test_build_names_the_first_local_error(params: Any, frozen: Any, device: Any, message: str) -> None:
    found = contract.build(params, frozen, device)
    assert found.error is not None and message in found.error


def test_build_refuses_a_half_frozen_tie() -> None:
    w = np.zeros(3, np.float32)
    found = contract.build({"a": w, "b": w}, ["b"], None)
    assert found.error == "tied parameters 'a' and 'b' disagree on the trainable flag (freeze all names of a tied array or none)"


BASE = (Entry("a", (3,), "float32", True, 0), Entry("b", (3,), "float32", True, 0), Entry("c", (2,), "float16", False, 2))


@pytest.mark.parametrize(
    ("theirs", "message"),
    [
        (BASE, None),
        ((BASE[0], Entry("x", (3,), "float32", True, 0), BASE[2]), "entry 1 is 'x', expected 'b'"),
        ((BASE[0], BASE[1], Entry("c", (3,), "float16", False, 2)), "parameter 'c': shape (3,) differs from (2,)"),
        ((BASE[0], BASE[1], Entry("c", (2,), "bfloat16", False, 2)), "parameter 'c': dtype bfloat16 differs from float16"),
        ((BASE[0], BASE[1], Entry("c", (2,), "float16", True, 2)), "parameter 'c': trainable True differs from False"),
        ((BASE[0], Entry("b", (3,), "float32", True, 1), BASE[2]), "parameter 'b': untied, expected tied to 'a'"),
        (BASE[:2], "2 parameters, expected 3 (missing 'c')"),
        ((*BASE, Entry("d", (1,), "float32", True, 3)), "4 parameters, expected 3 (extra 'd')"),
    ],
)
def test_diff_names_the_first_difference(theirs: tuple[Entry, ...], message: str | None) -> None:
    assert contract.diff(BASE, theirs) == message


BUFFERS = (Region("m", (4,), "float32", "m"), Region("n", (4,), "float32", "m"), Region("s", (), "int64", "s"))


@pytest.mark.parametrize(
    ("theirs", "message"),
    [
        (BUFFERS, None),
        ((Region("k", (4,), "float32", "k"), *BUFFERS[1:]), "buffer 'k' where rank 0 has 'm'"),
        ((BUFFERS[0], BUFFERS[1], Region("s", (1,), "int32", "s")), "buffer 's' is int32 of shape (1,), on rank 0 int64 of shape ()"),
        ((BUFFERS[0], Region("n", (4,), "float32", "n"), BUFFERS[2]), "buffer 'n' is a tensor of its own, on rank 0 the same tensor as 'm'"),
        (BUFFERS[:1], "1 buffers, rank 0 has 3 (missing 'n')"),
        ((*BUFFERS, Region("t", (1,), "bool", "t")), "4 buffers, rank 0 has 3 (extra 't')"),
    ],
)
def test_diff_regions_names_the_first_buffer_that_differs(theirs: tuple[Region, ...], message: str | None) -> None:
    assert contract.diff_regions(BUFFERS, theirs) == message
