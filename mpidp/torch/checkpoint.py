"""A module's and a torch optimizer's state as checkpoint pieces (:mod:`mpidp.checkpoint`), and back.

Parameters go as the core's (each rank its share). Buffers are local to
each rank after construction, so the root's are saved (as raw bytes, any
dtype) and every rank loads them. A replicated ``torch.optim`` optimizer's
state goes under its own keys (``exp_avg``, ``momentum_buffer``, ...
whatever its ``state_dict()`` holds): a state tensor shaped like its
parameter is cut across the ranks like the parameters, anything else
(``step``) goes into the manifest; its param groups too, with parameter
names instead of indices. A sharded optimizer (``state_pieces``) goes as
the core's: each rank its own slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import files, state
from ..checkpoint.collective import Piece, Want

__all__ = ["load", "save"]


def save(
    session: Any, module: torch.nn.Module, params: Mapping[str, Any], folder: str | Path, optimizer: Any, extras: Mapping[str, Any] | None, tag: str | None
) -> Path:
    """Write the module's parameters and buffers, ``optimizer``'s state and ``extras`` (collective; see the adapter's method)."""
    extras = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in (extras or {}).items()}
    sharded = _sharded(optimizer)
    kind, head = _describe(optimizer if sharded is None else sharded, params)
    buffers = _buffers(module)

    def more() -> list[Piece]:
        out = [Piece(f"buffer/{n}", (b.numel() * b.element_size(),), "uint8", 0, _bytes(b)) for n, b in buffers.items()] if session.rank == 0 else []
        if kind is None:
            return out
        if sharded is not None:
            return out + state.optimizer_pieces(sharded, params)
        tensors = _state_tensors(optimizer, params)
        return out + state.param_pieces(tensors, sorted(tensors), session.rank, session.world_size, prefix="ostate/")

    adapter = {"framework": "torch", "buffers": {n: [str(b.dtype), list(b.shape)] for n, b in buffers.items()}}
    return state.write(session, folder, params, extras, tag, head, more, adapter)


def load(session: Any, module: torch.nn.Module, params: Mapping[str, Any], where: str | Path, optimizer: Any) -> dict[str, Any]:
    """Read a checkpoint of any world size into the module, its buffers and ``optimizer`` (collective)."""
    buffers = _buffers(module)
    sharded = _sharded(optimizer)
    kind, _ = _describe(optimizer if sharded is None else sharded, params)
    try:
        saved = files.read_manifest(state.collective.resolve(where)).get("optimizer")
    except ValueError:
        saved = None  # load_state says why, on every rank
    wants = [Want(f"buffer/{n}", (b.numel() * b.element_size(),), "uint8", 0, b.numel() * b.element_size()) for n, b in buffers.items()]
    tensors = {}
    if kind is not None and sharded is None and saved is not None and saved.get("kind") == kind:
        tensors = {key: tuple(shape) for key, shape in saved["hyperparameters"]["tensors"].items()}
        wants += [Want(f"ostate/{key}", shape, "float32", 0, int(np.prod(shape, dtype=np.int64))) for key, shape in tensors.items()]

    def then(path: Path, manifest: Mapping[str, Any], got: list[np.ndarray]) -> None:
        for (_, b), raw in zip(buffers.items(), got):
            b.view(-1).view(torch.uint8).copy_(torch.from_numpy(raw))
        if sharded is not None:
            saved = manifest["optimizer"]["hyperparameters"]
            with files.Reader(path, manifest) as reader:
                sharded.load(saved, lambda s, n, lo, hi: reader.read(f"state/{s}/{n}", lo, hi))
            for group, loaded in zip(getattr(optimizer, "param_groups", []), saved["groups"]):  # a scheduled lr, as load_state_dict
                group.update({k: tuple(v) if isinstance(v, list) else v for k, v in loaded.items() if k in group and k != "params"})
        elif kind is not None:
            _load_torch(optimizer, params, manifest["optimizer"]["hyperparameters"], dict(zip(tensors, got[len(buffers) :])))

    return state.read(session, where, params, kind, wants, then, judge=lambda m: _judge(m, None if sharded is not None else optimizer, params, buffers))


