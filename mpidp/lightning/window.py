"""One accumulation window of a Lightning strategy: the weights the steps returned, the agreement, the reduction or the sharded step.

A step that returns its loss **sum** says how many tokens (or samples) are
behind it under :data:`WEIGHT` (``{"loss": loss_sum, "weight": n}``); the
window's local weight is the sum of them, and the reduction gives the exact
global token mean (:meth:`mpidp.torch.DataParallel.reduce`). A step that
returns a mean loss (a tensor, or a dict without the key) counts as weight 1
per rank and window: the mean over ranks of each rank's mean, as DDP. The
ranks agree on the kind before any gradient moves.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..comm import Communicator
from ..errors import ContractError
from ..torch import DataParallel, ShardedAdam, ShardedAdamW, ShardedSGD
from .collectives import agree

__all__ = ["WEIGHT", "Window", "convert_optimizer"]

#: the key of a training step's output that holds the token (or sample) count behind a loss sum
WEIGHT = "weight"


class Window:
    """The weights of the steps since the last reduction, on this rank (local until :meth:`reduce` or :meth:`take`)."""

    def __init__(self) -> None:
        self.weights: list[Any] = []
        self.kinds: set[bool] = set()  # True: a step returned a weight; False: one returned a mean loss
        self.blocked = False  # inside micro_batches: a micro-batch of the window but its last

    @contextmanager
    def micro_batches(self, dp: DataParallel | None) -> Generator[None, None, None]:
        """The micro-batches of the window but its last (local): with ``overlap`` their backward passes only accumulate."""
        self.blocked = True
        try:
            with nullcontext() if dp is None else dp.no_sync():
                yield
        finally:
            self.blocked = False

    def backward_done(self, dp: DataParallel | None, exact: bool) -> None:
        """After a micro-batch's backward (local): with ``exact`` it is folded into the window's exact sums, but
        the last one's under ``overlap``, whose ``.grad`` goes to the reduction as it is."""
        if exact and dp is not None and (self.blocked or dp.overlap is None):
            dp.fold()

    def note(self, output: Any) -> bool:
        """Count a training step's ``output``; True where it carries a :data:`WEIGHT` (a loss sum) (local)."""
        weighted = isinstance(output, Mapping) and WEIGHT in output
        self.kinds.add(weighted)
        if weighted:
            w = output[WEIGHT]
            if isinstance(w, torch.Tensor) and w.numel() == 1 and not w.is_floating_point() and w.dtype != torch.bool:
                w = int(w.item())
            self.weights.append(w)
        return weighted

    def take(self, comm: Communicator) -> int:
        """The window's local weight, after every rank agreed that all steps were of one kind (collective); starts a new window."""
        kinds, weights = self.kinds, self.weights
        self.weights, self.kinds = [], set()
        bad = [w for w in weights if not _is_int(w)]
        error = None
        if len(kinds) > 1:
            error = f"training steps of one window returned a {WEIGHT!r} (a loss sum) and a mean loss: return one kind"
        elif bad:
            error = f"{WEIGHT!r} must be a non-negative integer or an integer tensor of one element, got {bad[0]!r}"
        mine = "sum" if kinds == {True} else "mean"
        every = comm.allgather_obj((mine, error), "lightning: the window's kind")
        problems = "; ".join(f"rank {r}: {e}" for r, (_, e) in enumerate(every) if e)
        if not problems and len({k for k, _ in every}) > 1:
            problems = ", ".join(f"rank {r}: a {'loss sum with a weight' if k == 'sum' else 'mean loss'}" for r, (k, _) in enumerate(every))
            problems = f"ranks' training steps returned different kinds of loss ({problems}): every rank returns a {WEIGHT!r} or none does"
        if problems:  # every rank gathered the same records: the same error on every rank, with no second exchange
            raise ContractError(f"MPIDPStrategy, the window: {problems}")
        return sum(weights) if mine == "sum" else 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: the torch optimizers ``sharded=True`` converts, by class, and the sharded class each becomes
SHARDED: dict[type, type] = {torch.optim.AdamW: ShardedAdamW, torch.optim.Adam: ShardedAdam, torch.optim.SGD: ShardedSGD}


def convert_optimizer(dp: DataParallel, comm: Communicator, optimizers: list[Any]) -> Any:
    """The sharded optimizer of ``optimizers``' one AdamW, Adam or SGD, on the same param group dicts (collective).

    The groups are the same dict objects, so a scheduler that writes ``lr``
    into the old optimizer's groups writes the sharded one's. Anything else
    (no optimizer, several, another class) is one ContractError on every rank.
    """
    classes = SHARDED
    error = None
    if len(optimizers) != 1:
        error = f"sharded=True needs exactly one optimizer from configure_optimizers, got {len(optimizers)}"
    elif type(optimizers[0]) not in classes:
        error = (f"sharded=True converts torch.optim.AdamW, Adam or SGD (mpidp's sharded optimizers); configure_optimizers returned "
                 f"{type(optimizers[0]).__qualname__}: use one of those three, or sharded=False")
    agree(comm, error, "the sharded optimizer")
    old = optimizers[0]
    return classes[type(old)](dp, old.param_groups)
