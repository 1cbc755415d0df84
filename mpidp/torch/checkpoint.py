"""A module's and a torch optimizer's state for checkpoints (:mod:`mpidp.checkpoint`), and back.

Parameters go as the core's (each rank its share). Buffers are local to
each rank after construction, so the root's are saved (as raw bytes, any
dtype) and every rank loads them. An optimizer serves the one contract of
:mod:`mpidp.optim.state`: mpidp's sharded ones serve it themselves (each
rank its slices); a replicated ``torch.optim`` optimizer through
:class:`TorchOptimizerState`, which saves what its ``state_dict()`` holds:
state tensors shaped like their parameter under the same keys as the
sharded ones (``state/<state>/<parameter>``, cut across the ranks like the
parameters), everything else (``step``, the param groups by parameter
name) in the description. Nothing is written before every rank has
checked, read and prepared the whole load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import files, state
from ..optim.state import OptimizerState, Piece, Run, state_key

__all__ = ["TorchOptimizerState", "load", "optimizer_state", "save"]


class TorchOptimizerState(OptimizerState):
    """A replicated ``torch.optim`` optimizer as a checkpoint sees it (:mod:`mpidp.optim.state`'s contract).

    ``params``: the adapter's ``{name: parameter}`` (tied names included);
    every tensor of the optimizer's param groups must be one of them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, Any]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        head_of = {id(params[n]): n for n in state.heads(params)[0]}
        self._groups = [[head_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self._order = [n for names in self._groups for n in names]

    def _tensors(self, sd: Mapping[str, Any]) -> dict[tuple[str, str], torch.Tensor]:
        """The state tensors of ``sd`` (its ``state_dict()``) shaped like their parameter, by (state, parameter)."""
        out = {}
        for index, values in sd["state"].items():
            name = self._order[index]
            for key, v in values.items():
                if isinstance(v, torch.Tensor) and v.shape == self.params[name].shape and v.dim() > 0:
                    out[(key, name)] = v
        return out

    def describe(self) -> dict[str, Any]:
        """Param groups by parameter name, the scalar state (``step``), which state tensors exist (local)."""
        sd = self.optimizer.state_dict()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self._order[i] for i in g["params"]]} for g in sd["param_groups"]]
        tensors = self._tensors(sd)
        scalars: dict[str, dict[str, Any]] = {}
        for index, values in sd["state"].items():
            for key, v in values.items():
                if (key, self._order[index]) in tensors:
                    continue
                scalars.setdefault(self._order[index], {})[key] = (
                    {"tensor": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")} if isinstance(v, torch.Tensor) else v
                )
        return {"param_groups": groups, "scalars": scalars, "tensors": sorted([k, n] for k, n in tensors)}

    def pieces(self, rank: int, size: int) -> list[Piece]:
        """This rank's share of the state tensors (float32), laid end to end and cut like the parameters."""
        found = sorted(self._tensors(self.optimizer.state_dict()).items())
        tensors = {state_key(k, n): v.detach().to("cpu", torch.float32).reshape(-1).numpy() for (k, n), v in found}
        shapes = {state_key(k, n): tuple(self.params[n].shape) for (k, n), _ in found}
        return state.shares(tensors, shapes, rank, size, lambda key: key)

    def wants(self, description: Mapping[str, Any]) -> list[Run]:
        """Every state tensor the checkpoint holds, whole (ValueError: other param groups)."""
        groups = description.get("param_groups")
        if not isinstance(groups, list) or [sorted(g.get("params", [])) if isinstance(g, dict) else None for g in groups] != [sorted(g) for g in self._groups]:
            raise ValueError("another optimizer: its param groups hold other parameters than the checkpoint's")
        tensors = description.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, list) and len(t) == 2 and t[1] in self.params for t in tensors):
            raise ValueError("the optimizer's 'tensors' must list [state, parameter] pairs of this model")
        return [Run(state_key(k, n), tuple(self.params[n].shape), "float32", 0, files.numel(self.params[n].shape)) for k, n in tensors]

    def prepare(self, description: Mapping[str, Any], values: Sequence[np.ndarray]) -> Callable[[], None]:
        """The ``state_dict`` to hand ``load_state_dict`` (this optimizer's group order and indices), checked."""
        index = {n: i for i, n in enumerate(self._order)}
        per: dict[int, dict[str, Any]] = {}
        try:
            for (k, n), v in zip(description["tensors"], values):
                per.setdefault(index[n], {})[k] = torch.from_numpy(v.reshape(self.params[n].shape).copy())
            for n, scalars in description["scalars"].items():
                for k, v in scalars.items():
                    per.setdefault(index[n], {})[k] = torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"])) if isinstance(v, dict) else v
            by_names = {tuple(sorted(g["params"])): g for g in description["param_groups"]}
            groups = [{**by_names[tuple(sorted(names))], "params": [index[n] for n in names]} for names in self._groups]
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise ValueError(f"the optimizer's state does not fit {self.kind}: {type(e).__name__}: {e}") from None
        sd = {"state": per, "param_groups": groups}
        return lambda: self.optimizer.load_state_dict(sd)


