"""A batch system's warning signal as a stop every rank agrees on at a window boundary (one small exchange per ask).

Slurm's ``--signal=USR1@120`` sends SIGUSR1 two minutes before the job's
time limit, to some or all ranks, at any point of a step. The handler only
notes it; :meth:`StopSignal.requested`, called by every rank once per
window, exchanges one word per rank, so that a signal seen by one rank
stops every rank after the same window: then save and exit, and let the
requeued job resume from :func:`mpidp.checkpoint.latest`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any

from . import collective

__all__ = ["StopSignal"]


class StopSignal:
    """Notes ``signals`` (default SIGUSR1) from now on; :meth:`requested` tells every rank alike whether any rank got one.

    Use it as a context manager, or call :meth:`close` to put the previous
    handlers back. ``dp`` is a core session or ``mpidp.torch.DataParallel``.
    """

    #: whether this rank received one of the signals
    received: bool = False

    def __init__(self, dp: Any, signals: Iterable[int] = (signal.SIGUSR1,)) -> None:
        self._session = getattr(dp, "session", dp)
        self.received = False
        self._previous = {s: signal.signal(s, self._note) for s in signals}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def requested(self) -> bool:
        """Whether any rank received a signal so far: the same answer on every rank (collective, once per window)."""
        return collective.stop_requested(self._session, self.received)

    def close(self) -> None:
        """Put back the handlers that were there before (local)."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def __enter__(self) -> StopSignal:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
