"""The replica most collective tests use: every kind of entry, and gradients for it."""

from __future__ import annotations

import copy
from typing import Any

import ml_dtypes
import numpy as np

from mpidp import MissingGradientPolicy

BF16 = np.dtype(ml_dtypes.bfloat16)
ZERO, ERROR = MissingGradientPolicy.ZERO, MissingGradientPolicy.ERROR


#: model(seed)'s arrays and grads_for's draws, made once per process: 583 calls drew 38 distinct sets, 13 % of the
#: time of test_reduce, test_overlap and test_core in a world of one; every call returns fresh copies of the same bits
_MODELS: dict[int, dict[str, Any]] = {}
_DRAWS: dict[tuple[Any, ...], tuple[dict[str, Any], dict[str, Any]]] = {}


def model(seed: int) -> dict[str, Any]:
    """A replica with every kind of entry: fp32 large and small, fp16, bf16, a tie, a frozen one."""
    if seed not in _MODELS:
        rng = np.random.default_rng(seed)
        emb = rng.standard_normal((64, 16)).astype(np.float32)
        _MODELS[seed] = {
            "embed": emb,
            "head": emb,  # tied to embed
            "big": rng.standard_normal(300_000).astype(np.float32),
            "bias": rng.standard_normal(7).astype(np.float32),
            "half": rng.standard_normal((5, 9)).astype(np.float16),
            "brain": rng.standard_normal((3, 11)).astype(BF16),
            "frozen": rng.standard_normal(4).astype(np.float32),
        }
    return copy.deepcopy(_MODELS[seed])  # fresh arrays; deepcopy keeps the tie (one copy for embed and head)


TRAINABLE = ("big", "bias", "brain", "embed", "half")


def grads_for(params: dict[str, Any], rng: np.random.Generator, names: Any = TRAINABLE) -> dict[str, Any]:
    """Gradients for ``names``: ``rng``'s normals times 10, in each parameter's shape and dtype (``rng`` advances)."""
    key = (repr(rng.bit_generator.state), tuple((n, params[n].shape, params[n].dtype) for n in names))
    if key not in _DRAWS:
        drawn = {n: (rng.standard_normal(params[n].shape) * 10).astype(params[n].dtype) for n in names}
        _DRAWS[key] = (drawn, rng.bit_generator.state)
    drawn, after = _DRAWS[key]
    rng.bit_generator.state = after
    return {n: a.copy() for n, a in drawn.items()}
