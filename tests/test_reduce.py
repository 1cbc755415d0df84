"""DataParallel.reduce on named NumPy arrays: the exact token-weighted mean, its errors, the reuse cache.

Collective tests run on every rank of COMM_WORLD (a world of one serially,
four ranks under mpiexec) and assert on every rank.
"""

from __future__ import annotations

import importlib.util
import tracemalloc
from functools import partial
from typing import Any

import numpy as np
import pytest
from conftest import same_error_everywhere, snapshot
from mpi4py import MPI
from replicas import BF16, ERROR, TRAINABLE, ZERO, grads_for, model

import mpidp
from mpidp import ContractError

#: its collective tests run again off shared memory and across simulated hosts (scripts/test: transport, hosts)
pytestmark = pytest.mark.transport


def gathered_expectation(comm: MPI.Comm, grads: dict[str, Any], weight: int) -> tuple[dict[str, np.ndarray], int]:
    """The formula, from every rank's data: sum of weighted ranks' grads / sum of weights, in float64."""
    every = comm.allgather((weight, {k: v.astype(np.float64) for k, v in grads.items()}))
    total = sum(w for w, _ in every)
    out: dict[str, np.ndarray] = {}
    for w, g in every:
        if w == 0:
            continue
        for k, v in g.items():
            out[k] = out.get(k, 0) + v
    return {k: v / total for k, v in out.items()}, total


@pytest.fixture(params=["allreduce", "reduce_scatter"])
def dp(request: pytest.FixtureRequest, comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> Any:
    """conftest's session, once with each host algorithm forced (MPIDP_REDUCTION, on every rank alike)."""
    monkeypatch.setenv("MPIDP_REDUCTION", request.param)
    params = model(100 + comm.rank)
    d = mpidp.DataParallel.initialize(params, comm, frozen=["frozen"])
    d.params = params  # type: ignore[attr-defined]
    yield d
    d.close()


TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
#: read by initialize: whose 16-bit casts a session uses
CASTS_VARIABLE = "MPIDP_CASTS"


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(got.astype(np.float64) - expected).max())
    assert err <= TOL[dtype] * scale, (dtype, err, scale)


def assert_same_on_every_rank(comm: MPI.Comm, gradients: dict[str, Any]) -> None:
    mine = {k: (v.dtype.name, np.ascontiguousarray(v).tobytes()) for k, v in gradients.items()}
    assert all(o == mine for o in comm.allgather(mine)), "results differ between ranks"