def optimizer_state(optimizer: Any, params: Mapping[str, Any]) -> tuple[OptimizerState | None, str | None]:
    """The checkpoint contract of ``optimizer`` (None: none), or this rank's error naming what it is."""
    if optimizer is None or isinstance(optimizer, OptimizerState):  # mpidp's sharded optimizers serve it themselves
        return optimizer, None
    if isinstance(optimizer, torch.optim.Optimizer):
        try:
            return TorchOptimizerState(optimizer, params), None
        except KeyError:
            return None, "the optimizer holds a tensor that is not a parameter of the DataParallel's module"
    return None, f"checkpoints hold a torch.optim optimizer or an mpidp sharded one, got {type(optimizer).__name__}"


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer once (the first name of a shared one), by name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, b in sorted(module.named_buffers(remove_duplicate=False), key=lambda item: item[0]):
        if id(b) not in seen:
            seen.add(id(b))
            out[name] = b
    return out


def _described(b: torch.Tensor) -> str:
    return f"{str(b.dtype).removeprefix('torch.')} {list(b.shape)}"


def _bytes(b: torch.Tensor) -> np.ndarray:
    return b.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()


def save(
    session: Any, module: torch.nn.Module, params: Mapping[str, Any], folder: str | os.PathLike[str], optimizer: Any,
    extras: Mapping[str, Any] | None, tag: str | None, replace: bool = False,
) -> Path:
    """Write the module's parameters and buffers, ``optimizer``'s state and ``extras`` (collective; see the adapter's method)."""
    extras = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in (extras or {}).items()}
    contract, error = optimizer_state(optimizer, params)
    buffers = {n: (_described(b), _bytes(b) if session.rank == 0 else np.empty(0, np.uint8)) for n, b in buffers_of(module).items()}
    return state.save(session, folder, params, optimizer=contract, extras=extras, tag=tag, replace=replace, buffers=buffers, error=error)


def load(session: Any, module: torch.nn.Module, params: Mapping[str, Any], where: str | os.PathLike[str], optimizer: Any) -> dict[str, Any]:
    """Read a checkpoint of any world size into the module, its buffers and ``optimizer`` (collective)."""
    buffers = buffers_of(module)
    contract, error = optimizer_state(optimizer, params)
    wanted = {n: (_described(b), b.numel() * b.element_size()) for n, b in buffers.items()}
    loaded = state.prepare_load(session, where, params, optimizer=contract, buffers=wanted, error=error)
    loaded.commit()
    for name, raw in loaded.buffers.items():
        buffers[name].view(-1).view(torch.uint8).copy_(torch.from_numpy(raw))
    return loaded.extras
