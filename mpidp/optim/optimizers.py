"""The sharded SGD, Adam and AdamW, and :func:`sharded`: an optimizer by name, the whole-tensor ones refused."""

from __future__ import annotations

from typing import Any, ClassVar

from ..core import DataParallel
from ..errors import ContractError
from . import groups as groupings
from . import rules
from .sharded import ShardedOptimizer

__all__ = ["SGD", "Adam", "AdamW", "sharded"]


class SGD(ShardedOptimizer):
    """Sharded ``torch.optim.SGD`` (collective to build): ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``.

    State per element: ``momentum_buffer`` (where a group has a momentum).
    """

    kind = "sgd"
    elementwise = True
    rule: ClassVar[type[rules.Rule] | None] = rules.SGD


class Adam(ShardedOptimizer):
    """Sharded ``torch.optim.Adam`` (collective to build): ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``.

    State per element: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad).
    """

    kind = "adam"
    elementwise = True
    rule: ClassVar[type[rules.Rule] | None] = rules.Adam


class AdamW(ShardedOptimizer):
    """Sharded ``torch.optim.AdamW`` (collective to build): Adam with decoupled weight decay (default 1e-2).

    State per element: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad).
    """

    kind = "adamw"
    elementwise = True
    rule: ClassVar[type[rules.Rule] | None] = rules.AdamW


#: the sharded optimizers by kind
KINDS: dict[str, type[ShardedOptimizer]] = {c.kind: c for c in (SGD, Adam, AdamW)}


class _Refused(ShardedOptimizer):
    """A refused optimizer by name: building it is the agreement that raises its refusal on every rank."""

    def __init__(self, dp: DataParallel, name: str) -> None:
        self.name = name
        super().__init__(dp)

    def refusal(self) -> str:
        """The refusal of this name: a whole-tensor optimizer, or one mpidp does not know."""
        if self.name.lower() in groupings.REFUSED:
            return groupings.refusal(self.name)
        return f"no sharded optimizer is called {self.name!r}; mpidp shards {', '.join(KINDS)} (mpidp.optim.SGD, Adam, AdamW)"


def sharded(dp: DataParallel, kind: str, groups_or_names: Any = None, **hyperparameters: Any) -> ShardedOptimizer:
    """The sharded optimizer of ``kind`` (``"sgd"``, ``"adam"``, ``"adamw"``; any case); collective.

    Optimizers whose update reads a whole tensor (``"lamb"``, ``"lars"``,
    ``"adafactor"``, ``"shampoo"``, ``"muon"``) and unknown kinds are
    refused: ContractError on every rank that says why (every rank still
    takes part in the agreement, so none is left waiting).
    """
    cls = KINDS.get(str(kind).lower())
    if cls is not None:
        return cls(dp, groups_or_names, **hyperparameters)
    _Refused(dp, str(kind))
    raise ContractError(f"{kind!r} was refused")  # pragma: no cover - the agreement raised on every rank
