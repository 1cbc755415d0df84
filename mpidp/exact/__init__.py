"""The exact reduction (``exact=True``): integer sums at agreed scales, their compiled passes, and a session's exact window.

``mpidp.exact`` keeps the names it had as one module (:func:`shard`,
:class:`Accumulator`, ...): they live in :mod:`mpidp.exact.sums`.
Importing this package imports neither numba nor MPI.
"""

from .sums import BITS, LIMIT, Accumulator, Facts, Measured, Stage, decode, encode, kernels, measured, shard

__all__ = ["BITS", "LIMIT", "Accumulator", "Facts", "Measured", "Stage", "decode", "encode", "kernels", "measured", "shard"]
