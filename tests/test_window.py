"""mpidp.window: reduction slots, the gradient checks, the reuse cache and the move (pure: a world of one, no MPI)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from mpidp import arrays, contract, layout, window
from mpidp.window import Cache, Given, Slots, Transport, check_gradients, reduce_slots


class Alone:
    """A communicator of one rank: a sum over ranks is the buffer itself."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.calls = 0

    def Allreduce(self, buf: Any, operation: str) -> None:
        self.calls += 1


def replica() -> tuple[dict[str, Any], Slots]:
    w = np.ones((4, 3), np.float32)
    params = {"w": w, "tied": w, "h": np.ones(5, np.float16), "f": np.ones(2, np.float32)}
    found = contract.build(params, ["f"], None)
    assert found.error is None
    return params, Slots(found.contract, found.infos, found.arrays)


def test_slots_are_the_trainable_tie_groups_in_contract_order() -> None:
    _, slots = replica()
    assert [g.name for g in slots.groups] == ["h", "tied"]  # 'tied' sorts before 'w' and heads the group
    assert slots.of["w"] is slots.of["tied"] and "f" not in slots.of and slots.frozen == {"f"}
    assert slots.sizes == (5, 12) and slots.words == 1
    bits = slots.presence([False, True])
    assert bits.dtype == np.uint64 and np.unpackbits(bits.view(np.uint8))[:2].tolist() == [0, 1]  # np.packbits order
    assert Cache().plan(tuple(bits.tolist()), slots.sizes, 1024)[1] == [1]


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ([], "grads must be a mapping of names to arrays, got list"),
        ({"f": np.ones(2, np.float32)}, "gradient for frozen parameter 'f'"),
        ({"x": np.ones(2, np.float32)}, "gradient for unknown parameter 'x'"),
        ({"w": np.ones((4, 3), np.float32), "tied": np.ones((4, 3), np.float32)}, "two gradients for one tied array: 'tied' and 'w'"),
        ({"h": np.ones(5, np.float32)}, "gradient 'h': dtype float32 differs from its parameter's float16"),
        ({"h": np.ones(4, np.float16)}, "gradient 'h': shape (4,) differs from its parameter's (5,)"),
        ({"h": 1.0}, "gradient 'h' is a float, not an array"),
    ],
)
def test_check_gradients_names_the_first_problem(grads: Any, message: str) -> None:
    _, slots = replica()
    given: list[Given | None] = [None] * len(slots)
    assert check_gradients(grads, slots, Cache(), given) == message


def test_the_same_gradients_pass_again_without_a_second_look_and_are_not_kept_alive() -> None:
    _, slots = replica()
    cache = Cache()
    grads = {"h": np.ones(5, np.float16), "w": np.ones((4, 3), np.float32)}
    given: list[Given | None] = [None] * len(slots)
    assert check_gradients(grads, slots, cache, given) is None and not cache.again
    assert [x.name if x else None for x in given] == ["h", "w"]  # the name each came with
    given = [None] * len(slots)
    assert check_gradients(grads, slots, cache, given) is None and cache.again
    grads["h"].shape = (5, 1)  # changed in place: checked again, and refused
    assert "gradient 'h': shape (5, 1)" in (check_gradients(grads, slots, cache, [None] * len(slots)) or "")
    grads["h"].shape = (5,)
    assert check_gradients(grads, slots, cache, [None] * len(slots)) is None
    del grads, given
    gc.collect()
    assert all(ref() is None for ref, *_ in cache.accepted.values())  # weak references only


def test_two_sets_of_gradients_taking_turns_both_pass_without_a_second_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """An overlapped session's ``.grad`` alternate between two sets of tensors: neither is checked in full again."""
    _, slots = replica()
    cache = Cache()
    a = {"h": np.ones(5, np.float16), "w": np.ones((4, 3), np.float32)}
    b = {"h": np.ones(5, np.float16), "w": np.ones((4, 3), np.float32)}
    for grads in (a, b):
        assert check_gradients(grads, slots, cache, [None] * len(slots)) is None
    looks: list[str] = []
    real = window._problem
    monkeypatch.setattr(window, "_problem", lambda name, *rest: looks.append(name) or real(name, *rest))
    for turn, grads in enumerate((a, b, a, b)):
        given: list[Given | None] = [None] * len(slots)
        serial = cache.serial
        assert check_gradients(grads, slots, cache, given) is None, turn
        assert [x.array if x else None for x in given] == [grads["h"], grads["w"]], turn
        assert not cache.again and cache.serial == serial + 1  # a set taken back counts as new: no kept program reruns
    assert looks == []
    a["w"].shape = (12,)  # changed in place: checked in full, and refused
    assert "gradient 'w': shape (12,)" in (check_gradients(a, slots, cache, [None] * len(slots)) or "")
    assert looks == ["h", "w"]
    assert not cache.accepted and not cache.previous  # a refused window keeps neither set


