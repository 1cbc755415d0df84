"""Where a sharded optimizer's parameters live: host memory (updated in place), or a device (the update on the host).

A sharded step reads gradients and parameters and writes updated
parameters through one of two places, chosen once from the session's
device. :class:`Host`: host arrays, read and written in place.
:class:`Offload`: device arrays (CuPy, or CUDA tensors through the torch
adapter); as ZeRO-Offload keeps them, the state, the float32 masters and
the update stay on the host: gradients and parameters are copied down
after torch's queued work, each updated piece is staged on the host and
copied up, and every copy up is waited for before the step returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays, cuda

__all__ = ["Host", "Offload", "place"]


class Host:
    """Host arrays: every read is a view, every write in place."""

    def wait(self) -> None:
        """Before the parameters or gradients are read (a device's queued work; nothing on the host)."""

    def down(self, x: Any) -> np.ndarray:
        """A host view (or copy) of the flat array ``x``."""
        return x

    def updated(self, slot: int, start: int, values: np.ndarray, flat: Any, dtype: np.dtype, master: bool) -> None:
        """This rank's piece ``flat`` (from element ``start`` of slot ``slot``) was updated in ``values`` (float32 or in place)."""
        if master:
            flat[...] = values  # rounded to the parameter's dtype (to nearest even)

    def fill(self, slot: int, flat: Any, a: int, b: int) -> np.ndarray | None:
        """Bytes ``[a, b)`` of slot ``slot``'s parameter as this rank holds them for the gather (None: not updated here)."""
        return flat.view(np.uint8)[a:b]

    def write(self, place: Any, got: np.ndarray) -> None:
        """Gathered bytes ``got`` into a parameter's bytes ``place``."""
        place[...] = got

    def done(self, flats: list[Any]) -> None:
        """After the gather: every write has landed."""


class Offload(Host):
    """Device arrays: copies down to the host, the update there, each updated piece staged and copied up."""

    def __init__(self) -> None:
        self._staged: dict[int, tuple[int, np.ndarray]] = {}  # per slot: this rank's updated piece (start, host values)

    def wait(self) -> None:
        """torch's queued writes to the parameters and gradients are done before they are copied down."""
        cuda.wait_for_torch()

    def down(self, x: Any) -> np.ndarray:
        """A host copy of the device array ``x``."""
        return arrays.to_host(x)

    def updated(self, slot: int, start: int, values: np.ndarray, flat: Any, dtype: np.dtype, master: bool) -> None:
        """Stage the piece in the parameter's dtype (16-bit: rounded to nearest even) and copy it up."""
        self._staged[slot] = (start, values.astype(dtype, copy=False))
        arrays.write_device(flat, self._staged[slot][1])

    def fill(self, slot: int, flat: Any, a: int, b: int) -> np.ndarray | None:
        """The staged piece's bytes (a slot not updated here: nobody reads them)."""
        start, values = self._staged.get(slot, (0, None))
        if values is None:
            return None
        at = start * values.itemsize
        return values.view(np.uint8)[a - at : b - at]

    def write(self, place: Any, got: np.ndarray) -> None:
        """Copy gathered bytes up."""
        arrays.write_device(place, got)

    def done(self, flats: list[Any]) -> None:
        """Every copy up is done before the caller's next kernels read the parameters."""
        if flats:
            arrays.synchronize(flats[0])
        self._staged.clear()


def place(device: str) -> Host:
    """The place of a session on ``device`` (``"cpu"``: host arrays)."""
    return Host() if device == "cpu" else Offload()
