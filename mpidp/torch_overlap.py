"""The PyTorch adapter's overlapped path: gradients go into reduction buckets as autograd finishes them.

Used by :class:`mpidp.torch.DataParallel` with ``overlap`` set. A
post-accumulate-grad hook per trainable tie group copies the finished
gradient into its slot of the session's float32 send buffer
(:mod:`mpidp.overlap`; a float32 ``.grad`` then *is* that slot, so the next
backward accumulates there and needs no copy) and marks it ready: complete
buckets start summing at once, in the agreed order, while backward goes on
(progressed by the hooks themselves, or by a communication thread).
``reduce`` then agrees on the window as the plain path does, finishes the
buckets, and writes ``sum / global_weight`` into ``.grad``. The hooks never
raise: what goes wrong in one is this rank's error at the next ``reduce``,
agreed by every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from . import core

__all__ = ["Overlap"]


class Overlap:
    """The hooks, the send slots as tensors, and the window state of one overlapped session (local)."""

    def __init__(
        self, session: core.DataParallel, params: dict[str, Any], forward: Sequence[str], bucket_bytes: int, progress: str = "hooks"
    ) -> None:
        heads = session.trainable
        slot = {h: i for i, h in enumerate(heads)}
        order = [slot[h] for h in reversed(forward) if h in slot]  # backward finishes the last layers first
        # "auto": a communication thread where the node has a core for it besides torch's computing threads
        self.buckets = session.reduction_buckets(order, bucket_bytes, progress, torch.get_num_threads())
        self.names = heads
        self.params = [params[h] for h in heads]
        #: each slot's part of the send buffer, shaped like its parameter (float32); the receive buffer's, likewise
        self.send = [torch.from_numpy(v).view(p.shape) for v, p in zip(self.buckets.views, self.params)]
        # a slot of the tail is summed where it lies: its send and receive tensors are one
        self.recv = [t if fixed else torch.from_numpy(v).view(p.shape) for t, v, p, fixed in zip(self.send, self.buckets.sums, self.params, self.buckets.fixed)]
        self.fp32 = [p.dtype == torch.float32 for p in self.params]
        self.paused = 0  # no_sync depth: backward passes that only accumulate
        self.running = False  # a backward pass made a slot ready and has not ended yet
        self.error: str | None = None  # the first thing that went wrong in a hook, for the next reduce
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if self.paused:
                return
            try:
                if not self.running:
                    self.running = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._ended)
                self.fill(i)
                self.buckets.ready(i)
            except Exception as e:  # noqa: BLE001 - reported to every rank at the next reduce, never raised in backward
                self.error = self.error or f"the gradient hook of {self.names[i]!r} failed: {type(e).__name__}: {e}"

        return hook

    def _ended(self) -> None:
        self.running = False

    def fill(self, i: int) -> None:
        """Put slot ``i``'s gradient into its send slot (upcast; zeros when it has none)."""
        p, t = self.params[i], self.send[i]
        g = p.grad
        if g is t:
            return
        if g is None:
            t.zero_()
            return
        dense = g.layout == torch.strided
        with torch.no_grad():
            t.copy_(g if dense else g.to_dense())
        if dense and self.fp32[i]:
            p.grad = t  # later backward passes accumulate in the send slot: no copy next time

    def problem(self) -> str | None:
        """What this rank's backward passes did wrong in this window, for the agreement (local)."""
        if self.error is not None:
            return self.error
        if self.running:
            return (
                f"a backward pass did not finish (did it raise?) after starting {self.buckets.started} of "
                f"{len(self.buckets)} reduction buckets; run a complete backward before reduce"
            )
        if self.buckets.stale:
            return (
                "a gradient was finished twice in this window while its reduction could be in flight: "
                "with overlap=True, run every backward pass of a window but the last under dp.no_sync()"
            )
        return None

    def reduce(self, session: core.DataParallel, grads: dict[str, Any], weight: Any, policy: Any, step: Any = None) -> int:
        """Agree, finish the buckets, write ``sum / global_weight`` into ``.grad`` (collective)."""
        try:
            agreed = session.reduce_buckets(grads, weight, policy, self.problem(), self.fill, step=step)
        finally:
            self.running, self.error = False, None
        if self.buckets.divided is not None:  # the communication thread divided the sums already
            self._divided(agreed.present(len(self.params)))
            return agreed.global_weight
        w = np.float32(agreed.global_weight)
        for i, (p, here) in enumerate(zip(self.params, agreed.present(len(self.params)))):
            if not here:
                p.grad = None
                continue
            g, t, total = p.grad, self.send[i], self.buckets.sums[i]
            fixed = self.buckets.fixed[i]  # the tail's sums are divided already, in the send slot
            if self.fp32[i]:
                if not fixed:
                    np.divide(total, w, out=self.buckets.views[i])
                if g is None or g is t or g.layout != torch.strided:
                    p.grad = t
                else:
                    g.copy_(t)
                continue
            if not fixed:
                np.divide(total, w, out=total)
            result = torch.from_numpy(total).view(p.shape)
            if g is None or g.layout != torch.strided:
                p.grad = result.to(p.dtype)
            else:
                g.copy_(result)
        return agreed.global_weight

    def _divided(self, present: Sequence[bool]) -> None:
        """Write the divided sums into ``.grad``: a float32 ``.grad`` becomes its receive slot, and the buffers swap roles."""
        for i, (p, here) in enumerate(zip(self.params, present)):
            g, t = p.grad, self.recv[i]
            if not here:
                p.grad = None
            elif g is None or g.layout != torch.strided or (self.fp32[i] and g is self.send[i]):
                p.grad = t if self.fp32[i] else t.to(p.dtype)
            else:
                g.copy_(t)
        self.buckets.swap()  # the next backward accumulates in these .grad: they are its send slots
        self.send, self.recv = self.recv, self.send

    def expect_weight(self, weight: Any) -> None:
        """This rank's local weight for the window to come, before its last backward (see DataParallel.expect_weight)."""
        if type(weight) is not int or weight < 0:
            self.error = self.error or f"expect_weight takes the local weight as a non-negative int, got {weight!r}"
            return
        self.buckets.expect(weight)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def zero_grad(self) -> None:
        """Zero every send slot and every ``.grad`` that is not one (local)."""
        self.buckets.zero()
        for p, t in zip(self.params, self.send):
            if p.grad is not None and p.grad is not t:
                p.grad.zero_()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
