"""The replica most collective tests use: every kind of entry, and gradients for it."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from mpidp import MissingGradientPolicy

BF16 = np.dtype(ml_dtypes.bfloat16)
ZERO, ERROR = MissingGradientPolicy.ZERO, MissingGradientPolicy.ERROR


def model(seed: int) -> dict[str, Any]:
    """A replica with every kind of entry: fp32 large and small, fp16, bf16, a tie, a frozen one."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((64, 16)).astype(np.float32)
    return {
        "embed": emb,
        "head": emb,  # tied to embed
        "big": rng.standard_normal(300_000).astype(np.float32),
        "bias": rng.standard_normal(7).astype(np.float32),
        "half": rng.standard_normal((5, 9)).astype(np.float16),
        "brain": rng.standard_normal((3, 11)).astype(BF16),
        "frozen": rng.standard_normal(4).astype(np.float32),
    }


TRAINABLE = ("big", "bias", "brain", "embed", "half")


def grads_for(params: dict[str, Any], rng: np.random.Generator, names: Any = TRAINABLE) -> dict[str, Any]:
    return {n: (rng.standard_normal(params[n].shape) * 10).astype(params[n].dtype) for n in names}