def _sharded(optimizer: Any) -> Any:
    """The core sharded optimizer of ``optimizer`` (a torch one's ``.sharded``, or itself), or None for a replicated one."""
    inner = getattr(optimizer, "sharded", optimizer)
    return inner if hasattr(inner, "state_pieces") else None


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer once (the first name of a shared one), by name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, b in sorted(module.named_buffers(remove_duplicate=False), key=lambda item: item[0]):
        if id(b) not in seen:
            seen.add(id(b))
            out[name] = b
    return out


def _bytes(b: torch.Tensor) -> np.ndarray:
    return b.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()


def _buffer_problem(manifest: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> str | None:
    saved = (manifest.get("adapter") or {}).get("buffers", {})
    mine = {n: [str(b.dtype), list(b.shape)] for n, b in buffers.items()}
    for name in sorted(set(saved) | set(mine)):
        if saved.get(name) != mine.get(name):
            theirs, ours = (" ".join(map(str, x)) if x else "absent" for x in (saved.get(name), mine.get(name)))
            return f"another model: buffer {name!r} is {theirs} in the checkpoint, {ours} here"
    return None


def _judge(manifest: Mapping[str, Any], optimizer: Any, params: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> str | None:
    problem = _buffer_problem(manifest, buffers)
    if problem is not None or optimizer is None:
        return problem
    saved = manifest["optimizer"]["hyperparameters"]["param_groups"]
    groups = [sorted(names) for names in _groups(optimizer, params)]
    if [sorted(g["params"]) for g in saved] != groups:
        return "another optimizer: its param groups hold other parameters than the checkpoint's"
    return None


def _groups(optimizer: Any, params: Mapping[str, Any]) -> list[list[str]]:
    """The names (tie heads) of each param group's tensors, in the optimizer's order."""
    head_of = {id(params[n]): n for n in state.heads(params)[0]}
    return [[head_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _describe(optimizer: Any, params: Mapping[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The optimizer's kind and manifest entry (None, None without one)."""
    if optimizer is None:
        return None, None
    if hasattr(optimizer, "state_pieces"):
        return optimizer.kind, {"kind": optimizer.kind, "hyperparameters": optimizer.hyperparameters(), "state_names": list(optimizer.state_names())}
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    sd = optimizer.state_dict()
    order = [n for names in _groups(optimizer, params) for n in names]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]
    scalars: dict[str, dict[str, Any]] = {}
    tensors: dict[str, list[int]] = {}
    for index, values in sd["state"].items():
        name = order[index]
        for key, v in values.items():
            if isinstance(v, torch.Tensor) and v.shape == params[name].shape and v.dim() > 0:
                tensors[f"{key}/{name}"] = list(v.shape)
            elif isinstance(v, torch.Tensor):
                scalars.setdefault(name, {})[key] = {"tensor": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
            else:
                scalars.setdefault(name, {})[key] = v
    keys = sorted({k.split("/")[0] for k in tensors} | {k for s in scalars.values() for k in s})
    return kind, {"kind": kind, "hyperparameters": {"param_groups": groups, "scalars": scalars, "tensors": tensors}, "state_names": keys}


def _state_tensors(optimizer: Any, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors shaped like their parameters, as float32 CPU tensors, by ``<key>/<parameter>``."""
    order = [n for names in _groups(optimizer, params) for n in names]
    out = {}
    for index, values in optimizer.state_dict()["state"].items():
        for key, v in values.items():
            if isinstance(v, torch.Tensor) and v.shape == params[order[index]].shape and v.dim() > 0:
                out[f"{key}/{order[index]}"] = v.detach().to("cpu", torch.float32)
    return out


def _load_torch(optimizer: Any, params: Mapping[str, Any], saved: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """Hand a saved replicated optimizer state to ``optimizer.load_state_dict`` (its groups' order, its indices)."""
    mine = _groups(optimizer, params)
    order = [n for names in mine for n in names]
    index = {n: i for i, n in enumerate(order)}
    per: dict[int, dict[str, Any]] = {}
    for key, values in tensors.items():
        k, name = key.split("/", 1)
        per.setdefault(index[name], {})[k] = torch.from_numpy(values.reshape(params[name].shape).copy())
    for name, values in saved["scalars"].items():
        for k, v in values.items():
            per.setdefault(index[name], {})[k] = torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"])) if isinstance(v, dict) and "tensor" in v else v
    by_names = {tuple(sorted(g["params"])): g for g in saved["param_groups"]}
    groups = [{**by_names[tuple(sorted(names))], "params": [index[n] for n in names]} for names in mine]
    optimizer.load_state_dict({"state": per, "param_groups": groups})
