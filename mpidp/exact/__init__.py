"""The exact reduction (``exact=True``): integer sums at agreed scales, their compiled passes, and a session's exact window.

``mpidp.exact`` keeps the names it had as one module (:func:`shard`,
:class:`Accumulator`, ...): they live in :mod:`mpidp.exact.sums`.
Importing this package imports neither numba nor MPI.
"""

from .sums import (
    BITS,
    FLOAT_BITS,
    LIMIT,
    MODES,
    Accumulator,
    Facts,
    Measured,
    SlowPassesWarning,
    Stage,
    decode,
    encode,
    kernels,
    measured,
    route,
    shard,
    slow_passes_once,
)

__all__ = ["BITS", "FLOAT_BITS", "LIMIT", "MODES", "Accumulator", "Facts", "Measured", "SlowPassesWarning", "Stage", "decode", "encode", "kernels", "measured", "route", "shard", "slow_passes_once"]
