"""The exact reduction's arithmetic (mpidp.exact): no MPI, the ranks simulated as accumulators.

Every test folds the same micro-batches, spread over 1 to 5 simulated ranks
in different ways and orders, runs the protocol by hand (each rank's record
words -> agreed facts -> shift -> integer sum -> one conversion) and asserts
the same bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import pytest

from mpidp.exact import sums as exact

SIZES = (7, 300, 1)


def micro_batches(count: int, seed: int = 0, spread: int = 4) -> list[list[np.ndarray]]:
    """``count`` micro-batches of gradients for SIZES, of magnitudes varying over ``spread`` decades."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        out.append([(rng.standard_normal(n) * 10.0 ** rng.uniform(-spread / 2, spread / 2)).astype(np.float32) for n in SIZES])
    return out


def simulate(batches: Sequence[Sequence[np.ndarray]], groups: Sequence[Sequence[int]], weight: int = 10) -> list[np.ndarray]:
    """The exact protocol with one accumulator per group of micro-batches (a simulated rank); its results."""
    ranks = [exact.Accumulator(SIZES) for _ in groups]
    for acc, members in zip(ranks, groups):
        for j, b in enumerate(members):
            for i, g in enumerate(batches[b]):
                if j < len(members) - 1:
                    acc.fold(i, g)
                else:
                    acc.measure(i, g)  # the last one is reduce's own
    facts = [exact.Facts([acc.word(i) for acc in ranks if acc.present(i)]) for i in range(len(SIZES))]
    assert not any(f.overflow for f in facts)
    return protocol(ranks, facts, weight)


def protocol(ranks: Sequence[exact.Accumulator], facts: Sequence[exact.Facts], weight: int) -> list[np.ndarray]:
    """Pack every simulated rank at the agreed quanta, sum the integers (MPI_SUM: any order), convert once."""
    acc = ranks[0]
    total = np.zeros(acc.total, np.int64)
    for r in ranks:
        packed = np.empty(acc.total, np.int64)
        r.pack(0, acc.total, facts, packed)
        total += packed
    floats = np.empty(acc.total, np.float32)
    acc.unpack(0, acc.total, facts, total, weight, floats)
    return [floats[lo:hi] for lo, hi in acc.bounds]


def digest(arrays: Sequence[np.ndarray]) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_the_bits_do_not_depend_on_the_world_size(ranks: int) -> None:
    batches = micro_batches(12)
    one = digest(simulate(batches, [list(range(12))]))
    shards = [list(exact.shard(12, r, ranks)) for r in range(ranks)]
    assert digest(simulate(batches, shards)) == one


def test_nor_on_the_order_or_grouping_of_the_micro_batches() -> None:
    batches = micro_batches(12, seed=3)
    one = digest(simulate(batches, [list(range(12))]))
    rng = np.random.default_rng(9)
    for _ in range(5):
        order = rng.permutation(12).tolist()
        cuts = sorted(rng.choice(np.arange(1, 12), size=int(rng.integers(1, 5)), replace=False).tolist())
        groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, 12])]
        assert digest(simulate(batches, groups)) == one


def test_a_float32_sum_does_depend_on_it() -> None:
    """The problem solved: the same twelve micro-batches, summed in float32 in two groupings, differ."""
    batches = micro_batches(12, seed=3)
    a = sum(b[1] for b in batches)
    b = sum(batches[i][1] for i in range(0, 12, 2)) + sum(batches[i][1] for i in range(1, 12, 2))
    assert a.tobytes() != b.tobytes()


def test_the_error_is_within_float32_rounding_of_the_exact_mean() -> None:
    batches = micro_batches(12, seed=5)
    got = simulate(batches, [list(exact.shard(12, r, 3)) for r in range(3)], weight=7)
    for i in range(len(SIZES)):
        ref = sum(b[i].astype(np.float64) for b in batches) / 7
        float32_sum = np.float32(0) + sum(b[i] for b in batches) / np.float32(7)
        err_exact = np.abs(got[i] - ref).max()
        err_float = np.abs(float32_sum - ref).max()
        # one rounding to float32 at the end (half an ulp of the largest), plus quanta 2**-40 below each fold's largest
        assert err_exact <= np.spacing(np.float32(np.abs(ref).max())) / 2 + 12 * 2.0**-36 * 1e2
        assert err_exact <= err_float


