"""The sharded optimizer's pure rooms: the cut, the exact norm, slice-independent rules, and torch.optim's formulas."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidp
import mpidp.optim as mo
from mpidp import cut
from mpidp.optim import norm, rules


@pytest.mark.parametrize("sizes", [(1,), (7, 1, 33), (1000003,), (5, 0, 9)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_the_cut_tiles_the_storage_and_depends_on_sizes_only(sizes: tuple[int, ...], world: int) -> None:
    total = sum(sizes)
    b = cut.bounds(total, world)
    assert b[0] == 0 and b[-1] == total and all(x <= y for x, y in itertools.pairwise(b))
    assert max(y - x for x, y in itertools.pairwise(b)) - min(y - x for x, y in itertools.pairwise(b)) <= 1
    seen = []
    for r in range(world):
        c = cut.Cut.of(sizes, r, world)
        for p in c.mine():
            assert 0 <= p.a < p.b <= sizes[p.slot]
            seen.append((p.slot, p.a, p.b))
    flat = [(s, i) for s, a, b in seen for i in range(a, b)] if total < 100 else None
    if flat is not None:
        assert flat == [(s, i) for s, n in enumerate(sizes) for i in range(n)]


def _exact(x: np.ndarray) -> float:
    return math.sqrt(float(sum(Fraction(float(v)) ** 2 for v in x)))


@pytest.mark.parametrize("seed", range(4))
def test_the_norm_is_the_exact_sum_of_squares_rounded_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(3001) * np.exp2(rng.integers(-140, 60, 3001))).astype(np.float32)
    x[:3] = [np.float32(1.4e-45), -np.float32(3e38), 0]
    words = np.zeros(norm.WORDS, np.int64)
    for part in np.array_split(rng.permutation(x), 7):  # any cut, any order
        norm.squares(part, words)
    assert norm.total(words) == float(sum(Fraction(float(v)) ** 2 for v in x))
    assert norm.norm(words) == np.float32(_exact(x))


def test_the_norm_of_inf_and_nan_is_torchs() -> None:
    for bad, want in [([np.inf], math.inf), ([np.nan, np.inf], math.nan), ([-np.inf, 1], math.inf)]:
        x = np.array([1, 2, *bad], np.float32)
        words = np.zeros(norm.WORDS, np.int64)
        norm.squares(x, words)
        t = torch.nn.utils.get_total_norm([torch.from_numpy(x)])
        assert math.isnan(want) == math.isnan(float(norm.norm(words))) == math.isnan(float(t))
        coef = norm.clip_coefficient(1.0, norm.norm(words))
        tcoef = torch.clamp(1.0 / (t + 1e-6), max=1.0)
        assert np.array_equal(np.array(coef), tcoef.numpy(), equal_nan=True)


@pytest.mark.parametrize("rule", [rules.SGD, rules.Adam, rules.AdamW])
def test_an_elements_update_does_not_depend_on_where_its_slice_starts(rule: Any) -> None:
    rng = np.random.default_rng(3)
    n = 1027
    hp = {**rule.defaults, "lr": 0.1, "weight_decay": 0.05}
    if rule is rules.SGD:
        hp.update(momentum=0.9, dampening=0.1)
    else:
        hp.update(amsgrad=True, betas=(0.3, 0.999))  # beta1 < 0.5: lerp's other branch
    whole_p = rng.standard_normal(n).astype(np.float32)
    whole_s = {s: np.zeros(n, np.float32) for s in rule.states(hp)}
    cut_p, cut_s = whole_p.copy(), {s: v.copy() for s, v in whole_s.items()}
    for step in range(1, 4):
        g = rng.standard_normal(n).astype(np.float32)
        rule.update(hp, step, whole_p, g, whole_s)
        for a, b in [(0, 1), (1, 8), (8, 41), (41, 1000), (1000, 1027)]:  # off every SIMD width
            rule.update(hp, step, cut_p[a:b], g[a:b], {s: v[a:b] for s, v in cut_s.items()})
    assert whole_p.tobytes() == cut_p.tobytes()
    assert all(whole_s[s].tobytes() == cut_s[s].tobytes() for s in whole_s)


CASES = [
    ("adamw", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    ("adamw", torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "betas": (0.8, 0.99)}),
    ("adam", torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True}),
    ("sgd", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True}),
    ("sgd", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.2}),
]


@pytest.mark.parametrize(("kind", "cls", "kw"), CASES)
def test_the_float_path_matches_torch_optim(kind: str, cls: Any, kw: dict[str, Any]) -> None:
    """One rank (COMM_SELF), the same gradients, 25 steps: within 1e-6 of the largest parameter (torch's CPU kernels fuse multiply-adds)."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in {"a": (7, 33), "b": (1,), "c": (1000,)}.items()}
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    with mpidp.DataParallel.initialize(params, MPI.COMM_SELF) as dp:
        opt = mo.sharded(dp, kind, [{"params": ["a", "c"]}, {"params": ["b"], "lr": 0.5}], **kw)
        topt = cls([{"params": [tp["a"], tp["c"]]}, {"params": [tp["b"]], "lr": 0.5}], foreach=False, **kw)
        for _ in range(25):
            g = {k: (rng.standard_normal(v.shape) * 4).astype(np.float32) for k, v in params.items()}
            opt.step(g, 4)
            for k, v in g.items():
                tp[k].grad = torch.from_numpy(v / np.float32(4))
            topt.step()
        scale = max(float(np.abs(v).max()) for v in params.values())
        worst = max(float(np.abs(params[k] - tp[k].detach().numpy()).max()) for k in params)
        print(f"{kind} {kw}: largest difference {worst:.3g}, {worst / scale:.3g} of the largest parameter")
        assert worst <= 1e-6 * scale, (worst, scale)
        dp.close()