def test_reduce_is_the_exact_global_token_mean(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(7 + comm.rank)
    for window in range(4):
        grads = grads_for(dp.params, rng)
        # uneven weights; the last rank has no tokens in even windows
        weight = 0 if (comm.rank == comm.size - 1 and window % 2 == 0 and comm.size > 1) else int(rng.integers(1, 1000))
        expected, total = gathered_expectation(comm, grads, weight)
        originals = {k: id(v) for k, v in grads.items()}
        out = dp.reduce(grads, weight)
        assert out.global_weight == total
        assert sorted(out.gradients) == sorted(TRAINABLE)
        for k, v in out.gradients.items():
            assert v.dtype == dp.params[k].dtype and v.shape == dp.params[k].shape
            assert id(v) == originals[k]  # written in place into the caller's arrays
            assert_close(v, expected[k], v.dtype.name)
        assert_same_on_every_rank(comm, out.gradients)


def test_zero_weight_rank_gradients_are_ignored(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    weight = 3
    if comm.rank == comm.size - 1 and comm.size > 1:
        weight = 0
        for g in grads.values():
            g[...] = 1000  # would show if counted
    expected, total = gathered_expectation(comm, grads, weight)
    out = dp.reduce(grads, weight)
    assert out.global_weight == total == 3 * max(1, comm.size - 1)
    for k, v in out.gradients.items():
        assert_close(v, expected[k], v.dtype.name)


def test_zero_policy_and_globally_absent_entries(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    # "bias" is present only on rank 0, "half" on no rank at all
    names = [n for n in TRAINABLE if n != "half" and (n != "bias" or comm.rank == 0)]
    grads = grads_for(dp.params, rng, names)
    expected, _ = gathered_expectation(comm, grads, 5)
    out = dp.reduce(grads, 5, policy=ZERO)
    assert "half" not in out.gradients  # absent everywhere: stays absent, like .grad None
    assert sorted(out.gradients) == ["bias", "big", "brain", "embed"]
    for k, v in out.gradients.items():
        assert type(v) is np.ndarray and v.dtype == dp.params[k].dtype
        assert_close(v, expected[k], v.dtype.name)
    assert_same_on_every_rank(comm, out.gradients)


def test_absent_on_every_weighted_rank_is_absent(comm: MPI.Comm, dp: Any) -> None:
    """A gradient held only by a zero-weight rank does not make an entry present."""
    rng = np.random.default_rng(comm.rank)
    zero_rank = comm.size - 1
    names = list(TRAINABLE) if comm.rank == zero_rank else [n for n in TRAINABLE if n != "bias"]
    weight = 0 if comm.rank == zero_rank and comm.size > 1 else 2
    grads = grads_for(dp.params, rng, names)
    out = dp.reduce(grads, weight, policy=ZERO)
    assert ("bias" in out.gradients) == (comm.size == 1)


def test_tied_gradient_under_either_name(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng, [n for n in TRAINABLE if n != "embed"])
    grads["head"] = (rng.standard_normal((64, 16))).astype(np.float32)
    expected, _ = gathered_expectation(comm, {("embed" if k == "head" else k): v for k, v in grads.items()}, 1)
    out = dp.reduce(grads, 1)
    assert "head" in out.gradients and "embed" not in out.gradients
    assert_close(out.gradients["head"], expected["embed"], "float32")


def test_gradient_buffers_reduce_in_place(comm: MPI.Comm, dp: Any) -> None:
    g = dp.gradient_buffers()
    assert sorted(g) == sorted(TRAINABLE)
    assert dp.gradient_buffers()["big"] is g["big"]  # persistent
    assert all(float(np.abs(v.astype(np.float32)).max()) == 0 for v in g.values())
    rng = np.random.default_rng(comm.rank)
    for k, v in grads_for(dp.params, rng).items():
        g[k][...] = v
    expected, _ = gathered_expectation(comm, g, comm.rank + 1)
    out = dp.reduce(g, comm.rank + 1)
    for k, v in out.gradients.items():
        assert v is g[k]
        assert_close(v, expected[k], v.dtype.name)
    dp.zero_gradients()
    assert all(float(np.abs(v.astype(np.float32)).max()) == 0 for v in g.values())


def test_noncontiguous_gradient(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    grads["embed"] = np.asfortranarray(grads["embed"])
    expected, _ = gathered_expectation(comm, grads, 2)
    out = dp.reduce(grads, 2)
    assert out.gradients["embed"] is grads["embed"]
    assert_close(out.gradients["embed"], expected["embed"], "float32")


def test_weight_is_exact_python_int(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(comm.rank)
    weight = (1 << 62) // comm.size + comm.rank
    out = dp.reduce(grads_for(dp.params, rng), np.uint64(weight))
    assert out.global_weight == sum(comm.allgather(weight))
    assert type(out.global_weight) is int


def test_reduce_allocates_no_model_sized_memory_after_the_first_window(comm: MPI.Comm) -> None:
    rng = np.random.default_rng(comm.rank)
    params = {f"w{i}": rng.standard_normal(400_000).astype(np.float32) for i in range(5)}
    params.update({f"b{i}": rng.standard_normal(200_000).astype(BF16) for i in range(3)})
    params.update({f"s{i}": rng.standard_normal(100).astype(np.float32) for i in range(20)})
    model_bytes = sum(v.nbytes for v in params.values())
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=1 << 20) as dp:
        grads = {k: np.ones_like(v) for k, v in params.items()}
        dp.reduce(grads, 1)
        tracemalloc.start()
        try:
            dp.reduce(grads, 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < model_bytes / 8, (peak, model_bytes)


def _grads_unknown(dp: Any, g: dict[str, Any]) -> None:
    g["nope"] = np.zeros(3, np.float32)


def _grads_frozen(dp: Any, g: dict[str, Any]) -> None:
    g["frozen"] = np.zeros(4, np.float32)


def _grads_shape(dp: Any, g: dict[str, Any]) -> None:
    g["bias"] = np.zeros(6, np.float32)


def _grads_dtype(dp: Any, g: dict[str, Any]) -> None:
    g["half"] = g["half"].astype(np.float32)


def _grads_missing(dp: Any, g: dict[str, Any]) -> None:
    del g["brain"]


def _grads_two_for_a_tie(dp: Any, g: dict[str, Any]) -> None:
    g["head"] = g["embed"].copy()


def _grads_not_array(dp: Any, g: dict[str, Any]) -> None:
    g["bias"] = 3.0


def _params_replaced(dp: Any, g: dict[str, Any]) -> None:
    dp.params["bias"] = dp.params["bias"].copy()


def _params_added(dp: Any, g: dict[str, Any]) -> None:
    dp.params["extra"] = np.zeros(1, np.float32)


REDUCE_ERRORS: dict[str, tuple[Any, Any, str]] = {
    "unknown": (_grads_unknown, 1, "gradient for unknown parameter 'nope'"),
    "frozen": (_grads_frozen, 1, "gradient for frozen parameter 'frozen'"),
    "shape": (_grads_shape, 1, "gradient 'bias': shape (6,) differs from its parameter's (7,)"),
    "dtype": (_grads_dtype, 1, "gradient 'half': dtype float32 differs from its parameter's float16"),
    "missing": (_grads_missing, 1, "parameter 'brain' has no gradient (policy ERROR, local weight 1)"),
    "tie": (_grads_two_for_a_tie, 1, "two gradients for one tied array: 'embed' and 'head'"),
    "not an array": (_grads_not_array, 1, "gradient 'bias' is a float, not an array"),
    "replaced": (_params_replaced, 1, "parameter 'bias' was replaced or removed after initialize"),
    "added": (_params_added, 1, "the parameter mapping changed after initialize: 8 names, expected 7"),
    "negative": (None, -1, "local_weight -1 is outside [0, 2**64 - 1]"),
    "too big": (None, 1 << 64, f"local_weight {1 << 64} is outside"),
    "float": (None, 2.0, "local_weight must be a non-negative int, got float 2.0"),
    "bool": (None, True, "local_weight must be a non-negative int, got bool True"),
}


@pytest.mark.parametrize("case", sorted(REDUCE_ERRORS))
def test_reduce_refuses_bad_input_on_every_rank(comm: MPI.Comm, dp: Any, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    spoil, bad_weight, fragment = REDUCE_ERRORS[case]
    rng = np.random.default_rng(comm.rank)
    grads = grads_for(dp.params, rng)
    weight: Any = 1
    saved_params = dict(dp.params)
    if mine:
        if spoil is not None:
            spoil(dp, grads)
        weight = bad_weight
    before = snapshot({k: v for k, v in grads.items() if isinstance(v, np.ndarray)})
    before_params = snapshot({k: v for k, v in dp.params.items()})
    same_error_everywhere(comm, lambda: dp.reduce(grads, weight), ContractError, f"rank {bad}: {fragment}")
    assert snapshot({k: v for k, v in grads.items() if isinstance(v, np.ndarray)}) == before
    assert snapshot({k: v for k, v in dp.params.items()}) == before_params
    # every rank stopped at the same point: the next good window works everywhere
    dp.params.clear()
    dp.params.update(saved_params)
    out = dp.reduce(grads_for(dp.params, rng), 1)
    assert out.global_weight == comm.size


def test_reduce_refuses_a_zero_global_weight(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 0), ContractError, "the global weight is 0")
    assert snapshot(grads) == before


def test_reduce_refuses_a_bad_policy(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(0))
    policy: Any = "ZERO" if mine else ERROR
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, policy), ContractError, f"rank {bad}: policy must be a MissingGradientPolicy, got 'ZERO'"
    )


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_ranks_disagreeing_on_policy(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    policy = ZERO if comm.rank == comm.size - 1 else ERROR
    before = snapshot(grads)
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, policy), ContractError,
        f"ranks disagree on the missing-gradient policy: rank 0 uses ERROR, rank {comm.size - 1} uses ZERO",
    )
    assert snapshot(grads) == before


@pytest.mark.mpi(min_size=2)
def test_a_step_catches_a_rank_that_skipped_a_reduce(comm: MPI.Comm, dp: Any) -> None:
    """The issue's case: rank 1 skips step 2; with step= every rank raises at that exchange, nothing moved."""
    grads = grads_for(dp.params, np.random.default_rng(0))
    reached: list[int] = []

    def train() -> None:
        for step in range(6):
            if comm.rank == 1 and step == 2:
                continue
            before = snapshot(grads)
            reached.append(step)
            try:
                dp.reduce(grads, 100 + comm.rank, step=step)
            except ContractError:
                assert snapshot(grads) == before
                raise

    same_error_everywhere(comm, train, ContractError, "rank 1 is at step 3, rank 0 at step 2: a rank skipped or repeated a reduce")
    assert reached == ([0, 1, 3] if comm.rank == 1 else [0, 1, 2])
    dp.reduce(grads, 1, step=7)  # the session goes on once the ranks are in step again


@pytest.mark.mpi(min_size=2)
def test_a_step_catches_a_rank_that_repeated_a_reduce(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    dp.reduce(grads, 1, step=0)
    last = comm.size - 1
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, step=0 if comm.rank == last else 1), ContractError,
        f"rank {last} is at step 0, rank 0 at step 1: a rank skipped or repeated a reduce",
    )


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_a_step_on_some_ranks_only(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    last = comm.size - 1
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, step=None if comm.rank == last else 4), ContractError,
        f"rank {last} passed no step, rank 0 step 4: pass step= to reduce on every rank or on none",
    )
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1, step=5 if comm.rank == last else None), ContractError,
        f"rank {last} passed step 5, rank 0 no step",
    )
    dp.reduce(grads, 1)  # None on every rank: nothing to compare


