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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .. import optim as core_optim
from ..core import MissingGradientPolicy
from ..optim.state import OptimizerState, Piece, Run
from . import scaling
from .adapter import DataParallel

__all__ = ["ShardedAdam", "ShardedAdamW", "ShardedOptimizer", "ShardedSGD"]


class ShardedOptimizer(torch.optim.Optimizer, OptimizerState):
    """A torch optimizer whose state lives in slices, one per rank (:mod:`mpidp.optim`); collective to build.

    ``params``: None (every trainable parameter of ``dp.module``), tensors,
    or torch param-group dicts; each tensor must be the head of a trainable
    tie group of ``dp``. Hyperparameters as the torch optimizer's. Its
    ``param_groups`` are the hyperparameters: every step and every save
    reads them there (a scheduler's ``lr``), a load writes them there.
    16-bit parameters keep float32 masters on their owners. Not with
    ``overlap`` sessions (ContractError on every rank: the buckets are not
    reduce-scattered to owners yet).
    ``torch.amp.GradScaler`` is supported (see the module's docstring);
    its ``unscale_`` is not, nor any other write to ``.grad`` after
    backward, nor ``dp.reduce`` before the step: ``.grad`` holds each
    rank's own unreduced loss sums here, so clipping them would clip every
    rank differently (ContractError on every rank at ``step``: clip with
    ``max_norm``). Checkpoints: ``dp.save_checkpoint(folder, opt)``.
    """

    _core: ClassVar[type[core_optim.ShardedOptimizer]] = core_optim.ShardedOptimizer
    #: GradScaler hands itself to :meth:`step` (``grad_scaler=``) instead of deciding alone whether to call it
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(self, dp: DataParallel, params: Any = None, **defaults: Any) -> None:
        rule = self._core.rule
        assert rule is not None
        named = dp.named_parameters()
        head_of = {id(named[h]): h for h in dp.trainable}
        error = "a sharded optimizer does not run with overlap sessions yet; build the DataParallel without overlap" if dp.overlap else None
        try:
            super().__init__(list(dp.module.parameters()) if params is None else params, {**rule.defaults, **defaults})
            groups = []
            for k, g in enumerate(self.param_groups):
                missing = [i for i, p in enumerate(g["params"]) if id(p) not in head_of]
                if missing and error is None:
                    error = f"param group {k}: tensor {missing[0]} is not a trainable parameter of the DataParallel's module"
                groups.append({"params": [head_of[id(p)] for p in g["params"] if id(p) in head_of], **{k: g[k] for k in rule.defaults}})
        except Exception as e:  # noqa: BLE001 - this rank's error, raised by the agreement on every rank
            error, groups = error or f"{type(e).__name__}: {e}", []
            self.param_groups = []
        self._dp = dp
        self.sharded = self._core(dp.session, groups, adapter_error=error, sources=self.param_groups)
        self.kind = self.sharded.kind
        self.last: core_optim.StepResult | None = None

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

        Replaces ``dp.reduce``: do not call both (ContractError on every
        rank). ``max_norm`` clips by the global norm as ``clip_grad_norm_``
        would after a reduce; the norm and the global weight are in
        :attr:`last`. ``.grad`` is read, not changed, and must hold what
        backward left there. ``grad_scaler``: what ``scaler.step(opt,
        local_weight=n, ...)`` passes; the reduced slices are unscaled, and
        where any holds inf or NaN every rank skips the update
        (``last.found_inf``) and the scaler is told so, on every rank alike.
        Raises ContractError on every rank, with parameters and state
        untouched, as ``dp.reduce`` does, where ranks' hyperparameters or
        scales differ, after ``scaler.unscale_(opt)``, ``clip_grad_norm_``
        or another write to ``.grad``, and after ``dp.reduce``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight = local_weight if isinstance(local_weight, int) else int(local_weight.item())
        scale, error = scaling.scale_for(grad_scaler, self)
        grads, problem = self._dp.step_gradients(weight)
        self.last = self.sharded.step(grads, weight, policy, step=step, max_norm=max_norm, scale=scale, adapter_error=error or problem)
        if grad_scaler is not None:  # what update() reads: this step's agreed answer, the same on every rank
            scaling.report(grad_scaler, self, self.last.found_inf)
        return loss

    # ---------------------------------------------------- the checkpoint contract (mpidp.optim.state): the core's

    def describe(self) -> dict[str, Any]:
        """The core optimizer's description: kind, groups (from ``param_groups``), step counts, state names."""
        return self.sharded.describe()

    def pieces(self, rank: int, size: int) -> list[Piece]:
        """This rank's owned slices of every state."""
        return self.sharded.pieces(rank, size)

    def wants(self, description: Mapping[str, Any]) -> list[Run]:
        """The slices this rank owns at this world size."""
        return self.sharded.wants(description)

    def prepare(self, description: Mapping[str, Any], values: Sequence[np.ndarray]) -> Callable[[], None]:
        """The commit that loads them, and the hyperparameters into ``param_groups``."""
        return self.sharded.prepare(description, values)

    def state_dict(self) -> dict[str, Any]:
        """Not here: a sharded state is saved by name and slice, ``dp.save_checkpoint(folder, opt)`` (any world size loads it)."""
        raise NotImplementedError("save a sharded optimizer with dp.save_checkpoint(folder, opt): each rank writes its slices")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Not here: ``dp.load_checkpoint(folder, opt)`` loads a sharded state at any world size."""
        raise NotImplementedError("load a sharded optimizer with dp.load_checkpoint(folder, opt)")


class ShardedAdamW(ShardedOptimizer):
    """``torch.optim.AdamW``, sharded: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``."""

    _core = core_optim.AdamW


class ShardedAdam(ShardedOptimizer):
    """``torch.optim.Adam``, sharded: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``."""

    _core = core_optim.Adam


class ShardedSGD(ShardedOptimizer):
    """``torch.optim.SGD``, sharded: ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``."""

    _core = core_optim.SGD
