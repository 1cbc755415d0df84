"""The sharded optimizer, collective: the same bits at every world size (exact), equal replicas, errors on every rank.

Serially a world of one; under ``mpiexec -n 4`` four ranks, and three,
two and one split from them. The flat sizes put slice cuts inside tensors
and off every SIMD width (1, 7, 99, 1000003 values, and a bfloat16 one).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import first_ranks, same_error_everywhere, snapshot
from mpi4py import MPI

import mpidp
import mpidp.optim as mo
from mpidp import ContractError
from mpidp.exact import shard
from mpidp.optim import norm, rules

BF16 = np.dtype(ml_dtypes.bfloat16)
MICRO = 5  # micro-batches per window
SHAPES = {"a": (1,), "b": (7,), "c": (33, 3), "d": (1000003,)}


def params(big: bool = True, half: bool = True, d: int = SHAPES["d"][0]) -> dict[str, np.ndarray]:
    """The parameters: ``d`` (``big``) of ``d`` values, and a bfloat16 ``h`` (``half``)."""
    rng = np.random.default_rng(1)
    out = {k: rng.standard_normal((d,) if k == "d" else s).astype(np.float32) for k, s in SHAPES.items() if big or k != "d"}
    if half:
        out["h"] = rng.standard_normal(65).astype(BF16)
    return out


def micro(p: dict[str, np.ndarray], step: int, i: int) -> dict[str, np.ndarray]:
    """Micro-batch ``i``'s gradient (a loss sum) at ``step``: the same on every rank that takes it."""
    rng = np.random.default_rng(1000 * step + i)
    return {k: (rng.standard_normal(v.shape) * (i + 1)).astype(v.dtype) for k, v in p.items()}


def sha(p: dict[str, np.ndarray]) -> str:
    return hashlib.sha256(b"".join(p[k].tobytes() for k in sorted(p))).hexdigest()


GROUPS = [{"params": ["a", "c", "d"]}, {"params": ["b"], "weight_decay": 0.0, "lr": 3e-2}]


def run_exact(comm: MPI.Comm, kind: str, steps: int, max_norm: float | None, big: bool = True, half: bool = True) -> str:
    """Train ``steps`` exact windows with the sharded ``kind``; the parameters' SHA-256."""
    p = params(big, half)
    groups = GROUPS + ([{"params": ["h"]}] if half else [])
    if not big:
        groups = [{"params": ["a", "c"]}, *groups[1:]]
    kw: dict[str, Any] = {"momentum": 0.9, "nesterov": True} if kind == "sgd" else {"amsgrad": kind == "adam"}
    with mpidp.DataParallel.initialize(p, comm, exact=True) as dp:
        opt = mo.sharded(dp, kind, groups, lr=1e-2, weight_decay=0.1, **kw)
        assert all(a.size == opt.cut.hi - opt.cut.lo for a in opt._states.values())
        for s in range(steps):
            weight = 0
            for i in shard(MICRO, dp.rank, dp.world_size):
                dp.fold(micro(p, s, i))
                weight += i % 3 + 1
            opt.step({}, weight, step=s, max_norm=max_norm)
        dp.close()
    return sha(p)


def every_size(comm: MPI.Comm, fn: Any) -> dict[int, list[str]]:
    """``fn(sub)`` on the first n ranks for n = 1 .. min(4, size): every rank's result per n, on every rank."""
    mine: dict[int, str] = {}
    for n in range(1, min(4, comm.size) + 1):
        with first_ranks(comm, n) as sub:
            if sub is not None:
                mine[n] = fn(sub)
    every = comm.allgather(mine)
    return {n: [e[n] for e in every if n in e] for n in range(1, min(4, comm.size) + 1)}


@pytest.mark.parametrize(("kind", "max_norm"), [("adamw", None), ("adamw", 5.0), ("sgd", 5.0)])
def test_exact_sharded_step_has_the_same_bits_at_every_world_size(comm: MPI.Comm, kind: str, max_norm: float | None) -> None:
    found = every_size(comm, lambda sub: run_exact(sub, kind, 2, max_norm))
    hashes = {h for v in found.values() for h in v}
    assert len(hashes) == 1, found


