"""Sharded optimizers (ZeRO-1/2): each rank keeps and updates one contiguous slice of the optimizer state.

``mpidp.optim.AdamW(dp, ...)``, :class:`Adam` and :class:`SGD` are the
elementwise optimizers; :func:`sharded` builds one by name and refuses the
optimizers whose update reads a whole tensor (LAMB, LARS, Adafactor,
Shampoo, Muon). The cut is :mod:`mpidp.cut`'s, the update rules
:mod:`mpidp.optim.rules`', the exact global norm :mod:`mpidp.optim.norm`'s.
"""

from .optimizers import SGD, Adam, AdamW, sharded
from .sharded import ShardedOptimizer, StepResult

__all__ = ["SGD", "Adam", "AdamW", "ShardedOptimizer", "StepResult", "sharded"]