def test_16_bit_gradients_are_upcast_exactly() -> None:
    acc = exact.Accumulator((4,))
    g = np.array([1.5, -2.25, 0.0, 3.0], ml_dtypes.bfloat16)
    acc.measure(0, g)
    (out,) = protocol([acc], [exact.Facts([acc.word(0)])], 1)
    assert out.astype(ml_dtypes.bfloat16).tobytes() == g.tobytes()


def test_a_slot_that_spans_too_many_bits_is_refused_on_agreed_facts() -> None:
    """Folds from 2**20 down to 2**-20: more than an int64 holds at the finest quantum, whoever folded them."""
    big, small = np.full(3, 2.0**20, np.float32), np.full(3, 2.0**-20, np.float32)
    together = exact.Accumulator((3,))
    together.fold(0, big)
    together.fold(0, small)
    assert exact.Facts([together.word(0)]).overflow
    apart = [exact.Accumulator((3,)), exact.Accumulator((3,))]
    apart[0].fold(0, big)
    apart[1].fold(0, small)
    assert not any(exact.Facts([a.word(0)]).overflow for a in apart)  # each alone fits
    assert exact.Facts([a.word(0) for a in apart]).overflow  # agreed: refused alike


def test_values_that_are_not_finite_win_as_in_a_float32_sum() -> None:
    acc = [exact.Accumulator((3,)), exact.Accumulator((3,))]
    acc[0].fold(0, np.array([np.inf, 1.0, np.nan], np.float32))
    acc[1].measure(0, np.array([-np.inf, 2.0, 1.0], np.float32))
    facts = [exact.Facts([a.word(0) for a in acc])]
    assert facts[0].special
    (out,) = protocol(acc, facts, 1)
    specials = np.zeros(3, np.float32)
    for a in acc:
        a.take_specials()
        with np.errstate(invalid="ignore"):  # inf + -inf: NaN, as in a float32 sum
            specials += a.special.get(0, np.zeros(3, np.float32))
    np.copyto(out, specials, where=specials != 0)
    assert np.isnan(out[0]) and out[1] == 3.0 and np.isnan(out[2])


def test_record_words_round_trip() -> None:
    for args in [(None, -2048, 0, False, False), (-190, 128, 12, True, False), (87, 127, 1 << 20, False, True)]:
        q, top, count, special, overflow = exact.decode(exact.encode(*args))
        assert (q, special, overflow) == (args[0], args[3], args[4])
        if q is not None:
            assert (top, count) == (args[1], args[2])


def test_shard_takes_every_nth_micro_batch() -> None:
    assert [list(exact.shard(12, r, 5)) for r in range(5)] == [[0, 5, 10], [1, 6, 11], [2, 7], [3, 8], [4, 9]]
    assert sorted(i for r in range(7) for i in exact.shard(30, r, 7)) == list(range(30))
    with pytest.raises(ValueError, match="rank"):
        exact.shard(3, 2, 2)


@pytest.mark.parametrize("passes", ["numpy", "compiled"])
def test_the_compiled_passes_and_numpy_give_the_same_bits(passes: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if passes == "compiled":
        pytest.importorskip("numba")
        from mpidp.exact import compiled as exact_kernels

        monkeypatch.setattr(exact, "_kernels", exact_kernels)
    else:
        monkeypatch.setattr(exact, "_kernels", exact._NumPy)
    batches = micro_batches(12, seed=11)
    batches[3][1][[5, 9]] = [np.inf, np.nan]
    got = simulate(batches, [list(exact.shard(12, r, 3)) for r in range(3)])
    monkeypatch.setattr(exact, "_kernels", exact._NumPy)
    assert digest(got) == digest(simulate(batches, [list(exact.shard(12, r, 3)) for r in range(3)]))