def replicated(kind: str, steps: int, max_norm: float | None) -> str:
    """One process, exact reduce, then the same rule applied whole to each parameter (mpidp's own replicated optimizer)."""
    p = params(big=False, half=False)
    groups = [(["a", "c"], {}), (["b"], {"weight_decay": 0.0, "lr": 3e-2})]
    kw: dict[str, Any] = {"momentum": 0.9, "nesterov": True} if kind == "sgd" else {"amsgrad": kind == "adam"}
    rule = rules.RULES[kind]
    hp = [{**rule.defaults, "lr": 1e-2, "weight_decay": 0.1, **kw, **own} for _, own in groups]
    state = {k: {s: np.zeros(v.size, np.float32) for s in rule.states(hp[0])} for k, v in p.items()}
    with mpidp.DataParallel.initialize(p, MPI.COMM_SELF, exact=True) as dp:
        for s in range(steps):
            for i in range(MICRO - 1):
                dp.fold(micro(p, s, i))
            out = dp.reduce(micro(p, s, MICRO - 1), sum(i % 3 + 1 for i in range(MICRO))).gradients
            g = {k: np.asarray(v, np.float32).reshape(-1) for k, v in out.items()}
            if max_norm is not None:
                words = np.zeros(norm.WORDS, np.int64)
                for v in g.values():
                    norm.squares(v, words)
                coef = norm.clip_coefficient(max_norm, norm.norm(words))
                g = {k: v * coef for k, v in g.items()}
            for (names, _), h in zip(groups, hp):
                for k in names:
                    rule.update(h, s + 1, p[k].reshape(-1), g[k], state[k])
        dp.close()
    return sha(p)


@pytest.mark.parametrize(("kind", "max_norm"), [("adamw", None), ("adam", 1.0), ("sgd", 5.0)])
def test_exact_sharded_equals_the_replicated_rule_applied_whole(comm: MPI.Comm, kind: str, max_norm: float | None) -> None:
    whole = replicated(kind, 3, max_norm)
    found = every_size(comm, lambda sub: run_exact(sub, kind, 3, max_norm, big=False, half=False))
    assert {h for v in found.values() for h in v} == {whole}, (whole, found)


def test_float_path_replicas_are_equal_and_near_the_global_mean_rule(comm: MPI.Comm) -> None:
    p = params(big=False)
    with mpidp.DataParallel.initialize(p, comm) as dp:
        opt = mo.AdamW(dp, lr=1e-2, weight_decay=0.1)
        ref = {k: v.astype(np.float32).reshape(-1) for k, v in p.items()}
        state = {k: {s: np.zeros(v.size, np.float32) for s in ("exp_avg", "exp_avg_sq")} for k, v in p.items()}
        hp = {**rules.AdamW.defaults, "lr": 1e-2, "weight_decay": 0.1}
        for s in range(4):
            every = [micro(p, s, r) for r in range(comm.size)]
            result = opt.step(every[comm.rank], comm.rank + 1, max_norm=2.0)
            total = sum(range(1, comm.size + 1))
            assert result.global_weight == total
            g = {k: (sum(e[k].astype(np.float64) for e in every) / total).astype(np.float32).reshape(-1) for k in p}
            words = np.zeros(norm.WORDS, np.int64)
            for v in g.values():
                norm.squares(v, words)
            coef = norm.clip_coefficient(2.0, norm.norm(words))
            assert result.norm == pytest.approx(float(norm.norm(words)), rel=1e-5)
            for k in p:
                rules.AdamW.update(hp, s + 1, ref[k], g[k] * coef, state[k])
        hashes = comm.allgather(sha(p))
        assert len(set(hashes)) == 1
        for k in p:
            tol = 1e-2 if k == "h" else 1e-5  # bfloat16 keeps 8 bits
            np.testing.assert_allclose(p[k].astype(np.float32).reshape(-1), ref[k], atol=tol, rtol=tol)
        dp.close()


