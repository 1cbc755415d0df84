"""``MPIDPFabricStrategy``: ``lightning.fabric.Fabric`` over MPI, with mpidp's reduction, sharded optimizer and checkpoints.

::

    fabric = Fabric(strategy=MPIDPFabricStrategy(exact=True), accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss_sum, weight=n_tokens)      # a loss SUM and the tokens behind it (or a mean loss, no weight)
    optimizer.step(); optimizer.zero_grad()         # the reduction runs first: the exact global token mean

The window ends at ``optimizer.step()`` or at ``fabric.clip_gradients``,
whichever comes first: the gradients are reduced once, so clipping sees the
global mean. ``fabric.save``/``fabric.load`` write and read mpidp checkpoints
(each rank its slices; any world size loads them).
"""

from __future__ import annotations

import io
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only

from ..comm import Communicator, MPIComm, duplicate
from ..torch import DataParallel
from .checkpoints import EXTRA
from .collectives import Collectives, MPIDPEnvironment, StrategyCollectives, agree
from .window import Window, convert_optimizer

__all__ = ["MPIDPFabricStrategy"]


class MPIDPFabricStrategy(StrategyCollectives, ParallelStrategy):
    """A Fabric strategy over MPI: one process per rank, mpidp's DataParallel next to the module (collective to use).

    ``comm``, ``exact``, ``sharded``, ``overlap``, ``timeout``: as :class:`mpidp.lightning.MPIDPStrategy`'s.
    ``fabric.backward(loss, weight=n)`` takes a loss sum and its token count;
    without ``weight`` the loss is a mean, as under DDP. One module and one
    optimizer per strategy. ``fabric.no_backward_sync(model, enabled=...)``
    around a window's micro-batches but the last: with ``overlap`` they only
    accumulate, and the last one's backward starts the reduction.
    """

    def __init__(
        self, comm: MPIComm | None = None, *, exact: bool = False, sharded: bool = False, overlap: bool | str = False,
        timeout: float | None = None, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None, precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=MPIDPEnvironment(comm),
                         checkpoint_io=checkpoint_io, precision=precision)
        self.comm, self.exact, self.sharded, self.overlap, self.timeout = comm, exact, sharded, overlap, timeout
        self._backward_sync_control = _NoBackwardSync(self)
        self._mpi: Communicator | None = None
        self._collectives: Collectives | None = None
        self.dp: DataParallel | None = None
        self.optimizer: Any = None
        self._window = Window()
        self._reduced = False
        self._clip: float | None = None

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Duplicate the communicator, learn the hosts, check the precision (collective)."""
        if self._mpi is None:
            self._mpi = duplicate(self.comm)
            assert isinstance(self.cluster_environment, MPIDPEnvironment)
            self.cluster_environment.learn_hosts(self._mpi)
            self._collectives = Collectives(self._mpi, 0.0)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        plugin, error = self.precision, None
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
            error = f"precision plugin {type(plugin).__name__} is not supported (32-true, 16-mixed, bf16-mixed, 16-true, bf16-true are)"
        elif self.sharded and getattr(plugin, "scaler", None) is not None:
            error = "sharded=True with precision='16-mixed' is not supported: its GradScaler unscales .grad before the step; use bf16-mixed"
        agree(self._mpi, error, "setup")
        super().setup_environment()

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Build the DataParallel next to ``module`` (collective): every rank's model is checked, root's broadcast."""
        if self.dp is not None:
            self.dp.close()
        self.dp = DataParallel(module, self.comm, exact=self.exact, overlap=self.overlap, timeout=self.timeout, name="lightning-fabric")
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        """The optimizer itself, or (``sharded=True``) mpidp's sharded one on its param groups (collective)."""
        assert self.dp is not None and self._mpi is not None, "set up the module first: fabric.setup(model, optimizer)"
        self.optimizer = convert_optimizer(self.dp, self._mpi, [optimizer]) if self.sharded else optimizer
        return self.optimizer

    # ------------------------------------------------------------------ the window

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, weight: Any = None, **kwargs: Any) -> None:
        """Back-propagate ``tensor``: a loss sum with ``weight`` tokens behind it, or a mean loss (local); folded with exact."""
        self._window.note(None if weight is None else {"weight": weight})
        super().backward(tensor, module, *args, **kwargs)
        self._window.backward_done(self.dp, self.exact)

    def _reduce(self) -> None:
        """End the window: reduce every ``.grad`` to the global mean, once (collective)."""
        if not self._reduced:
            assert self.dp is not None and self._mpi is not None
            self.dp.reduce(local_weight=self._window.take(self._mpi))
            self._reduced = True

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.sharded:  # the sharded step clips by the global norm: its value is in optimizer.last.norm after the step
            self._clip = float(max_norm)
            return torch.tensor(float("nan"))
        self._reduce()
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: float) -> None:
        if self.sharded:
            raise ValueError("sharded=True clips by the global norm only: fabric.clip_gradients(model, optimizer, max_norm=...)")
        self._reduce()
        return super().clip_gradients_value(module, optimizer, clip_val)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Reduce (unless clipping did), then step; or the sharded step, which is the reduction (collective)."""
        assert self._mpi is not None
        if self.sharded:
            clip, self._clip = self._clip, None
            return optimizer.step(local_weight=self._window.take(self._mpi), max_norm=clip, **kwargs)
        self._reduce()
        self._reduced = False
        return super().optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module: Any, enabled: bool) -> AbstractContextManager[None]:
        """What ``fabric.no_backward_sync(model, enabled)`` runs: where enabled, the micro-batches of a window but the last (local)."""
        return self._window.micro_batches(self.dp) if enabled else nullcontext()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._reduce_tensor(tensor, reduce_op)  # barrier, broadcast, all_gather: StrategyCollectives

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        """An mpidp checkpoint folder at ``path``: the module and optimizer by slice, the rest of ``state`` on root (collective)."""
        assert self.dp is not None, "save before fabric.setup"
        rest = {k: v for k, v in state.items() if not self._own(v)}
        blob = np.empty(0, np.uint8)
        if self.dp.rank == 0:
            buffer = io.BytesIO()
            torch.save(self._convert_stateful_objects_in_state(rest, filter=filter or {}), buffer)
            blob = np.frombuffer(buffer.getbuffer(), dtype=np.uint8).copy()
        folder = Path(path)
        self.dp.save_checkpoint(folder.parent, self.optimizer, extras={EXTRA: blob}, tag=folder.name, replace=True)

    def load_checkpoint(self, path: str | os.PathLike[str], state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``path`` (any world size) into the module and optimizer; restore the rest of ``state``; the unused rest (collective)."""
        assert self.dp is not None, "load after fabric.setup"
        extras = self.dp.load_checkpoint(path, self.optimizer)
        blob = extras.get(EXTRA)
        saved: dict[str, Any] = {} if blob is None else torch.load(io.BytesIO(np.asarray(blob).tobytes()), weights_only=False)
        for key, obj in (state or {}).items():
            if self._own(obj) or key not in saved:
                continue
            value = saved.pop(key)
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return saved

    def _own(self, obj: Any) -> bool:
        """Whether mpidp saves ``obj`` itself: the module or the optimizer, as Fabric hands them or unwrapped (local)."""
        found = [obj, *(getattr(obj, a, None) for a in ("_forward_module", "_original_module", "optimizer"))]
        mine = [m for m in (self.optimizer, None if self.dp is None else self.dp.module) if m is not None]
        return any(a is b for a in found if a is not None for b in mine)

    def close(self) -> None:
        """Close the DataParallel and free the strategy's communicator (collective); call it when done."""
        if self.dp is not None:
            self.dp.close()
            self.dp = None
        if self._collectives is not None:
            self._collectives.close()
            self._collectives = self._mpi = None


class _NoBackwardSync(_BackwardSyncControl):
    """Fabric's hook for ``fabric.no_backward_sync``: the strategy's own ``no_backward_sync`` (local)."""

    def __init__(self, strategy: MPIDPFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: Any, enabled: bool) -> AbstractContextManager[None]:
        return self.strategy.no_backward_sync(module, enabled)
