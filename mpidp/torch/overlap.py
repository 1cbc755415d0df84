"""The PyTorch adapter's overlapped path: autograd hooks and ``.grad``; the window itself is the owner's.

Used by :class:`mpidp.torch.DataParallel` with ``overlap`` set. A
post-accumulate-grad hook per trainable tie group copies the finished
gradient into its slot of the owner's float32 send buffer
(:class:`mpidp.overlap.owner.Overlapped`; a float32 ``.grad`` then *is* that
slot, so the next backward accumulates there and needs no copy) and marks
it ready: complete buckets start summing at once, in the agreed order, while
backward goes on. ``reduce`` fills what backward did not reach, hands the
owner the gradients to check and those changed since their hook, and writes
``sum / global_weight`` into ``.grad``. The hooks never raise: what goes
wrong in one is this rank's error at the next ``reduce``, agreed by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..overlap.owner import Overlapped, Session

__all__ = ["Overlap"]


class Overlap:
    """The hooks, the send slots as tensors, and what each hook saw (local; the window is the owner's)."""

    def __init__(self, owner: Overlapped, heads: Sequence[str], params: dict[str, Any]) -> None:
        self.owner = owner
        self.names = tuple(heads)
        self.params = [params[h] for h in heads]
        #: per buffer, each slot's view as a tensor shaped like its parameter (a tail slot's is one tensor in both)
        home = [torch.from_numpy(v).view(p.shape) for v, p in zip(owner.views(0), self.params)]
        other = [t if v is w else torch.from_numpy(w).view(p.shape) for t, v, w, p in zip(home, owner.views(0), owner.views(1), self.params)]
        self.tensors = (home, other)
        self.fp32 = [p.dtype == torch.float32 for p in self.params]
        self.paused = 0  # no_sync depth: backward passes that only accumulate
        self.running = False  # a backward pass made a slot ready and has not ended yet
        self.error: str | None = None  # the first thing that went wrong in a hook, for the next reduce
        #: per slot, the ``.grad`` its hook saw and that tensor's version then (None: no hook in this window)
        self.seen: list[tuple[torch.Tensor | None, int] | None] = [None] * len(self.params)
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    @classmethod
    def create(cls, session: Session, params: dict[str, Any], forward: Sequence[str], bucket_bytes: int, progress: str) -> Overlap | None:
        """Make the session's owner of overlapped windows and hook every trainable tie group (collective).

        ``forward`` lists the tie-group heads in registration order: backward
        finishes the last layers first, so the buckets follow it reversed.
        ``progress``: ``"hooks"``, ``"thread"`` or ``"auto"`` (where every
        rank's node has a core to spare besides torch's computing threads,
        the thread, else the hooks; where some rank has none, None: no overlap).
        """
        heads = session.trainable
        slot = {h: i for i, h in enumerate(heads)}
        order = [slot[h] for h in reversed(forward) if h in slot]
        owner = Overlapped.create(session, order, bucket_bytes, progress, torch.get_num_threads())
        return None if owner is None else cls(owner, heads, params)

    @property
    def mode(self) -> str:
        """``"thread"`` or ``"hooks"``: the progress mode the owner chose (local)."""
        return self.owner.mode

    @property
    def send(self) -> list[torch.Tensor]:
        """Each slot's send view, as a tensor (what a float32 ``.grad`` is between windows)."""
        return self.tensors[self.owner.side]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.paused:
                return
            try:
                if not self.running:
                    self.running = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._ended)
                if self.seen[i] is None:  # finished again: the changed .grad is taken at reduce, after the calls
                    self.fill(i)
                    g = p.grad
                    self.seen[i] = (g, -1 if g is None else g._version)
                self.owner.ready(i)
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

    def changed(self) -> dict[int, np.ndarray | None]:
        """Slots whose ``.grad`` changed since their hook, with the float32 values to send (None: already in place)."""
        out: dict[int, np.ndarray | None] = {}
        for i, seen in enumerate(self.seen):
            if seen is None:
                continue
            g = self.params[i].grad
            if g is seen[0] and (g is None or g._version == seen[1]):
                continue
            if g is None:
                out[i] = np.zeros(self.send[i].numel(), np.float32)
            elif g is self.send[i]:
                out[i] = None
            else:
                out[i] = (g if g.layout == torch.strided else g.to_dense()).detach().to(torch.float32).reshape(-1).numpy()
        return out

    def problem(self) -> str | None:
        """What this rank's backward passes did wrong in this window, for the agreement (local)."""
        if self.error is not None:
            return self.error
        if self.running:
            complete, buckets = self.owner.started()
            return (
                f"a backward pass did not finish (did it raise?) after completing {complete} of "
                f"{buckets} reduction buckets; run a complete backward before reduce"
            )
        return None

    def reduce(self, params: Callable[[], dict[str, Any]], heads: Sequence[str], weight: Any, policy: Any, step: Any) -> int:
        """Fill what backward left, let the owner reduce the window, write ``sum / global_weight`` into ``.grad`` (collective)."""
        self.owner.handoff()  # let the communication thread begin the last bucket before this thread's Python work
        error = self.problem()
        try:
            try:
                for i in self.owner.unready():
                    self.fill(i)
                changed = self.changed()
            except Exception as e:  # noqa: BLE001 - agreed below; the rest of the window is sent as it is
                error = error or f"could not copy a gradient into its reduction bucket: {type(e).__name__}: {e}"
                changed = {}
            now = params()  # the checks read .grad (a sparse one as its dense copy); the owner moves it
            given = {h: g if g.layout == torch.strided else g.to_dense() for h in heads if h in now and (g := now[h].grad) is not None}
            outcome = self.owner.reduce(given, weight, policy, step, error, changed)
        finally:
            self.running, self.error = False, None
            self.seen = [None] * len(self.params)
        self._write(outcome.present)
        return outcome.global_weight

    def _write(self, present: Sequence[bool]) -> None:
        """Write the results into ``.grad``: a float32 one becomes its send slot, which holds them."""
        send, old = self.tensors[self.owner.side], self.tensors[1 - self.owner.side]
        for i, (p, here) in enumerate(zip(self.params, present)):
            g, t = p.grad, send[i]
            if not here:
                p.grad = None
            elif g is None or g.layout != torch.strided or (self.fp32[i] and (g is t or g is old[i])):
                p.grad = t if self.fp32[i] else t.to(p.dtype)
            else:
                g.copy_(t)

    def expect_weight(self, weight: Any) -> None:
        """This rank's local weight for the window to come, before its last backward (see DataParallel.expect_weight)."""
        if type(weight) is not int or not 0 <= weight < (1 << 64) - 1:
            self.error = self.error or f"expect_weight takes the local weight as a non-negative int, got {weight!r}"
            return
        self.owner.expect(weight)

    @contextmanager
    def between(self) -> Iterator[None]:
        """Around another mpidp operation: a window this rank began ends with that operation (collective)."""
        self.owner.interrupt()
        try:
            yield
        finally:
            self.owner.resume()
            if not self.owner.began():
                self.running, self.error = False, None
                self.seen = [None] * len(self.params)

    def quiet(self) -> None:
        """Before a fold: let the communication thread finish the buckets it reads (a backward outside ``no_sync``)."""
        self.owner.quiet()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def zero_grad(self) -> None:
        """Zero every send slot and every ``.grad`` that is not one (local)."""
        self.owner.zero()
        for p, t in zip(self.params, self.send):
            if p.grad is not None and p.grad is not t:
                p.grad.zero_()

    def close(self) -> None:
        """Remove the hooks and close the owner (collective)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.owner.close()