def test_each_rank_keeps_only_its_slice(comm: MPI.Comm) -> None:
    p = params(big=False)
    with mpidp.DataParallel.initialize(p, comm) as dp:
        opt = mo.Adam(dp, amsgrad=True)
        n = sum(v.size for v in p.values())
        lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
        assert (opt.cut.lo, opt.cut.hi) == (lo, hi)
        assert opt.state_names() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
        assert opt.nbytes == 3 * 4 * (hi - lo) + 4 * sum(b - a for name, a, b in opt.owned() if name == "h")
        owned = comm.allgather(opt.owned())
        flat = [(name, a, b) for mine in owned for name, a, b in mine]
        for name in p:  # the pieces of all ranks tile every parameter, in order
            ranges = [(a, b) for k, a, b in flat if k == name]
            assert ranges[0][0] == 0 and ranges[-1][1] == p[name].size
            assert all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
        pieces = opt.state_pieces()
        pieces["exp_avg"][owned[comm.rank][0][0]][...] = 7  # views of the live state
        assert opt._states["exp_avg"][0] == 7
        dp.close()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_optimizers_get_the_same_error(comm: MPI.Comm) -> None:
    p = params(big=False)
    with mpidp.DataParallel.initialize(p, comm) as dp:
        same_error_everywhere(comm, lambda: mo.AdamW(dp, lr=1e-3 if comm.rank else 2e-3), ContractError, "differs between ranks", ".lr")
        same_error_everywhere(comm, lambda: mo.sharded(dp, "adamw" if comm.rank else "adam"), ContractError, "kind")
        groups = [{"params": ["a"]}, {"params": ["b", "c", "h"]}] if comm.rank else None
        same_error_everywhere(comm, lambda: mo.SGD(dp, groups), ContractError, "differs between ranks", "params")
        opt = mo.AdamW(dp)
        opt.param_groups[0]["lr"] = 0.5 if comm.rank == 1 else 1e-3
        before = snapshot(p)
        g = micro(p, 0, comm.rank)
        same_error_everywhere(comm, lambda: opt.step(g, 1), ContractError, "rank 1 has groups[0].lr = 0.5")
        opt.param_groups[0]["lr"] = 1e-3
        same_error_everywhere(comm, lambda: opt.step(g, 1, max_norm=1.0 if comm.rank else None), ContractError, "max_norm")
        assert snapshot(p) == before and not opt._states["exp_avg"].any()
        dp.close()


class _Lamb(mo.ShardedOptimizer):
    whole = "LAMB scales each tensor's update by a trust ratio of whole-tensor norms"


def test_refused_optimizers_raise_everywhere(comm: MPI.Comm) -> None:
    p = params(big=False)
    with mpidp.DataParallel.initialize(p, comm) as dp:
        same_error_everywhere(comm, lambda: mo.sharded(dp, "Muon"), ContractError, "cannot run Muon", "orthogonalizes", "elementwise")
        same_error_everywhere(comm, lambda: mo.sharded(dp, "rmsprop"), ContractError, "no sharded optimizer is called 'rmsprop'")
        same_error_everywhere(comm, lambda: _Lamb(dp), ContractError, "cannot run _Lamb", "trust ratio")
        same_error_everywhere(comm, lambda: mo.AdamW(dp, betas=(0.9, 1.5)), ContractError, "betas")
        same_error_everywhere(comm, lambda: mo.AdamW(dp, momentum=0.9), ContractError, "unknown hyperparameter")
        same_error_everywhere(comm, lambda: mo.SGD(dp, [{"params": ["a"]}, {"params": ["a"]}]), ContractError, "in groups 0 and 1")
        opt = mo.SGD(dp, momentum=0.5)  # the session still works after the refusals
        opt.step(micro(p, 0, comm.rank), 1)
        dp.close()


def test_bad_input_leaves_everything_untouched(comm: MPI.Comm) -> None:
    p = params(big=False)
    with mpidp.DataParallel.initialize(p, comm) as dp:
        opt = mo.AdamW(dp)
        opt.step(micro(p, 0, comm.rank), 2)
        before, state = snapshot(p), {k: v.copy() for k, v in opt._states.items()}
        g = micro(p, 1, comm.rank)
        if comm.rank == comm.size - 1:
            g["b"] = np.zeros(8, np.float32)
        same_error_everywhere(comm, lambda: opt.step(g, 1), ContractError, "gradient 'b'")
        same_error_everywhere(comm, lambda: opt.step(micro(p, 1, comm.rank), 1, max_norm=-1.0), ContractError, "max_norm")
        assert snapshot(p) == before
        assert all(np.array_equal(v, state[k]) for k, v in opt._states.items())
        assert [g["step"] for g in opt.hyperparameters()["groups"]] == [1]
        dp.close()