def test_cache_plans_are_a_small_lru() -> None:
    cache = Cache()
    sizes = (5, 12, 0, 3)
    key = (0b1101 << 4,)  # slots 0, 1 and 3 (np.packbits order: slot 0 is the high bit of the first byte)
    first = cache.plan(key, sizes, 1 << 20)
    assert first[1] == [0, 1, 3] and cache.plan(key, sizes, 1 << 20) is first
    for other in range(1 << 8, 20 << 8, 1 << 8):  # other keys (bits past the four slots: the same plan)
        cache.plan((other,), sizes, 1 << 20)
    assert len(cache.plans) == 8 and key not in cache.plans


def test_reduce_slots_divides_fills_absent_slots_and_casts_back() -> None:
    _, slots = replica()
    cache = Cache()
    g = {"w": np.full((4, 3), 6, np.float32)}
    given: list[Given | None] = [None] * len(slots)
    assert check_gradients(g, slots, cache, given) is None
    comm = Alone()
    transport = Transport(comm, np.empty(1024, np.float32), None)  # type: ignore[arg-type]
    entry = cache.plan(tuple(slots.presence([True, True]).tolist()), slots.sizes, 1024)  # another rank had 'h'
    out = reduce_slots(transport, cache, entry, slots.groups, given, 3, 3, "test")
    assert out["w"] is g["w"] and (g["w"] == 2).all()  # in place, under the name it came with
    assert out["h"].dtype == np.float16 and not out["h"].any()  # this rank had none: zeros, by the head's name
    assert comm.calls >= 1


def test_flat_storage_gradients_reuse_their_prepared_slots() -> None:
    _, slots = replica()
    cache = Cache()
    cache.flat = layout.FlatGradients([g.param for g in slots.groups], [g.info for g in slots.groups], slots.sizes, 1024)
    grads = {g.name: a for g, a in zip(slots.groups, cache.flat.arrays)}
    given: list[Given | None] = [None] * len(slots)
    assert check_gradients(grads, slots, cache, given) is None
    assert all(x is not None and x.prepared is cache.flat.slots[i].slot for i, x in enumerate(given))
    assert arrays.view(grads["h"]).base is not None


def test_a_kept_program_reuses_its_windows_views_until_the_arrays_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the third window on the same caller arrays, neither checks nor views are made again; results stay right."""
    _, slots = replica()
    cache = Cache()
    grads = {"h": np.ones(5, np.float16), "w": np.ones((4, 3), np.float32)}
    transport = Transport(Alone(), np.empty(1024, np.float32), None)  # type: ignore[arg-type]
    entry = cache.plan(tuple(slots.presence([True, True]).tolist()), slots.sizes, 1024)
    views: list[int] = []
    real = arrays.view
    monkeypatch.setattr(arrays, "view", lambda x: views.append(id(x)) or real(x))

    def window_of(fill: float) -> list[Given | None]:
        for g in grads.values():
            g[...] = fill
        given: list[Given | None] = [None] * len(slots)
        assert check_gradients(grads, slots, cache, given) is None
        out = reduce_slots(transport, cache, entry, slots.groups, given, 2, 4, "test")
        assert out["h"] is grads["h"] and out["w"] is grads["w"]
        assert (grads["h"] == np.float16(fill / 4)).all() and (grads["w"] == np.float32(fill / 4)).all()
        return given

    window_of(8)  # checked in full
    second = window_of(4)  # the same arrays: viewed again, and the program is kept
    assert cache.program is not None and len(views) == 4
    for fill in (12, 16, 20):  # reruns: the second window's Given, views and all
        assert window_of(fill) == second and len(views) == 4
    grads["h"].shape = (5, 1)  # changed in place: its fingerprint no longer matches
    assert "gradient 'h': shape (5, 1)" in (check_gradients(grads, slots, cache, [None] * len(slots)) or "")
    assert cache.program is None
    grads["h"].shape = (5,)
    window_of(8)  # accepted as a new set: views made again
    assert len(views) == 6
