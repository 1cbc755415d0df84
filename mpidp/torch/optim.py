"""Sharded optimizers as ``torch.optim.Optimizer`` s: ShardedAdamW, ShardedAdam, ShardedSGD over a :class:`DataParallel`.

The loop: ``loss_sum.backward()``, ``opt.step(local_weight=n)``,
``opt.zero_grad()``. ``step`` is the window: it replaces ``dp.reduce``, since
the reduce-scatter to the owners *is* the reduction (reducing first would
move every gradient twice). ``param_groups`` are torch's, so
``torch.optim.lr_scheduler`` schedulers work; their hyperparameters are
read at every step and agreed between ranks.

``torch.amp.GradScaler`` works unchanged: ``scaler.scale(loss).backward()``,
``scaler.step(opt, local_weight=n)``, ``scaler.update()``. The optimizer
says ``_step_supports_amp_scaling``, so the scaler hands itself to ``step``
(``grad_scaler=``) instead of checking each rank's own gradients for inf:
the owners unscale the reduced slices, every rank learns whether any slice
holds inf or NaN (one agreed answer), skips the update alike where one does,
and reports that answer to the scaler, so that ``update()`` backs off or
grows the scale identically on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.amp.grad_scaler import OptState

from .. import optim as core_optim
from ..core import MissingGradientPolicy
from .adapter import DataParallel

__all__ = ["ShardedAdam", "ShardedAdamW", "ShardedOptimizer", "ShardedSGD"]


class ShardedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state lives in slices, one per rank (:mod:`mpidp.optim`); collective to build.

    ``params``: None (every trainable parameter of ``dp.module``), tensors,
    or torch param-group dicts; each tensor must be the head of a trainable
    tie group of ``dp``. Hyperparameters as the torch optimizer's. 16-bit
    parameters keep float32 masters on their owners. Not with
    ``overlap`` sessions (ContractError on every rank: the buckets are not
    reduce-scattered to owners yet).
    ``torch.amp.GradScaler`` is supported (see the module's docstring);
    its ``unscale_`` is not: ``.grad`` holds each rank's own unreduced loss
    sums here, so clipping after it would clip every rank differently
    (ContractError on every rank at ``step``: clip with ``max_norm``).
    """

    _core: ClassVar[type[core_optim.ShardedOptimizer]] = core_optim.ShardedOptimizer
    #: GradScaler hands itself to :meth:`step` (``grad_scaler=``) instead of deciding alone whether to call it
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(self, dp: DataParallel, params: Any = None, **defaults: Any) -> None:
        rule = self._core.rule
        assert rule is not None
        head_of = {id(dp._params[h]): h for h in dp.trainable}
        error = "a sharded optimizer does not run with overlap sessions yet; build the DataParallel without overlap" if dp.overlap else None
        try:
            super().__init__(list(dp.module.parameters()) if params is None else params, {**rule.defaults, **defaults})
            groups = []
            for k, g in enumerate(self.param_groups):
                missing = [i for i, p in enumerate(g["params"]) if id(p) not in head_of]
                if missing and error is None:
                    error = f"param group {k}: tensor {missing[0]} is not a trainable parameter of the DataParallel's module"
                groups.append({"params": [head_of[id(p)] for p in g["params"] if id(p) in head_of], **self._hp(g)})
        except Exception as e:  # noqa: BLE001 - this rank's error, raised by the agreement on every rank
            error, groups = error or f"{type(e).__name__}: {e}", []
            self.param_groups = []
        self._dp = dp
        self.sharded = self._core(dp._core, groups, adapter_error=error)
        self.last: core_optim.StepResult | None = None

    def _hp(self, group: dict[str, Any]) -> dict[str, Any]:
        rule = self._core.rule
        assert rule is not None
        return {k: tuple(group[k]) if k == "betas" else group[k] for k in rule.defaults}

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        local_weight: int | torch.Tensor,
        policy: MissingGradientPolicy = MissingGradientPolicy.ERROR,
        step: int | None = None,
        max_norm: float | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Any:
        """Reduce ``.grad`` (of local loss sums, weight ``local_weight``) to the owners, update, gather (collective).

        Replaces ``dp.reduce``: do not call both. ``max_norm`` clips by the
        global norm as ``clip_grad_norm_`` would after a reduce; the norm and
        the global weight are in :attr:`last`. ``.grad`` is read, not changed.
        ``grad_scaler``: what ``scaler.step(opt, local_weight=n, ...)``
        passes; the reduced slices are unscaled, and where any holds inf or
        NaN every rank skips the update (``last.found_inf``) and the scaler
        is told so, on every rank alike. Raises ContractError on every rank,
        with parameters and state untouched, as ``dp.reduce`` does, where
        ranks' hyperparameters or scales differ, and after ``scaler.unscale_(opt)``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, mine in zip(self.param_groups, self.sharded.groups):
            mine.hp.update(self._hp(g))
        weight = local_weight if isinstance(local_weight, int) else int(local_weight.item())
        scale, error = self._scaling(grad_scaler)
        params = self._dp._refresh()
        grads = self._dp._gradients(params, weight)
        self.last = self.sharded.step(grads, weight, policy, step=step, max_norm=max_norm, scale=scale, adapter_error=error)
        if grad_scaler is not None:  # what update() reads: this step's agreed answer, the same on every rank
            scale_tensor = grad_scaler._get_scale_async()
            assert scale_tensor is not None
            found = torch.full((), float(self.last.found_inf), dtype=torch.float32, device=scale_tensor.device)
            grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        return loss

    def _scaling(self, grad_scaler: torch.amp.GradScaler | None) -> tuple[float | None, str | None]:
        """The loss scale to divide by (None: none), and this rank's error with the scaler (local)."""
        if grad_scaler is None:
            if hasattr(self, "grad_scale") or hasattr(self, "found_inf"):  # a GradScaler that no longer passes itself
                return None, (
                    "this torch's GradScaler did not pass itself to step (grad_scaler=): a sharded optimizer needs it to "
                    "tell the scaler the inf/NaN answer every rank agreed on"
                )
            return None, None
        if grad_scaler._per_optimizer_states[id(self)]["stage"] is OptState.UNSCALED:
            return None, (
                "scaler.unscale_(opt) is not supported with a sharded optimizer: .grad holds each rank's own, "
                "unreduced loss sums, so clipping them would clip every rank differently; drop unscale_ and clip "
                "by the global norm with scaler.step(opt, local_weight=n, max_norm=...)"
            )
        return grad_scaler.get_scale(), None

    def state_dict(self) -> dict[str, Any]:
        """Not here: a sharded state is saved by name and range (``sharded.owned()``, ``sharded.state_pieces()``)."""
        raise NotImplementedError("save a sharded optimizer through its slices: opt.sharded.hyperparameters(), owned(), state_pieces()")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Not here: ``opt.sharded.load(hyperparameters, read)`` loads a sharded state at any world size."""
        raise NotImplementedError("load a sharded optimizer with opt.sharded.load(hyperparameters, read)")


class ShardedAdamW(ShardedOptimizer):
    """``torch.optim.AdamW``, sharded: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``."""

    _core = core_optim.AdamW


class ShardedAdam(ShardedOptimizer):
    """``torch.optim.Adam``, sharded: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``."""

    _core = core_optim.Adam


class ShardedSGD(ShardedOptimizer):
    """``torch.optim.SGD``, sharded: ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``."""

    _core = core_optim.SGD
