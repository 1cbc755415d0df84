"""What the PyTorch adapter reads of a model before the ranks agree, and the flat storage its ``.grad`` live in (local).

Every reader here returns a problem instead of raising, so that a model this
rank cannot serve is an error on every rank at the agreement: its
parameters' layout (:func:`check_module`), its buffers as named byte regions
moved with the parameters (:func:`regions`), its parameters moved into flat
storage (:func:`flatten`), and the hook that keeps each ``.grad`` in mpidp's
flat gradient storage (:func:`into_flat`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .. import arrays, core
from ..checks import ByteRegions
from ..contract import Region

__all__ = ["Marks", "buffers", "bytes_of", "check_module", "flatten", "into_flat", "refused", "regions"]


class Marks:
    """Whether every ``.grad`` in flat storage still holds what the last backward (or mpidp) left there (local).

    Every backward's hook and mpidp's own writes mark the storage's version
    counter (shared by all views of one flat tensor); any other in-place
    write (``clip_grad_norm_``, ``scaler.unscale_``, an edit) moves it on.
    ``reduced``: :meth:`DataParallel.reduce` wrote the window's mean there.
    """

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        self._views = views
        self._key = {h: id(v if v._base is None else v._base) for h, v in views.items()}
        self._marks: dict[int, int] = {}
        self.reduced = False
        self.mark_all()

    def mark(self, head: str) -> None:
        """A backward accumulated into ``head``'s view: its storage holds backward's sums (the hook's)."""
        self._marks[self._key[head]] = self._views[head]._version
        self.reduced = False

    def mark_all(self) -> None:
        """mpidp wrote every view (zeroed, folded): they hold what mpidp left there."""
        for head in self._views:
            self.mark(head)

    def problem(self, params: Mapping[str, Any]) -> str | None:
        """Why ``.grad`` no longer holds this rank's own loss sums of the window, or None."""
        if self.reduced:
            return (
                "dp.reduce and a sharded step in one window: the step is the reduction (a reduce-scatter to the owners), "
                "so the gradients would be divided twice; call opt.step(local_weight=n) without dp.reduce"
            )
        for head, view in self._views.items():
            p = params.get(head)
            if p is not None and p.grad is view and self._marks.get(self._key[head]) != view._version:
                return (
                    f"the .grad of {head!r} was changed between backward and the sharded step (clip_grad_norm_, "
                    "scaler.unscale_ or another edit): .grad holds this rank's own unreduced loss sums, so the edit "
                    "differs on every rank; clip by the global norm with opt.step(local_weight=n, max_norm=...) instead"
                )
        return None


def into_flat(view: torch.Tensor, seen: Callable[[], None] | None = None) -> Any:
    """A post-accumulate-grad hook that makes ``view`` (flat storage) the parameter's ``.grad``.

    Autograd accumulates into an existing ``.grad`` in place, so once a
    gradient is the view it stays there; a gradient autograd allocated anew
    (the first backward, or after ``zero_grad(set_to_none=True)``) is copied
    in once; then ``seen()`` (:meth:`Marks.mark`). Sparse gradients are left as they are, and so is a gradient
    that no longer fits the view (a parameter whose ``.data`` was resized,
    cast or moved after wrapping): the hook runs inside ``backward()`` and
    never raises there; ``reduce`` names the changed parameter on every rank.
    """

    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g is not view and g.layout == torch.strided and (g.shape, g.dtype, g.device) == (view.shape, view.dtype, view.device):
            try:  # else the model changed after wrapping: reduce refuses it on every rank
                with torch.no_grad():
                    view.copy_(g)
                p.grad = view
            except Exception:  # noqa: BLE001 - never inside backward(): reduce checks what .grad holds
                return
        if seen is not None and p.grad is view:
            seen()

    return hook


def flatten(params: dict[str, Any]) -> tuple[list[tuple[torch.nn.Parameter, torch.Tensor]], str | None]:
    """Make every parameter's ``.data`` a view into flat storage: (parameter, old data) pairs, or why not.

    Local and before the ranks agree: a failure is this rank's error, with
    nothing moved. A parameter mpidp refuses is left where it is, for the
    core to name on every rank.
    """
    moved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        unique: dict[int, str] = {}
        for name in sorted(params):
            unique.setdefault(id(params[name]), name)
        if any(arrays.problem(params[name]) is not None for name in unique.values()):
            return [], None
        flat = core.flat_parameters({name: params[name].detach() for name in unique.values()})
        for name in unique.values():
            p = params[name]
            moved.append((p, p.data))
            p.data = flat[name]
    except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
        for p, old in moved:
            p.data = old
        return [], f"could not lay the parameters out flat (flat_parameters=True): {type(e).__name__}: {e}"
    return moved, None


def check_module(model: Any) -> str | None:
    """Return what makes ``model`` unusable, without communicating."""
    if not isinstance(model, torch.nn.Module):
        return f"model must be a torch.nn.Module, got {type(model).__name__}"
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.layout != torch.strided:
            return f"parameter {name!r} is a {p.layout} tensor; mpidp moves dense (strided) parameters"
    return None


def buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return sorted(model.named_buffers(remove_duplicate=False), key=lambda item: item[0])


def regions(buffers: list[tuple[str, torch.Tensor]]) -> ByteRegions:
    """This rank's buffers as named byte regions for the core (each shared tensor once), or why not.

    Made before the ranks agree, so that a buffer this rank cannot read (sparse,
    on the meta device, uninitialized, ...) is an error on every rank instead of
    a failure on one.
    """
    first: dict[int, str] = {}
    entries: list[Region] = []
    views: list[np.ndarray] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, host copy its bytes travel through)
    name = ""
    try:
        for name, b in buffers:
            entries.append(Region(name, tuple(b.shape), str(b.dtype).removeprefix("torch."), first.setdefault(id(b), name)))
            if first[id(b)] != name:  # a name of a tensor already prepared
                continue
            why = arrays.problem(b)
            if why is not None:
                return refused(f"buffer {name!r}: {why}")
            v, host = bytes_of(b)
            if host is not None:  # written back with copy_ on other ranks: fail here, for everyone, if it cannot be
                try:
                    with torch.no_grad():
                        b.copy_(host)  # its own values: nothing changes
                except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
                    return refused(f"buffer {name!r} cannot be written in place: {type(e).__name__}: {e}")
                copies.append((b, host))
            views.append(v)
    except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
        return refused(f"could not read buffer {name!r}: {type(e).__name__}: {e}")

    def written() -> None:
        with torch.no_grad():
            for b, host in copies:
                b.copy_(host)

    return ByteRegions(tuple(entries), tuple(views), written, None)


def refused(why: str) -> ByteRegions:
    return ByteRegions((), (), lambda: None, why)


def bytes_of(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor | None]:
    """Return a host uint8 view of ``t``'s bytes, and the host copy it views when ``t`` cannot be viewed."""
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous():
        return t.reshape(-1).view(torch.uint8).numpy(), None
    host = t.to("cpu", memory_format=torch.contiguous_format, copy=True)
    return host.reshape(-1).view(torch.uint8).numpy(), host
