"""``MPIDPStrategy``: ``lightning.pytorch.Trainer`` over MPI, with mpidp's exact token mean, invariant bits, sharded optimizer and checkpoints.

::

    trainer = L.Trainer(strategy=MPIDPStrategy(exact=True), accelerator="cpu", devices=1, accumulate_grad_batches=4)
    trainer.fit(model)        # mpiexec -n 4 python -m mpi4py train.py   (or srun)

The strategy builds a :class:`mpidp.torch.DataParallel` next to the
LightningModule (nothing is put around it: ``trainer.model`` is the module)
and owns the window: after the backward passes of an accumulation window
and before the gradient clipping and the optimizer step it reduces every
``.grad`` (:mod:`mpidp.lightning.window`); with ``exact=True`` each
micro-batch's gradients are folded right after its backward; with
``sharded=True`` the optimizer step is the reduction (the one AdamW, Adam or
SGD of ``configure_optimizers`` becomes mpidp's sharded one, on the same
param groups). Checkpoints are mpidp's (:mod:`mpidp.lightning.checkpoints`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ..comm import Communicator, MPIComm, duplicate
from ..torch import DataParallel
from . import checkpoints
from .collectives import Collectives, MPIDPEnvironment, StrategyCollectives, agree
from .window import Window, convert_optimizer

__all__ = ["MPIDPStrategy"]


class MPIDPStrategy(StrategyCollectives, ParallelStrategy):
    """A Trainer strategy over MPI: replicated data parallelism with mpidp's reduction, one process per rank.

    Collective to use (every rank's Trainer runs the same calls). ``comm``:
    the mpi4py communicator of the ranks (default ``COMM_WORLD``).
    ``exact=True``: the same bits at any world size (CPU parameters; fold
    every micro-batch). ``sharded=True``: the optimizer state in slices, one
    per rank. ``overlap``: the DataParallel's (``True``, ``"thread"``,
    ``"hooks"``: the reduction starts during the window's last backward;
    not with ``sharded``). ``timeout``: seconds one collective may wait (None:
    ``MPIDP_TIMEOUT``). Other keywords are DDPStrategy's and are refused at
    setup, on every rank, with one ContractError naming them.
    """

    def __init__(
        self, comm: MPIComm | None = None, *, exact: bool = False, sharded: bool = False, overlap: bool | str = False,
        timeout: float | None = None, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None, precision_plugin: Precision | None = None, **ddp_options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=MPIDPEnvironment(comm),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.comm, self.exact, self.sharded, self.overlap, self.timeout = comm, exact, sharded, overlap, timeout
        self._refused = sorted(ddp_options)
        self._mpi: Communicator | None = None
        self._collectives: Collectives | None = None
        self.dp: DataParallel | None = None
        self._window = Window()
        self._clip: float | None = None
        self._scale = 1  # what the window's loss sums are multiplied by before backward: Lightning divided them by it

    # ------------------------------------------------------------------ the ranks

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then gives each rank its share of the data (a DistributedSampler)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Duplicate the communicator, learn the hosts, check the options (collective)."""
        if self._mpi is None:
            self._mpi = duplicate(self.comm)
            assert isinstance(self.cluster_environment, MPIDPEnvironment)
            self.cluster_environment.learn_hosts(self._mpi)
            self._collectives = Collectives(self._mpi, 0.0)
        rank_zero_only.rank = fabric_rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        error = f"MPIDPStrategy does not take DDPStrategy's options {self._refused}" if self._refused else None
        agree(self._mpi, error, "setup")
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        """Convert and place the module, build the DataParallel next to it, the optimizers (collective)."""
        assert self.accelerator is not None and self._mpi is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        agree(self._mpi, self._setup_problem(trainer), "setup")
        module = self.lightning_module
        assert module is not None
        if self.dp is None or self.dp.module is not module:
            self._close_session()
            self.dp = DataParallel(module, self.comm, exact=self.exact, overlap=self.overlap, timeout=self.timeout, name="lightning")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            agree(self._mpi, self._optimizer_problem(), "setup")
            if self.sharded:
                self._shard(trainer)
        self.setup_precision_plugin()

    def _setup_problem(self, trainer: Any) -> str | None:
        """What this strategy cannot run of the trainer's configuration, or None (local)."""
        plugin = self.precision_plugin
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
            return f"precision plugin {type(plugin).__name__} is not supported (32-true, 16-mixed, bf16-mixed, 16-true, bf16-true are)"
        scaled = getattr(plugin, "scaler", None) is not None
        if self.sharded and scaled:
            return "sharded=True with precision='16-mixed' is not supported: its GradScaler unscales .grad before the step; use bf16-mixed"
        if self.sharded and trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
            algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
            return f"sharded=True clips by the global norm only (gradient_clip_algorithm='norm'), got {algorithm!r}"
        if self.exact and self.root_device.type != "cpu":
            return f"exact=True needs CPU parameters; this rank's device is {self.root_device}"
        return None

    def _optimizer_problem(self) -> str | None:
        """Why the optimizers cannot be checkpointed or stepped here, or None (local)."""
        if len(self.optimizers) > 1:
            return f"one optimizer per module is supported (its state goes into mpidp's checkpoints), got {len(self.optimizers)}"
        return None

    def _shard(self, trainer: Any) -> None:
        """Turn the optimizer into mpidp's sharded one on the same param groups; its schedulers follow (collective)."""
        assert self.dp is not None and self._mpi is not None
        old = self.optimizers[0] if self.optimizers else None
        new = convert_optimizer(self.dp, self._mpi, list(self.optimizers))
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is old:
                config.scheduler.optimizer = new
        self.optimizers = [new]
        self._clip = float(trainer.gradient_clip_val) if trainer.gradient_clip_val else None
        self.precision_plugin.clip_gradients = _no_clip  # type: ignore[method-assign]  # the sharded step clips (max_norm)

    # ------------------------------------------------------------------ the window

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        module = self.lightning_module
        if module is not None and module.automatic_optimization and self._window.note(out):
            self._scale = module.trainer.accumulate_grad_batches  # Lightning divides the loss by it; a sum is not divided
        else:
            self._scale = 1
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._scale > 1:  # (sum / k) * k: backward sends exactly 1.0 into the sum, as sum.backward() does
            closure_loss = closure_loss * self._scale
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self._window.backward_done(self.dp, self.exact)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's context for the micro-batches of a window but the last: with ``overlap`` they only accumulate (local)."""
        with self._window.micro_batches(self.dp):
            yield

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the window's closure, reduce (or step the sharded optimizer), clip, step (collective)."""
        model = model or self.lightning_module
        dp, mpi = self.dp, self._mpi
        assert dp is not None and mpi is not None
        step = model.trainer.global_step if model is not None and model._trainer is not None else None
        if self.sharded:
            loss = self.precision_plugin._wrap_closure(model, optimizer, closure)  # backward, hooks; clipping is the step's
            optimizer.step(local_weight=self._window.take(mpi), step=step, max_norm=self._clip, **kwargs)
            return loss

        def reduced() -> Any:
            out = closure()
            dp.reduce(local_weight=self._window.take(mpi), step=step)
            return out

        return self.precision_plugin.optimizer_step(optimizer, model=model, closure=reduced, **kwargs)

    # ------------------------------------------------------------------ collectives

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._reduce_tensor(tensor, reduce_op)  # barrier, broadcast, all_gather: StrategyCollectives

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the DataParallel and the optimizer exist: mpidp loads into them

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # mpidp's checkpoint holds it, each rank its share

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any = None) -> None:
        """Write ``checkpoint`` as an mpidp checkpoint folder at ``filepath``: each rank its slices (collective)."""
        assert self.dp is not None, "save_checkpoint before setup"
        checkpoints.save(self.dp, self._optimizer(loading=False), checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any world size into the module and the optimizer; Lightning's part of it (collective)."""
        assert self.dp is not None, "load_checkpoint before setup"
        return checkpoints.load(self.dp, self._optimizer(loading=True), checkpoint_path)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the parameters and buffers (local)."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizer's state (local)."""

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        if self.is_global_zero:
            shutil.rmtree(Path(filepath), ignore_errors=True)

    def _optimizer(self, loading: bool) -> Any:
        """The optimizer a checkpoint holds the state of: the fit's, where it steps the module set up now; none to load
        outside ``fit`` (``validate``, ``test`` and ``predict`` load the module only, as Lightning does) (local)."""
        trainer = None if self.lightning_module is None else self.lightning_module._trainer
        if not self.optimizers or (loading and trainer is not None and trainer.state.fn != TrainerFn.FITTING):
            return None
        assert self.dp is not None
        mine = {id(p) for p in self.dp.module.parameters()}
        opt = self.optimizers[0]  # after fit, validate(another_module) sets that one up: the fit's optimizer is not its
        return opt if all(id(p) in mine for g in opt.param_groups for p in g["params"]) else None

    # ------------------------------------------------------------------ the end

    def _close_session(self) -> None:
        """Close the DataParallel (collective); the next setup builds a new one. Trainer.save_checkpoint needs it open."""
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    def close(self) -> None:
        """Close the DataParallel and free the strategy's communicator (collective); call it when done with the Trainer."""
        self._close_session()
        if self._collectives is not None:
            self._collectives.close()
            self._collectives = self._mpi = None


def _no_clip(optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
    """The precision plugin's clipping under ``sharded=True``: the sharded step clips by the global norm (``max_norm``)."""