def test_a_checkpoint_loads_at_another_world_size(comm: MPI.Comm) -> None:
    """3 exact steps at the full size equal 2 steps there, a save, a load on the first ranks (or 1), and 1 step there."""
    full = run_exact(comm, "adamw", 3, 2.0, big=False)
    p = params(big=False)
    groups = [{"params": ["a", "c"]}, GROUPS[1], {"params": ["h"]}]
    with mpidp.DataParallel.initialize(p, comm, exact=True) as dp:
        opt = mo.sharded(dp, "adamw", groups, lr=1e-2, weight_decay=0.1)
        for s in range(2):
            ws = 0
            for i in shard(MICRO, dp.rank, dp.world_size):
                dp.fold(micro(p, s, i))
                ws += i % 3 + 1
            opt.step({}, ws, step=s, max_norm=2.0)
        saved = {k: {n: np.zeros(p[n].size, np.float32) for n in p} for k in opt.state_names()}
        mine = (opt.owned(), {k: {name: v.copy() for name, v in d.items()} for k, d in opt.state_pieces().items()})
        for owned, states in comm.allgather(mine):
            for k, d in states.items():
                for name, a, b in owned:
                    if name in d:
                        saved[k][name][a:b] = d[name]
        hp = opt.describe()
        dp.close()
    kept = {k: v.copy() for k, v in p.items()}
    n = max(1, comm.size // 2 + 1) if comm.size > 1 else 1
    with first_ranks(comm, n) as sub:
        if sub is not None:
            q = {k: v.copy() for k, v in kept.items()}
            with mpidp.DataParallel.initialize(q, sub, exact=True) as dp:
                opt = mo.sharded(dp, "adamw", groups, lr=1e-2, weight_decay=0.1)
                runs = opt.wants(hp)  # the checkpoint contract (mpidp.optim.state): what to read, then prepare and commit
                opt.prepare(hp, [saved[r.key.split("/")[1]][r.key.split("/", 2)[2]][r.lo : r.hi] for r in runs])()
                ws = 0
                for i in shard(MICRO, dp.rank, dp.world_size):
                    dp.fold(micro(q, 2, i))
                    ws += i % 3 + 1
                opt.step({}, ws, step=2, max_norm=2.0)
                assert sha(q) == full
                bad = {**hp, "kind": "adam"}
                with pytest.raises(ValueError, match="kind = 'adam'"):
                    opt.wants(bad)
                dp.close()


#: ``d``'s size in the owner-slice test: 4-byte rounds of 4096 bytes cut it 20 times, inside it and off every SIMD width
#: (the 1000003 values of the other tests made 1,000 rounds per reduction there: a minute per case at 4 ranks, no more cuts)
OWNED_D = 20011


@pytest.mark.parametrize("case", ["plain", "join", "wide", "folds", "nan"])
def test_each_owner_sums_and_converts_only_its_slice_with_the_bits_of_the_whole(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Exact: each owner sums and converts only its own slice (ExactWindow.reduce_owned, no gather of gradients), with the
    bits of the whole reduction. One micro-batch per rank (the README's loop) crosses as float32 (Alltoall); a rank of
    weight zero; ranks 2**18 apart (more than 53 bits) and two micro-batches per rank cross as 64-bit integers
    (Reduce_scatter_block); inf or NaN on a rank reduce the whole."""
    from mpidp.exact import sums
    from mpidp.exact.window import ExactWindow

    owned, combine = ExactWindow.reduce_owned, sums.Accumulator.combine
    taken: list[bool] = []
    thin: dict[int, int] = {}

    def run(sub: MPI.Comm, mode: str) -> str:
        p = params(d=OWNED_D)
        with monkeypatch.context() as m:
            if mode == "whole":
                m.setattr(ExactWindow, "reduce_owned", lambda *a: False)
            else:
                m.setattr(ExactWindow, "reduce_owned", lambda *a: taken.append(owned(*a)) or taken[-1])
                m.setattr(sums.Accumulator, "combine", lambda *a: thin.update({sub.size: thin.get(sub.size, 0) + 1}) or combine(*a))
            with mpidp.DataParallel.initialize(p, sub, exact=True, chunk_bytes=4096) as dp:  # rounds cut inside tensors
                opt = mo.sharded(dp, "adamw", [*GROUPS, {"params": ["h"]}], lr=1e-2, weight_decay=0.1)
                for s in range(2):
                    have = not (case == "join" and sub.size > 1 and sub.rank == sub.size - 1)
                    if case == "folds":
                        dp.fold(micro(p, s, sub.rank + sub.size))
                    g = micro(p, s, sub.rank) if have else {}
                    if case == "wide" and sub.rank == 0:
                        g["c"] *= np.float32(2.0**18)
                    if case == "nan" and sub.rank == sub.size - 1:
                        g["b"][3] = np.nan
                    opt.step(g, (sub.rank % 3 + 1) * (1 + (case == "folds")) if have else 0, step=s, max_norm=None if case == "nan" else 5.0)
        return sha(p)

    found = every_size(comm, lambda sub: run(sub, "whole") == run(sub, "owned"))
    assert all(all(v) for v in found.values()), found
    assert {t for mine in comm.allgather(taken) for t in mine} == {case != "nan"}  # owned everywhere, but where a NaN was
    if case != "nan":  # float32 where every rank has one micro-batch per window within 53 bits (a world of one: always)
        sizes = {n for mine in comm.allgather(thin) for n in mine}
        expected = set(found) if case in ("plain", "join") else {1} if case == "wide" else set()
        assert sizes == expected, (sizes, expected)
