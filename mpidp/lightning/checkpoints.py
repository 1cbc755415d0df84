"""A Lightning checkpoint as an mpidp checkpoint: each rank writes its slices, Lightning's own state rides along (collective).

``path`` (Lightning's ``filepath``, ``epoch=1-step=20.ckpt``) becomes the
checkpoint folder ``path.parent / path.name`` of :mod:`mpidp.checkpoint`:
one safetensors file per rank with its share of the parameters and of the
optimizer state (a sharded optimizer's slices, a replicated one's
``state_dict`` cut like the parameters), root's buffers, and a manifest;
published whole or not at all, ``path.parent/latest`` then names it. What
Lightning adds besides the model and optimizer (loops, callbacks, lr
schedulers, epoch and step, hyperparameters, the precision plugin's state)
is pickled by ``torch.save`` on root and stored in the same checkpoint as
the extra :data:`EXTRA`, so it is published with the rest. A checkpoint
written at any world size loads at any other.
"""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from ..checkpoint import StopSignal
from ..torch import DataParallel

__all__ = ["EXTRA", "StopOnSignal", "load", "save"]

#: the extra that holds Lightning's own part of a checkpoint (a ``torch.save`` of a dict, as bytes)
EXTRA = "lightning"
#: what mpidp saves itself, by parameter name and slice: left out of Lightning's part
OWN = ("state_dict", "optimizer_states")


def save(dp: DataParallel, optimizer: Any, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``checkpoint`` (Lightning's dict) into the checkpoint folder ``path`` (collective; replaces one of that name)."""
    folder = Path(path)
    blob = np.empty(0, np.uint8)
    if dp.rank == 0:  # only root's extras are written
        buffer = io.BytesIO()
        torch.save({k: v for k, v in checkpoint.items() if k not in OWN}, buffer)
        blob = np.frombuffer(buffer.getbuffer(), dtype=np.uint8).copy()
    return dp.save_checkpoint(folder.parent, optimizer, extras={EXTRA: blob}, tag=folder.name, replace=True)


def load(dp: DataParallel, optimizer: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (or a folder's newest) into the model and ``optimizer``; Lightning's dict (collective)."""
    extras = dp.load_checkpoint(path, optimizer)
    blob = extras.get(EXTRA)
    checkpoint: dict[str, Any] = {} if blob is None else torch.load(io.BytesIO(np.asarray(blob).tobytes()), weights_only=False)
    # already loaded by mpidp: what hooks that read the dict see (the loaded tensors themselves), and an empty list
    checkpoint["state_dict"] = dp.module.state_dict()
    checkpoint["optimizer_states"] = []
    return checkpoint


class StopOnSignal(Callback):
    """A Trainer callback: where any rank gets one of ``signals`` (default SIGUSR1, Slurm's ``--signal``), every rank
    stops after the same optimizer step, once ``trainer.save_checkpoint(folder / "step-<global step>")`` is written.

    Collective: one small exchange per optimizer step, at the end of the batch
    that stepped (:class:`mpidp.checkpoint.StopSignal` over the strategy's
    DataParallel; ``MPIDPStrategy`` only). The handlers are set at the start
    of ``fit`` and put back at its end (``teardown``). Go on with
    ``trainer.fit(model, ckpt_path=folder)`` (the folder's newest), at any world size.
    """

    def __init__(self, folder: str | os.PathLike[str], signals: Iterable[int] = (signal.SIGUSR1,)) -> None:
        self.folder, self.signals = Path(folder), tuple(signals)
        self.saved: Path | None = None  # the checkpoint written on the stop, if any
        self._stop: StopSignal | None = None
        self._step = 0

    def on_train_start(self, trainer: Any, module: Any) -> None:
        """Note ``signals`` from now on (local: sets the handlers)."""
        dp = getattr(trainer.strategy, "dp", None)
        if not isinstance(dp, DataParallel):  # the same strategy on every rank: the same error on every rank
            raise TypeError(f"StopOnSignal needs MPIDPStrategy (the ranks agree through its DataParallel), got {type(trainer.strategy).__name__}")
        self._stop, self._step = StopSignal(dp, self.signals), trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        """After a batch that stepped the optimizer: whether any rank got a signal; if so save and stop (collective)."""
        if self._stop is None or trainer.global_step == self._step:
            return  # inside a window: the ranks ask once per optimizer step
        self._step = trainer.global_step
        if self._stop.requested():
            self.saved = self.folder / f"step-{trainer.global_step:06d}"
            trainer.save_checkpoint(self.saved)
            trainer.should_stop = True

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        """Put back the handlers that were there before (local)."""
        if self._stop is not None:
            self._stop.close()
            self._stop = None
