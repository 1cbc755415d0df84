"""PyTorch Lightning over MPI: a Trainer strategy and a Fabric strategy with mpidp's reduction, sharded optimizer and checkpoints.

``MPIDPStrategy`` (``lightning.pytorch.Trainer``) in :mod:`mpidp.lightning.trainer`,
``MPIDPFabricStrategy`` (``lightning.fabric.Fabric``) in :mod:`mpidp.lightning.fabric`;
what both ask of MPI in :mod:`mpidp.lightning.collectives`, the window in
:mod:`mpidp.lightning.window`, checkpoints in :mod:`mpidp.lightning.checkpoints`.
Needs the ``lightning`` extra (``pip install ".[lightning]"`` from a checkout); docs/lightning.md.
"""

from .checkpoints import StopOnSignal
from .collectives import MPIDPEnvironment
from .fabric import MPIDPFabricStrategy
from .trainer import MPIDPStrategy
from .window import WEIGHT

__all__ = ["WEIGHT", "MPIDPEnvironment", "MPIDPFabricStrategy", "MPIDPStrategy", "StopOnSignal"]
