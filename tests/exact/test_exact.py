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


# ------------------------------------------------------------------ the routes (issue 41)

ROUTES = ["numpy", "torch", "numba"]
#: slots of the hard folds: dtype, size (one over torch's block of 65,536 values), kind of values
HARD = (
    (np.float32, 7, "normal"), (np.float32, 70003, "normal"), (np.float32, 1, "normal"), (np.float32, 300, "largest"),
    (np.float32, 70001, "subnormal"), (ml_dtypes.bfloat16, 5000, "normal"), (np.float16, 5000, "float16"), (np.float32, 1000, "spread"),
)


def use(route: str) -> str:
    """``route`` where this process has it (skipped where not): its MPIDP_EXACT_KERNELS value."""
    if route != "numpy":
        pytest.importorskip(route)
    assert exact.route(route) == route
    return route


def hard_folds(count: int = 12) -> list[list[np.ndarray]]:
    """Micro-batches of HARD: subnormals, the largest exponents, inf and NaN, 16-bit values, spreads that need int64."""
    rng = np.random.default_rng(41)
    out = []
    for b in range(count):
        folds = []
        for dtype, n, kind in HARD:
            x = rng.standard_normal(n) * 10.0 ** rng.uniform(-1, 1)
            if kind == "largest":  # up to float32's largest finite value
                x = rng.uniform(-1, 1, n) * 3.4028235e38 * 2.0 ** -rng.integers(0, 6)
            elif kind == "subnormal":  # float32 subnormals only: scales of 2**185
                x = rng.integers(-(1 << 23), 1 << 23, n) * 2.0**-149 * 2.0 ** -rng.integers(0, 8)
            elif kind == "float16":  # float16 subnormals to its largest value
                x = rng.choice([-65504.0, 6e-8, -3e-7, 0.0, 1.5, 1e-5], n) * rng.uniform(0.5, 1, n)
            elif kind == "spread":  # 2**0 .. 2**21 over the micro-batches: more than 53 bits, less than 62
                x = x / 10.0 ** np.log10(np.abs(x).max()) * 2.0 ** (b * 21 // (count - 1))
            folds.append(x.astype(dtype))
        if b == 3:
            folds[3][[5, 9]] = [np.inf, np.nan]
            folds[5][7] = np.nan
            folds[6][2] = -np.inf
        if b == 5:
            folds[1][:40] = np.float32(1e-40)  # subnormals beside normal values (below the quantum: zero)
            folds[2][0] = -0.0
        out.append(folds)
    return out


def run_route(route: str, batches: list[list[np.ndarray]], groups: list[list[int]], chunk: int = 4099) -> dict[str, bytes]:
    """The protocol by hand on ``route``'s passes, chunk by chunk (cuts inside tensors): every byte it makes."""
    sizes = [n for _, n, _ in HARD]
    ranks = [exact.Accumulator(sizes, list(reversed(range(len(sizes)))), mode=route) for _ in groups]
    for acc, members in zip(ranks, groups):
        for j, b in enumerate(members):
            for i, g in enumerate(batches[b]):
                (acc.fold if j < len(members) - 1 else acc.measure)(i, g)
    facts = [exact.Facts([acc.word(i) for acc in ranks]) for i in range(len(sizes))]  # a rank without the slot: word 0
    assert not any(f.overflow for f in facts)
    acc = ranks[0]
    ints, doubles = np.zeros(acc.total, np.int64), np.zeros(acc.total, np.float64)
    via_ints, via_doubles = np.empty(acc.total, np.float32), np.zeros(acc.total, np.float32)
    narrow, thin, via_thin, wire = np.zeros(acc.total, bool), np.zeros(acc.total, bool), np.zeros(acc.total, np.float32), []
    for lo in range(0, acc.total, chunk):
        hi = min(lo + chunk, acc.total)
        if acc.thin(lo, hi, facts):  # one fold per rank: float32 on the wire, the owner sums in float64
            parts = np.empty((len(ranks), hi - lo), np.float32)
            for j, r in enumerate(ranks):
                r.pack32(lo, hi, facts, parts[j])
            acc.combine(lo, hi, facts, parts, 7, via_thin[lo:hi])
            thin[lo:hi] = True
            wire.append(parts.tobytes())
        for r in ranks:
            packed = np.empty(hi - lo, np.int64)
            r.pack(lo, hi, facts, packed)
            ints[lo:hi] += packed
            if acc.floats(lo, hi, facts):
                as_doubles = np.empty(hi - lo, np.float64)
                r.pack(lo, hi, facts, as_doubles)
                doubles[lo:hi] += as_doubles
        acc.unpack(lo, hi, facts, ints[lo:hi], 7, via_ints[lo:hi])
        if acc.floats(lo, hi, facts):
            acc.unpack(lo, hi, facts, doubles[lo:hi], 7, via_doubles[lo:hi])
            narrow[lo:hi] = True
    for r in ranks:
        r.take_specials()
    specials = b"".join(r.special[i].tobytes() for r in ranks for i in sorted(r.special))
    for i, (a, b) in enumerate(acc.bounds):  # inf and NaN win (summed apart in float32)
        kept = sum((r.special[i] for r in ranks if i in r.special), np.zeros(b - a, np.float32))
        np.copyto(via_ints[a:b], kept, where=kept != 0)
    words = np.array([r.word(i) for r in ranks for i in range(len(sizes))], np.uint64)
    return {"words": words.tobytes(), "ints": ints.tobytes(), "results": via_ints.tobytes(), "specials": specials,
            "doubles": doubles.tobytes(), "via_doubles": via_doubles.tobytes(), "narrow": narrow.tobytes(),
            "thin": thin.tobytes(), "via_thin": via_thin.tobytes(), "wire": b"".join(wire)}


def test_where_numba_is_absent_a_process_that_imported_torch_gets_torch_s_passes() -> None:
    """A process with torch and without numba (scripts/test hides numba in one run): torch's passes, not NumPy's."""
    pytest.importorskip("torch")
    try:
        import numba  # noqa: F401
    except ImportError:
        assert exact.route() == "torch" and exact.kernels().__name__ == "mpidp.exact.torch_passes"
    else:
        assert exact.route() == "numba"
    assert exact.route("numpy") == "numpy" and exact.route("torch") == "torch"


@pytest.mark.parametrize("route", ROUTES)
def test_one_fold_per_rank_crosses_as_float32_and_sums_to_the_int64_bits_on_every_route(route: str) -> None:
    """Twelve ranks of one micro-batch each: the float32 exchange (Accumulator.thin) gives the int64 results bit for bit, and
    every route puts the same float32 bytes on the wire (ranks may run different routes)."""
    batches = hard_folds()
    groups = [[b] for b in range(12)]
    got, ref = run_route(use(route), batches, groups), run_route("numpy", batches, groups)
    assert got == ref, [key for key in got if got[key] != ref[key]]
    results, via_thin = np.frombuffer(got["results"], np.float32), np.frombuffer(got["via_thin"], np.float32)
    thin = np.frombuffer(got["thin"], bool)
    assert 0.3 < thin.mean() < 1  # both ran: the spread slot spans more than 53 bits
    finite = thin & np.isfinite(results)  # where no inf or NaN won (they are summed apart)
    assert results[finite].tobytes() == via_thin[finite].tobytes()
    wire = np.frombuffer(got["wire"], np.float32)
    assert not np.signbit(wire[wire == 0]).any() and np.array_equal(wire, np.rint(wire))  # integers, no -0.0 sent


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_gives_the_same_sums_and_results_bit_for_bit(route: str) -> None:
    batches = hard_folds()
    groups = [list(exact.shard(12, r, 3)) for r in range(3)]
    got, ref = run_route(use(route), batches, groups), run_route("numpy", batches, groups)
    assert got.keys() == ref.keys()
    for key in got:
        assert got[key] == ref[key], f"{route}: {key} differ from NumPy's"
    # float64 sums of the chunks that allow them are the int64 sums, and convert to the same bits
    ints, doubles = np.frombuffer(got["ints"], np.int64), np.frombuffer(got["doubles"], np.float64)
    results, via_doubles = np.frombuffer(got["results"], np.float32), np.frombuffer(got["via_doubles"], np.float32)
    narrow = np.frombuffer(got["narrow"], bool) & np.isfinite(results)  # float64 chunks, where no inf or NaN won
    assert np.array_equal(ints[narrow].astype(np.float64), doubles[narrow])
    assert results[narrow].tobytes() == via_doubles[narrow].tobytes()
    assert not np.signbit(doubles[doubles == 0]).any()  # no -0.0: a float64 zero has the int64 zero's bits after conversion
    assert 0.5 < np.frombuffer(got["narrow"], bool).mean() < 1  # both paths ran: the spread slot needs int64
    assert np.isnan(np.frombuffer(got["results"], np.float32)).any()  # the NaN won where it was


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("threads", [1, 2])
def test_each_pass_of_each_route_is_numpy_s_bitwise(route: str, threads: int) -> None:
    """The passes alone, on values that stress them: int64 sums beyond 2**53 (rounded), -0.0, scales past float32's range."""
    k, ref = exact.kernels(use(route)), exact._NumPy
    torch = pytest.importorskip("torch") if threads > 1 else None
    before = torch.get_num_threads() if torch else 0
    if torch:
        torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(5)
        n = 70001
        bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        finite = bits & np.uint32(0x7FFFFFFF) < 0x7F800000
        for b in (bits[finite], bits, np.zeros(3, np.uint32), np.array([0x80000000, 1, 0x80000002], np.uint32), bits[:0]):
            assert k.maxabs(b) == ref.maxabs(b)
        x = rng.standard_normal(n) * 2.0 ** rng.integers(-30, 0, n)
        x = x / np.abs(x).max() / 2  # below 1: x * 2**36 below 2**36, as measured() makes them
        x[:8] = np.array([0.5, -0.0, 0.0, 0.5, -0.5, 1.5, -2.5, 2.5]) * [1, 1, 1, *[2.0**-36] * 5]  # ties: half to even; signed zeros
        acc = rng.integers(-(1 << 40), 1 << 40, n)
        subnormal = rng.integers(-(1 << 23), 1 << 23, n) * 2.0**-149
        cases = [(2.0**-92, 0, acc[:0], 0), (2.0**5, 3, acc, 2), (2.0**162, 0, acc, 0), (2.0**185, 1, acc[:0], 0), (1.0, 0, acc, 5)]
        for scale, t, a, s in cases:  # values below 2**36 / scale, as measured() gives them (2**185: only +-2**-149)
            y = np.float32(x * 2**36 / scale) if scale <= 2.0**127 else subnormal if scale < 2.0**185 else np.sign(x) * 2.0**-149
            y = np.asarray(y, np.float32)
            y[:2] = [-0.0, np.float32(2.0**-149)]
            for empty in (False, True):
                xs = y[:0] if empty else y
                outs = [np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n), np.empty(n)]
                k.pack(xs, scale, t, a, s, outs[0])
                ref.pack(xs, scale, t, a, s, outs[1])
                k.pack_float(xs, scale, 2.0**t, a, 2.0**s, outs[2])
                ref.pack_float(xs, scale, 2.0**t, a, 2.0**s, outs[3])
                assert outs[0].tobytes() == outs[1].tobytes() and outs[2].tobytes() == outs[3].tobytes()
        if route == "torch":  # what unpack's bits rest on: torch divides float64 by a scalar correctly rounded, as NumPy
            import torch as t

            d = rng.standard_normal(n) * 1e10
            assert t.div(t.from_numpy(d), 7.0).numpy().tobytes() == (d / 7.0).tobytes()
        sums = rng.integers(-(1 << 62), 1 << 62, n)
        sums[:4] = [(1 << 53) + 1, -(1 << 60) - 3, 0, (1 << 62) - 1]
        doubles = rng.integers(-(1 << 53), 1 << 53, n).astype(np.float64)
        for scale, weight in [(2.0**-40, 7.0), (2.0**-184, 3.0), (2.0**70, 12345.0), (1.0, 2.0**64)]:
            mine, theirs = np.empty(n, np.float32), np.empty(n, np.float32)
            for pass_, values in (("unpack", sums), ("unpack_float", doubles)):
                getattr(k, pass_)(values, scale, weight, mine)
                getattr(ref, pass_)(values, scale, weight, theirs)
                assert mine.tobytes() == theirs.tobytes(), (pass_, scale, weight)
    finally:
        if torch:
            torch.set_num_threads(before)
