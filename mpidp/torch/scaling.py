"""What a sharded step needs of ``torch.amp.GradScaler``, in one room: its scale, its stage, the agreed inf answer.

GradScaler has no public way for an optimizer that reduces its own
gradients to take the scale and report whether it found inf or NaN; torch's
fused and ``_step_supports_amp_scaling`` optimizers use the same private
fields. They are read and written here only, so that a torch release that
changes them breaks one small room, and ``tests/optim/test_sharded_scaler.py``
says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["report", "scale_for"]

UNSCALED = (
    "scaler.unscale_(opt) is not supported with a sharded optimizer: .grad holds each rank's own, "
    "unreduced loss sums, so clipping them would clip every rank differently; drop unscale_ and clip "
    "by the global norm with scaler.step(opt, local_weight=n, max_norm=...)"
)
NOT_PASSED = (
    "this torch's GradScaler did not pass itself to step (grad_scaler=): a sharded optimizer needs it to "
    "tell the scaler the inf/NaN answer every rank agreed on"
)


def scale_for(scaler: torch.amp.GradScaler | None, optimizer: Any) -> tuple[float | None, str | None]:
    """The loss scale a step divides by (None: none), and this rank's error with the scaler (local)."""
    if scaler is None:
        if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):  # set by a GradScaler that no longer passes itself
            return None, NOT_PASSED
        return None, None
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED:
        return None, UNSCALED
    return scaler.get_scale(), None


def report(scaler: torch.amp.GradScaler, optimizer: Any, found_inf: bool) -> None:
    """Tell ``scaler`` the step's agreed answer (the same on every rank), which its ``update()`` reads."""
    scale = scaler._get_scale_async()
    assert scale is not None
    found = torch.full((), float(found_inf), dtype=torch.float32, device=scale.device)
    scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {found.device: found}