@pytest.mark.parametrize("step", [True, -1, 2.0, "3", 2**64 - 1])
def test_reduce_refuses_a_bad_step_everywhere(comm: MPI.Comm, dp: Any, where: tuple[bool, int], step: Any) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(0))
    message = same_error_everywhere(comm, lambda: dp.reduce(grads, 1, step=step if mine else 0), ContractError, f"rank {bad}: step")
    assert repr(step) in message or str(step) in message


def test_reduce_takes_numpy_integer_steps(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    dp.reduce(grads, 1, step=np.int64(9) if comm.rank % 2 else 9)


@pytest.mark.mpi(min_size=2)
def test_reduce_refuses_a_global_weight_beyond_64_bits(comm: MPI.Comm, dp: Any) -> None:
    grads = grads_for(dp.params, np.random.default_rng(0))
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1 << 63), ContractError, "does not fit in 64 bits")


def test_reduce_refuses_a_gradient_on_another_device(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    torch = pytest.importorskip("torch")
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(0))
    if mine:
        grads["bias"] = torch.empty(7, dtype=torch.float32, device="meta")
    same_error_everywhere(
        comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradient 'bias': device meta:0 differs from its parameter's cpu"
    )


def test_reduce_refuses_gradients_that_share_memory(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    if mine:
        grads["bias"] = grads["big"][:7]  # a view into another gradient
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradients 'bias' and 'big' share memory")
    assert snapshot(grads) == before


def test_reduce_refuses_the_same_array_twice(comm: MPI.Comm, where: tuple[bool, int]) -> None:
    mine, bad = where
    with mpidp.DataParallel.initialize({"a": np.zeros(5, np.float32), "b": np.zeros(5, np.float32)}, comm) as two:
        z = np.zeros(5, np.float32)
        g = {"a": z, "b": z} if mine else {"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)}
        same_error_everywhere(comm, lambda: two.reduce(g, 1), ContractError, f"rank {bad}: gradients 'a' and 'b' are the same array")


def test_read_only_gradient_is_refused(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    if mine:
        grads["big"].flags.writeable = False
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradient 'big': it is read-only")


def test_plan_cache_stays_small(comm: MPI.Comm, dp: Any) -> None:
    rng = np.random.default_rng(1)  # the same presence pattern on every rank
    for _ in range(40):
        names = [n for n in TRAINABLE if rng.random() < 0.6] or ["big"]
        dp.reduce(grads_for(dp.params, np.random.default_rng(comm.rank), names), 1, ZERO)
    assert len(dp._cache.plans) <= 8


def _freeze_big(g: dict[str, Any]) -> None:
    g["big"].flags.writeable = False


def _reshape_in_place(g: dict[str, Any]) -> None:
    g["big"].shape = (1000, 300)


def _restride_in_place(g: dict[str, Any]) -> None:
    import warnings

    with warnings.catch_warnings():  # deprecated in NumPy 2.4, still possible
        warnings.simplefilter("ignore", DeprecationWarning)
        g["embed"].strides = (4, 64 * 4)  # the transpose's layout, under the same object


CHANGED_IN_PLACE = {
    "read-only": (_freeze_big, "gradient 'big': it is read-only"),
    "reshaped": (_reshape_in_place, "gradient 'big': shape (1000, 300) differs from its parameter's (300000,)"),
    "restrided": (_restride_in_place, "gradient 'embed'"),
}


@pytest.mark.parametrize("case", sorted(CHANGED_IN_PLACE))
def test_gradients_accepted_before_are_checked_again_when_changed_in_place(
    comm: MPI.Comm, dp: Any, where: tuple[bool, int], case: str
) -> None:
    """Passing the same arrays every window is the fast path; changing one of them in place is still caught."""
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # the same objects, unchanged: accepted again
    change, fragment = CHANGED_IN_PLACE[case]
    if mine:
        change(grads)
    if case == "restrided":  # a legal but different layout: reduced correctly, not refused
        expected, _ = gathered_expectation(comm, grads, 1)
        out = dp.reduce(grads, 1)
        assert_close(out.gradients["embed"], expected["embed"], "float32")
        assert_same_on_every_rank(comm, out.gradients)
        return
    before = snapshot(grads)
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: {fragment}")
    assert snapshot(grads) == before


def test_gradients_accepted_before_and_now_sharing_memory_are_refused(comm: MPI.Comm, dp: Any, where: tuple[bool, int]) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    if mine:
        grads["bias"] = grads["big"][:7]
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: gradients 'bias' and 'big' share memory")


def test_accepted_gradients_are_not_kept_alive(comm: MPI.Comm, dp: Any) -> None:
    """A caller who allocates new gradients every window does not pay for the last window's."""
    import weakref

    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    ref = weakref.ref(grads["big"])
    del grads
    assert ref() is None


def _same_arrays(dp: Any, layout: str) -> dict[str, Any]:
    """Gradient arrays a caller keeps and refills every window."""
    if layout == "buffers":
        return dp.gradient_buffers()
    grads = {n: np.zeros(dp.params[n].shape, dp.params[n].dtype) for n in TRAINABLE}
    if layout == "one strided":
        grads["embed"] = np.zeros((16, 64), np.float32).T  # not C-contiguous: staged through a copy
    return grads


#: (weight of rank 0, weight of the last rank, names rank 0 leaves out) per window
WINDOWS = [(3, 4, ()), (5, 1, ()), (2, 9, ()), (6, 0, ()), (7, 2, ()), (1, 1, ("bias",)), (4, 3, ()), (8, 5, ()), (2, 2, ())]


@pytest.mark.parametrize("layout", ["separate", "one strided", "buffers"])
def test_the_same_gradients_reduce_like_new_ones_window_after_window(comm: MPI.Comm, dp: Any, layout: str) -> None:
    """The second window in a row on the same arrays keeps its cut views; later windows reuse them.

    Every window, the arrays are refilled in place and reduced, and a second
    session reduces fresh copies of the same values: the results must be
    bitwise equal, through weight-0 windows, a missing gradient and back.
    """
    fresh = mpidp.DataParallel.initialize(model(100 + comm.rank), comm, frozen=["frozen"])
    grads = _same_arrays(dp, layout)
    rng = np.random.default_rng(comm.rank)
    try:
        for first, last, absent in WINDOWS:
            weight = first if comm.rank == 0 else last if comm.rank == comm.size - 1 else 3
            values = grads_for(dp.params, rng)
            for name in TRAINABLE:
                grads[name][...] = values[name]
            mine = {n: g for n, g in grads.items() if not (comm.rank == 0 and n in absent)}
            out = dp.reduce(mine, weight, ZERO)
            want = fresh.reduce({n: v for n, v in values.items() if n in mine}, weight, ZERO)
            assert out.global_weight == want.global_weight
            assert sorted(out.gradients) == sorted(want.gradients)
            assert len(out.gradients) == len(TRAINABLE) - (len(absent) if comm.size == 1 else 0)  # absent everywhere alone
            for name in out.gradients:
                if name in mine:
                    assert out.gradients[name] is grads[name]  # written in place, as always
                assert snapshot({name: out.gradients[name]}) == snapshot({name: want.gradients[name]}), (name, weight)
            out.gradients.clear()  # the caller's dict to keep: clearing it changes no later window
    finally:
        fresh.close()


def test_the_same_gradients_are_released_when_the_caller_moves_on(comm: MPI.Comm, dp: Any) -> None:
    """Reused arrays are referenced until the next window on other arrays, not longer."""
    import weakref

    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(grads, 1)
    dp.reduce(grads, 1)  # the second window in a row: its views are kept
    ref = weakref.ref(grads["big"])
    del grads
    dp.reduce(grads_for(dp.params, np.random.default_rng(comm.rank)), 1)
    assert ref() is None
    bad = comm.size - 1
    for weights, message in [((1, -1), f"rank {bad}: local_weight"), ((0, 0), "the global weight is 0")]:
        kept = grads_for(dp.params, np.random.default_rng(comm.rank))
        dp.reduce(kept, 1)
        dp.reduce(kept, 1)
        ref = weakref.ref(kept["big"])
        weight = weights[comm.rank == bad]
        same_error_everywhere(comm, partial(dp.reduce, kept, weight), ContractError, message)  # or a window that fails
        del kept
        assert ref() is None, message
    kept = grads_for(dp.params, np.random.default_rng(comm.rank))
    dp.reduce(kept, 1)
    dp.reduce(kept, 1)
    ref = weakref.ref(kept["big"])
    del kept
    dp.close()  # or close the session
    assert ref() is None


def test_a_kept_result_is_not_changed_by_later_windows(comm: MPI.Comm, dp: Any) -> None:
    """The result of each window is the caller's: later windows on the same arrays leave its dict alone."""
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    results = [dp.reduce(grads, 1) for _ in range(4)]  # the third and fourth rerun kept views
    for r in results:
        assert sorted(r.gradients) == sorted(TRAINABLE)  # the same names, nothing added
        assert all(v is grads[n] for n, v in r.gradients.items())
    results[2].gradients.pop("big")
    results[2].gradients["extra"] = None
    again = dp.reduce(grads, 1)
    assert sorted(again.gradients) == sorted(TRAINABLE)
    assert sorted(results[3].gradients) == sorted(TRAINABLE)


def test_gradient_buffers_restrided_in_place_reduce_correctly(comm: MPI.Comm, dp: Any) -> None:
    """mpidp prepares its flat-storage views once; one the caller re-strides still reduces correctly."""
    import warnings

    bufs = dp.gradient_buffers()
    rng = np.random.default_rng(comm.rank)
    for g in grads_for(dp.params, rng).items():
        bufs[g[0]][...] = g[1]
    dp.reduce(bufs, 1)
    for name, g in grads_for(dp.params, rng).items():
        bufs[name][...] = g
    with warnings.catch_warnings():  # deprecated in NumPy 2.4, still possible
        warnings.simplefilter("ignore", DeprecationWarning)
        bufs["embed"].strides = (4, 64 * 4)
    expected, _ = gathered_expectation(comm, bufs, 1)
    out = dp.reduce(bufs, 1)
    for name in TRAINABLE:
        assert_close(out.gradients[name], expected[name], str(dp.params[name].dtype))
    assert_same_on_every_rank(comm, out.gradients)


# ------------------------------------------ array properties ranks need not share


def _unaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` one byte off any alignment (what a view into a byte buffer can be)."""
    u = np.empty(a.nbytes + 1, np.uint8)[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def _interleaved(g: dict[str, Any]) -> dict[str, Any]:
    """'big' and 'bias' interleaved in one buffer (no element shared), 'embed' in Fortran order, 'half' reversed."""
    buf = np.zeros(2 * g["big"].size, np.float32)
    big, bias = buf[0::2], buf[1:14:2]
    big[...], bias[...] = g["big"], g["bias"]
    half = np.zeros_like(g["half"])[::-1, ::-1]
    half[...] = g["half"]
    return {**g, "big": big, "bias": bias, "embed": np.asfortranarray(g["embed"]), "half": half}


ODD_ARRAYS = {
    "unaligned": lambda g: {k: _unaligned(v) for k, v in g.items()},  # the large one goes through the stage
    "matrix": lambda g: {k: np.asmatrix(v) if v.ndim == 2 else v for k, v in g.items()},
    "interleaved and strided": _interleaved,
}


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("reduction", ["auto", "reduce_scatter"])
@pytest.mark.parametrize("chunk_bytes", [4096, 4 << 20])
@pytest.mark.parametrize("case", sorted(ODD_ARRAYS))
def test_gradients_of_any_layout_give_the_bits_of_plain_ones(
    comm: MPI.Comm, where: tuple[bool, int], case: str, chunk_bytes: int, reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unaligned, np.matrix, interleaved and strided gradients, on one rank or all: the same bits as plain arrays.

    The small chunks cast 16-bit segments with torch where it is installed, the large ones without it
    (NumPy's casts in auto mode; numba's, where installed, in forced reduce-scatter mode).
    Forced reduce-scatter hands unaligned float32 to MPI only through its buffer.
    """
    mine, _ = where
    monkeypatch.setenv("MPIDP_REDUCTION", reduction)
    if chunk_bytes == 4096 and importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401 - packing casts long 16-bit segments with torch once it is imported
    else:  # without torch: NumPy's casts, or numba's where installed in the reduce-scatter cases
        numba = reduction != "auto" and importlib.util.find_spec("numba") is not None
        monkeypatch.setenv(CASTS_VARIABLE, "numba" if numba else "numpy")  # read by initialize
    wide = {"wide": np.zeros((64, 100), np.float32), "wide16": np.zeros((64, 100), np.float16), "wideb": np.zeros((64, 100), BF16)}
    params = {**model(100 + comm.rank), **wide}  # 2-D, several calls of their own at 4 KiB, long 16-bit segments
    with mpidp.DataParallel.initialize(params, comm, frozen=["frozen"], chunk_bytes=chunk_bytes) as dp:
        values = grads_for(params, np.random.default_rng(comm.rank), (*TRAINABLE, *wide))
        plain = {k: v.copy() for k, v in values.items()}
        expected = snapshot(dp.reduce(plain, 3 + comm.rank).gradients)
        odd = ODD_ARRAYS[case]({k: v.copy() for k, v in values.items()}) if mine else {k: v.copy() for k, v in values.items()}
        for _ in range(3):  # the second window on the same arrays keeps its cut views: the third reuses them
            for k, v in odd.items():
                v[...] = values[k]
            out = dp.reduce(odd, 3 + comm.rank).gradients
            assert all(out[k] is odd[k] for k in odd)  # written in place
            assert snapshot({k: np.asarray(v) for k, v in out.items()}) == expected
        assert_same_on_every_rank(comm, {k: np.asarray(v) for k, v in out.items()})


@pytest.mark.parametrize("reduction", ["allreduce", "reduce_scatter"])
def test_ranks_on_different_casts_reduce_to_the_same_bits(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    """MPIDP_CASTS is this rank's choice (not agreed): NumPy's, numba's and torch's (when imported) casts give the same bits."""
    monkeypatch.setenv("MPIDP_REDUCTION", reduction)
    numba = "numba" if importlib.util.find_spec("numba") is not None else "numpy"
    monkeypatch.setenv("MPIDP_CASTS", ("numpy", numba, "auto")[comm.rank % 3])
    shapes = {"h": (70_000, np.float16), "b": (50_000, BF16), "f": (9_000, np.float32)}
    params = {k: np.zeros(n, d) for k, (n, d) in shapes.items()}
    rng = np.random.default_rng(1)  # the same on every rank: the expected values are the one process's
    every = [{k: rng.integers(-40, 40, n).astype(d) for k, (n, d) in shapes.items()} for _ in range(comm.size)]
    weight = sum(range(3, 3 + comm.size))
    expected = {k: (sum(g[k].astype(np.float32) for g in every) / np.float32(weight)).astype(d) for k, (_, d) in shapes.items()}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        out = dp.reduce({k: v.copy() for k, v in every[comm.rank].items()}, 3 + comm.rank).gradients
    assert snapshot(out) == snapshot(expected)  # small integers: every float32 sum is exact, in any order


def test_an_unknown_casts_mode_is_one_error(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(CASTS_VARIABLE, "gpu")
    params = model(comm.rank)
    before = snapshot(params)
    same_error_everywhere(
        comm, partial(mpidp.DataParallel.initialize, params, comm), ContractError,
        f"rank {comm.size - 1}: MPIDP_CASTS must be one of auto, numba, numpy, got 'gpu'",
    )
    assert snapshot(params) == before


def _self_overlapping(g: dict[str, Any]) -> None:
    g["bias"] = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(7,), strides=(0,))


REFUSED_ARRAYS = {
    "self-overlapping": (_self_overlapping, "gradient 'bias': its elements overlap in memory (shape (7,), strides (0,)"),
    "masked": (lambda g: g.update(bias=np.ma.masked_array(g["bias"])), "gradient 'bias': it is a masked array"),
    "byte-swapped": (lambda g: g.update(big=g["big"].astype(">f4")), "gradient 'big': dtype >f4 differs from its parameter's float32"),
    "read-only": (_freeze_big, "gradient 'big': it is read-only"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_ARRAYS))
def test_gradients_mpidp_cannot_take_are_one_error_everywhere(comm: MPI.Comm, dp: Any, where: tuple[bool, int], case: str) -> None:
    mine, bad = where
    grads = grads_for(dp.params, np.random.default_rng(comm.rank))
    spoil, fragment = REFUSED_ARRAYS[case]
    if mine:
        spoil(grads)
    before = snapshot({k: np.asarray(v) for k, v in grads.items()})
    same_error_everywhere(comm, lambda: dp.reduce(grads, 1), ContractError, f"rank {bad}: {fragment}")
    assert snapshot({k: np.asarray(v) for k, v in grads.items()}) == before
