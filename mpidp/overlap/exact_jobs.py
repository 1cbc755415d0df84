"""The exact reduction in an overlapped window: per bucket, agreed scales, then integer sums (the owner's, one per session).

With ``exact=True`` and ``overlap``, :class:`mpidp.overlap.owner.Overlapped`
queues a :class:`BucketJob` per bucket instead of float32 calls. A job
measures its slots' last gradients in the send buffer (the float32 values
the hooks put there), exchanges one word per slot with every rank (an
Allgather on the buckets' communicator: the same words the window's
record carries, :func:`mpidp.exact.encode`), packs the folds and the last
gradient at the bucket's agreed quanta into int64, and sums them in place
with Allreduce. The communication thread runs it while backward goes on;
the hooks mode runs it after backward (a job is more than one call).

After the window's agreement, :meth:`ExactBuckets.results` converts the
sums into the send views, once, ``sum * 2**quantum / global_weight``, but
only where every bucket was summed and agreed on the same facts as the
window's record: where a bucket met inf, NaN or an overflow, or a gradient
changed after its bucket left (facts or a redo mark differ), the owner
reduces the window again on the plain exact path. Either way the bits are
those of the exact sum of the micro-batches (:mod:`mpidp.exact`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..exact import sums as exact
from .progress import Job

__all__ = ["BucketJob", "ExactBuckets"]


class ExactBuckets:
    """The int64 sums of one session's buckets and the facts each bucket agreed on (local, but for the jobs)."""

    def __init__(self, acc: exact.Accumulator, members: Sequence[Sequence[int]], offset: Sequence[int], chunk: int) -> None:
        self.acc = acc
        self.members = [list(m) for m in members]  # per bucket, its slots in send-buffer order
        self.offset = list(offset)  # per slot, where it lies in the send buffer (and in :attr:`ints`)
        self.chunk = max(1, chunk)  # int64 values per Allreduce
        self.ints = np.zeros(sum(acc.sizes), np.int64)
        self.reset()

    def reset(self) -> None:
        """Start a new window: no bucket summed, no facts."""
        #: per slot, the facts its bucket agreed on (None: its bucket did not exchange)
        self.facts: list[exact.Facts | None] = [None] * len(self.offset)
        #: per bucket, whether its integers were summed (False: inf, NaN or an overflow, or not run)
        self.summed = [False] * len(self.members)

    def job(self, k: int, views: Sequence[np.ndarray]) -> BucketJob:
        """Bucket ``k``'s job, reading the slots' last gradients from ``views`` (the float32 send views)."""
        return BucketJob(self, k, [views[s] for s in self.members[k]])

    def span(self, k: int) -> tuple[int, int]:
        """Bucket ``k``'s values in :attr:`ints`."""
        first, last = self.members[k][0], self.members[k][-1]
        return self.offset[first], self.offset[last] + self.acc.sizes[last]

    def results(self, agreed: Sequence[exact.Facts], global_weight: int, present: Sequence[bool], views: Sequence[np.ndarray]) -> bool:
        """Write ``sum * 2**quantum / global_weight`` of every present slot into ``views``; False (nothing written) where
        a bucket was not summed or agreed on other facts than the window (the same on every rank: agreed facts only)."""
        if not all(self.summed) or any(f is None or f.key() != a.key() for f, a in zip(self.facts, agreed)):
            return False
        acc = self.acc
        for s, here in enumerate(present):
            if here:
                start, o, n = acc.starts[s], self.offset[s], acc.sizes[s]
                acc.unpack(start, start + n, agreed, self.ints[o : o + n], global_weight, views[s].reshape(-1))
        return True


class BucketJob(Job):
    """One bucket of an exact overlapped window: measure, exchange words, pack, sum (blocking calls; resumable)."""

    def __init__(self, owner: ExactBuckets, k: int, views: list[np.ndarray]) -> None:
        self.owner = owner
        self.k = k
        self.views = views
        self.measured: list[exact.Measured] | None = None
        self.rows: np.ndarray | None = None  # every rank's words, once exchanged
        self.calls: list[tuple[int, int]] | None = None  # the Allreduce calls left, once packed
        self.done = 0

    def run(self, comm: Any, operation: str) -> None:
        owner, k = self.owner, self.k
        slots = owner.members[k]
        if self.rows is None:  # the exchange: every rank's words of the bucket's slots (kept at once: made once)
            self.measured = [exact.measured(v) for v in self.views]
            words = np.array([owner.acc.word(s, m) for s, m in zip(slots, self.measured)], np.uint64)
            self.rows = comm.Allgather(words, f"{operation}: the exact bucket's scales")
        if self.calls is None:  # the same decision on every rank: the facts are agreed
            assert self.rows is not None and self.measured is not None
            for j, s in enumerate(slots):
                owner.facts[s] = exact.Facts([int(w) for w in self.rows[:, j]])
            facts = [owner.facts[s] for s in slots]
            lo, hi = owner.span(k)
            if any(f is None or f.special or f.overflow for f in facts):
                self.calls = []
            else:
                for s, f, m in zip(slots, facts, self.measured):
                    o = owner.offset[s]
                    owner.acc.pack_slot(s, f.quantum, m, owner.ints[o : o + owner.acc.sizes[s]])  # type: ignore[union-attr]
                self.calls = [(a, min(a + owner.chunk, hi)) for a in range(lo, hi, owner.chunk)]
        while self.done < len(self.calls):
            a, b = self.calls[self.done]
            comm.Allreduce(owner.ints[a:b], f"{operation}: Allreduce (int64)")
            self.done += 1
        owner.summed[k] = bool(self.calls) or not any(owner.acc.sizes[s] for s in slots)  # an empty bucket has nothing to sum
