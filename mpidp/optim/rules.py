"""Elementwise update rules in float32: torch.optim's single-tensor SGD, Adam and AdamW, operation for operation (pure).

Each rule updates flat float32 arrays in place: the parameter (or its
float32 master), the gradient, and the rule's state, element by element.
An element's new value reads only that element's parameter, gradient and
state and per-step Python-float scalars (bias corrections computed in
float64, then each used as a float32 operand, as torch does for float32
tensors), so where a slice starts cannot change it. NumPy's ufuncs round
every operation once (no contraction into fused multiply-adds), the
vectorised body and the tail alike; ``tests/optim`` checks it at odd
offsets. The formulas follow ``torch.optim``'s ``_single_tensor_sgd`` and
``_single_tensor_adam`` (torch 2.13); torch's own CPU kernels may fuse a
multiply-add, so they can differ from these in the last bit.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

__all__ = ["RULES", "SGD", "Adam", "AdamW", "Rule"]

F = np.float32


def _real(hp: Mapping[str, Any], key: str, low: float = 0.0) -> str | None:
    v = hp[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not float(v) >= low:
        return f"{key} must be a real number >= {low}, got {v!r}"
    return None


def _flag(hp: Mapping[str, Any], key: str) -> str | None:
    return None if isinstance(hp[key], bool) else f"{key} must be True or False, got {hp[key]!r}"


class Rule:
    """An elementwise update rule: its kind, its hyperparameters and their defaults, its state, its update."""

    kind: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def check(cls, hp: Mapping[str, Any]) -> str | None:
        """Why hyperparameters ``hp`` (every default's key) are invalid, or None."""
        raise NotImplementedError

    @classmethod
    def states(cls, hp: Mapping[str, Any]) -> tuple[str, ...]:
        """The state this rule keeps per element under hyperparameters ``hp`` (float32 each)."""
        raise NotImplementedError

    @classmethod
    def update(cls, hp: Mapping[str, Any], step: int, p: np.ndarray, g: np.ndarray, state: Mapping[str, np.ndarray]) -> None:
        """Update ``p`` and ``state`` in place from gradient ``g``; ``step``: the group's count, this step included (>= 1)."""
        raise NotImplementedError


class SGD(Rule):
    """``torch.optim.SGD``: momentum, dampening, Nesterov, weight decay (added to the gradient), maximize."""

    kind = "sgd"
    defaults: ClassVar[dict[str, Any]] = {
        "lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False,
    }

    @classmethod
    def check(cls, hp: Mapping[str, Any]) -> str | None:
        why = _real(hp, "lr") or _real(hp, "momentum") or _real(hp, "dampening", -np.inf) or _real(hp, "weight_decay")
        why = why or _flag(hp, "nesterov") or _flag(hp, "maximize")
        if why is None and hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
            why = "Nesterov momentum requires a momentum and zero dampening"
        return why

    @classmethod
    def states(cls, hp: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if hp["momentum"] != 0 else ()

    @classmethod
    def update(cls, hp: Mapping[str, Any], step: int, p: np.ndarray, g: np.ndarray, state: Mapping[str, np.ndarray]) -> None:
        if hp["maximize"]:
            g = -g
        if hp["weight_decay"] != 0:
            g = g + F(hp["weight_decay"]) * p  # grad.add(param, alpha=weight_decay)
        momentum = hp["momentum"]
        if momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                buf[...] = g  # torch.clone(grad) on the first step
            else:
                buf *= F(momentum)
                buf += g if hp["dampening"] == 0 else F(1 - hp["dampening"]) * g
            g = g + F(momentum) * buf if hp["nesterov"] else buf
        p += F(-hp["lr"]) * g  # param.add_(grad, alpha=-lr)


class Adam(Rule):
    """``torch.optim.Adam``: weight decay added to the gradient, amsgrad, maximize."""

    kind = "adam"
    decoupled: ClassVar[bool] = False
    defaults: ClassVar[dict[str, Any]] = {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
    }

    @classmethod
    def check(cls, hp: Mapping[str, Any]) -> str | None:
        why = _real(hp, "lr") or _real(hp, "eps") or _real(hp, "weight_decay") or _flag(hp, "amsgrad") or _flag(hp, "maximize")
        betas = hp["betas"]
        if why is None and (
            not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= float(b) < 1 for b in betas)
        ):
            why = f"betas must be two real numbers in [0, 1), got {betas!r}"
        return why

    @classmethod
    def states(cls, hp: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if hp["amsgrad"] else ("exp_avg", "exp_avg_sq")

    @classmethod
    def update(cls, hp: Mapping[str, Any], step: int, p: np.ndarray, g: np.ndarray, state: Mapping[str, np.ndarray]) -> None:
        lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
        if hp["maximize"]:
            g = -g
        if wd != 0:
            if cls.decoupled:
                p *= F(1 - lr * wd)  # param.mul_(1 - lr * weight_decay)
            else:
                g = g + F(wd) * p  # grad.add(param, alpha=weight_decay)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        w = F(1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1), torch's two-sided lerp
        if abs(w) < 0.5:
            m += w * (g - m)
        else:
            m[...] = g - (g - m) * (F(1) - w)
        v *= F(beta2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v += (F(1 - beta2) * g) * g
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        root2 = bias_correction2**0.5
        if hp["amsgrad"]:
            top = state["max_exp_avg_sq"]
            np.maximum(top, v, out=top)
            v = top
        denom = np.sqrt(v)
        denom /= F(root2)
        denom += F(eps)
        p += (F(-step_size) * m) / denom  # param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (``param *= 1 - lr * weight_decay``)."""

    kind = "adamw"
    decoupled = True
    defaults: ClassVar[dict[str, Any]] = {**Adam.defaults, "weight_decay": 1e-2}


#: the rules by kind
RULES: dict[str, type[Rule]] = {r.kind: r for r in (SGD, Adam, AdamW)}
