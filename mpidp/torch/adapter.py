"""PyTorch adapter: an ``nn.Module`` as named arrays, gradients reduced in place in ``.grad``.

::

    dp = mpidp.torch.DataParallel(model)          # agree on the model, broadcast it from root
    loss_sum.backward()                           # one or more micro-batches; losses are SUMS over tokens
    global_weight = dp.reduce(local_weight=n_tokens)   # .grad now holds the global token mean
    optimizer.step(); optimizer.zero_grad()

Parameters come from ``named_parameters(remove_duplicate=False)``: a weight
shared by two modules (an embedding tied to the output head) is one tie
group, reduced once; ``requires_grad=False`` at construction means frozen
(broadcast, never reduced).

Buffers (BatchNorm running statistics, its integer ``num_batches_tracked``,
masks, caches: every dtype) are copied from ``root`` byte for byte at
construction, after every rank agreed on their names, shapes and dtypes.
After that they are local to each rank, as under Horovod or DDP with
``broadcast_buffers=False``: BatchNorm statistics then follow each rank's own
data. :meth:`DataParallel.broadcast_buffers` copies root's buffers to every
rank again, explicitly (before evaluating or saving, say); no collective is
hidden in ``forward``.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch

from .. import core
from ..core import MissingGradientPolicy, MPIComm
from ..packing import DEFAULT_CHUNK_BYTES
from . import checkpoint as torch_checkpoint
from . import model as torch_model
from .overlap import Overlap

__all__ = ["DataParallel"]

T = TypeVar("T")


class DataParallel:
    """A rank's data-parallel training session for one ``torch.nn.Module``.

    Collective: every rank of ``comm`` (default ``MPI.COMM_WORLD``) must
    construct it. It checks that every rank holds the same model (parameter
    names, shapes, dtypes, frozen flags and ties; buffer names, shapes and
    dtypes), then broadcasts parameters and buffers from ``root`` in place:
    tensors keep their identity, so an optimizer created before or after the
    DataParallel keeps working. float32, float16 and bfloat16 parameters; every
    gradient is summed in float32.

    ``flat_parameters=True`` first moves the parameters' data into flat
    storage, one buffer per dtype and device (``p.data`` becomes a view; the
    ``Parameter`` objects stay, so optimizers keep working), so that the
    broadcast moves one region per dtype instead of going tensor by tensor.
    Tensors that viewed the old ``p.data`` no longer alias the parameter,
    and saving one parameter alone saves its whole buffer.

    ``overlap`` (CPU parameters) starts the reduction while backward runs
    (:mod:`mpidp.torch.overlap`): gradients go into float32 buckets of
    ``bucket_bytes`` (default ``chunk_bytes``) as autograd finishes them;
    :meth:`reduce` then finishes them, with the plain path's results: bit for
    bit for 16-bit gradients and for float32 ones the plain path sums with an
    Allreduce; where it reduce-scatters float32 (calls of 262,144 values or
    more at 3 or more ranks) the sums can differ in their last bits, still
    the same on every rank. A ``.grad`` changed after backward, or a
    parameter finished twice, costs a second sum, not a different result.
    Run the backward passes of a window but the last under :meth:`no_sync`;
    :attr:`overlap` says which mode runs. ``overlap="hooks"``: the gradient hooks start and
    progress non-blocking calls; ``overlap="thread"``: a communication thread
    sums each bucket with blocking calls while backward goes on (needs
    ``MPI_THREAD_MULTIPLE``); ``overlap=True``: where every rank's node has a
    core free besides its ``torch.get_num_threads()`` computing threads per
    rank, the thread (else the hooks); where some rank's node has none, no
    overlap (:attr:`overlap` is None): every core computes, nothing can run
    beside backward, and the hooks would only slow it. Every rank must pass the same.

    ``exact=True`` makes :meth:`reduce` exact (CPU parameters): call
    :meth:`fold` after each micro-batch's backward (with overlap, each but
    the last, run under :meth:`no_sync`), and the result's bits depend only
    on the set of micro-batches, not on the world size, the reduction path
    or overlap (:mod:`mpidp.exact`, :mod:`mpidp.overlap.exact_jobs`,
    docs/reproducibility.md).

    ``chunk_bytes``, ``abort_on_exception``, ``timeout`` and ``name`` are those of
    :meth:`mpidp.DataParallel.initialize`. Raises ContractError on every rank,
    before anything is modified, if any rank's model is invalid or differs
    from another's (with ``flat_parameters``, the old ``p.data`` is put back).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        comm: MPIComm | None = None,
        root: int = 0,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        abort_on_exception: bool = True,
        timeout: float | None = None,
        flat_parameters: bool = False,
        overlap: bool | str = False,
        bucket_bytes: int | None = None,
        exact: bool = False,
        name: str | None = None,
    ) -> None:
        self._module = model
        error = torch_model.check_module(model)
        regions = torch_model.regions(torch_model.buffers(model) if error is None else [])
        if bucket_bytes is None:
            bucket_bytes = chunk_bytes
        error = error or regions.error or _overlap_problem(model, overlap, bucket_bytes)
        self._params: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False)) if error is None else {}
        frozen = [name for name, p in self._params.items() if not p.requires_grad]
        moved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        if flat_parameters and error is None:
            moved, error = torch_model.flatten(self._params)
        options: dict[str, Any] = {"chunk_bytes": chunk_bytes, "device": None, "abort_on_exception": abort_on_exception, "timeout": timeout}
        options.update(exact=exact, name=name)
        try:  # the buffers are agreed on and moved with the parameters: one record, one communicator
            self._core = core.start(self._params, comm, root, frozen, options, regions._replace(error=error))
        except BaseException:
            for p, old in moved:
                p.data = old
            raise
        first: dict[int, str] = {}
        for key in sorted(self._params):
            first.setdefault(id(self._params[key]), key)
        #: the first name (in contract order) of every tie group, frozen ones included
        self._heads = tuple(first.values())
        self._trainable = frozenset(self._core.trainable)
        self._overlap: Overlap | None = None
        if overlap:  # gradients go into reduction buckets during backward (mpidp.torch.overlap), unless True finds no core
            self._start_overlap(model, first, bucket_bytes, "auto" if overlap is True else str(overlap))
        #: every trainable head's .grad lives in the core's flat storage (or the overlap's buckets): reduced in place
        self._grads: dict[str, Any] = {} if self._overlap is not None else self._core.gradient_buffers()
        self._marks = torch_model.Marks(self._grads)  # whether .grad still holds backward's sums (a sharded step's check)
        self._hooks: list[Any] = [] if self._overlap is not None else [
            self._params[head].register_post_accumulate_grad_hook(torch_model.into_flat(self._grads[head], _marker(self._marks, head)))
            for head in self._core.trainable
        ]

    def _start_overlap(self, model: torch.nn.Module, first: dict[int, str], bucket_bytes: int, progress: str) -> None:
        """Make the overlapped window's owner, buckets in reverse registration order (collective); close on failure."""
        try:
            forward = [name for name, _ in model.named_parameters()]  # registration order, each tie group once
            self._overlap = Overlap.create(self._core, self._params, [first[id(self._params[n])] for n in forward], bucket_bytes, progress)
        except BaseException:
            self._core.close()
            raise

    # --------------------------------------------------------------- accessors

    @property
    def rank(self) -> int:
        """This replica's rank in the communicator."""
        return self._core.rank

    @property
    def world_size(self) -> int:
        """Number of replicas."""
        return self._core.world_size

    @property
    def trainable(self) -> tuple[str, ...]:
        """The name that heads each trainable tie group, in reduce order."""
        return self._core.trainable

    @property
    def module(self) -> torch.nn.Module:
        """The model it was built for, the same object (local): it is not wrapped, so keep calling it directly."""
        return self._module

    @property
    def overlap(self) -> str | None:
        """The overlap mode in use: ``"thread"``, ``"hooks"``, or None without overlap (local; what ``overlap=True`` chose)."""
        return None if self._overlap is None else self._overlap.mode

    # ------------------------------------------------------------------ window

    def reduce(
        self,
        local_weight: int | torch.Tensor,
        policy: MissingGradientPolicy = MissingGradientPolicy.ERROR,
        *,
        step: int | torch.Tensor | None = None,
    ) -> int:
        """Turn every ``.grad`` (of local loss **sums**) into the global token mean, in place.

        Collective: every rank must call it once per accumulation window,
        after the window's backward passes and before ``optimizer.step()``.
        ``local_weight`` is the number of tokens (or samples) behind this
        rank's loss sums: an int, or an integer tensor of one element. Each
        ``.grad`` becomes ``sum over ranks of grad / global_weight``, summed
        in float32, cast back to the parameter's dtype, bitwise equal on
        every rank, and written into the same tensor. A parameter this rank
        has no gradient for but another rank has (policy ZERO, or this
        rank's weight is 0) gets one; a parameter no rank with a non-zero
        weight has a gradient for gets ``.grad = None``, so the optimizer
        skips it as it would on one process. Returns the global weight.

        Raises ContractError identically on every rank, with every ``.grad``
        and parameter untouched, when any rank's input is invalid (a missing
        gradient under policy ERROR, a replaced parameter, a gradient on a
        frozen one, a bad weight), ranks disagree on the policy, or the
        global weight is 0. ``step`` (an int or a one-element integer
        tensor, such as the optimizer's step count) is checked as by
        :meth:`mpidp.DataParallel.reduce`: when any rank passes one, every
        rank's must be equal, which catches a rank that skipped or repeated
        a ``reduce``.
        """
        if self._overlap is not None:  # the overlapped window's owner checks, agrees and moves (mpidp.torch.overlap)
            return self._overlap.reduce(self._refresh, self._heads, _as_int(local_weight), policy, None if step is None else _as_int(step))
        params = self._refresh()
        weight = _as_int(local_weight)
        out = self._core.reduce(self._gradients(params, weight), weight, policy, step=None if step is None else _as_int(step))
        self._marks.reduced = True
        for head in self._core.trainable:
            p = params[head]
            g = out.gradients.get(head)
            if g is None:
                p.grad = None
            elif p.grad is not g:
                p.grad = g
        return out.global_weight

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter of the module by name, tied names included, as the module holds them now (local)."""
        return dict(self._refresh())

    def step_gradients(self, local_weight: int) -> tuple[dict[str, Any], str | None]:
        """The window's ``.grad`` by head name, for an optimizer whose step is the reduction, and this rank's error (local).

        The error (None: none) says that ``.grad`` no longer holds this
        rank's loss sums of the window: :meth:`reduce` already ran in it, or
        something wrote ``.grad`` after backward (``clip_grad_norm_``,
        ``scaler.unscale_``); the step raises it on every rank.
        """
        params = self._refresh()
        return self._gradients(params, local_weight), self._marks.problem(params)

    def _gradients(self, params: dict[str, Any], weight: Any) -> dict[str, Any]:
        """Every head's ``.grad`` for the core, by head name (local)."""
        grads: dict[str, Any] = {}
        for head in self._heads:
            p = params.get(head)
            if p is None:
                continue  # removed from the module: the core refuses the window on every rank
            g = p.grad
            if g is not None:
                # a frozen one is refused by the core; a sparse one (nn.Embedding(sparse=True)) is
                # reduced dense and becomes .grad below, once the window has succeeded
                grads[head] = g if g.layout == torch.strided else g.to_dense()
            elif type(weight) is int and weight == 0 and head in self._trainable:
                # a rank without tokens contributes zeros (its gradients are ignored): lend
                # it the persistent flat storage instead of a new allocation every window
                grads[head] = self._grads[head]
        return grads

    def fold(self) -> None:
        """Add this micro-batch's ``.grad`` to the window's exact sums, then zero them in place (local; ``exact=True``).

        Call it after each micro-batch's backward; :meth:`reduce` adds what
        ``.grad`` holds then as the window's last micro-batch (zeros, if it
        was folded too) and writes the exact global token mean into ``.grad``.
        Micro-batches accumulated in ``.grad`` without a fold in between count
        as one, summed in float32 by autograd: fold each one for the same bits
        at every world size. A gradient that cannot be folded is this rank's
        error at the next :meth:`reduce`, on every rank.
        """
        params = self._refresh()
        if self._overlap is not None:  # a backward outside no_sync started buckets: they read .grad and the folds
            self._overlap.quiet()
        grads = {
            h: g if g.layout == torch.strided else g.to_dense()
            for h in self._core.trainable
            if (p := params.get(h)) is not None and (g := p.grad) is not None
        }
        self._core.fold(grads)
        self.zero_grad()

    def join(self, batches: Iterable[T]) -> Iterator[T | None]:
        """Yield this rank's batches, then None until no rank has one left (collective; uneven shards).

        :meth:`mpidp.DataParallel.join` for a model: every rank iterates
        as often as the longest shard. On a None batch skip the forward and
        backward passes, call ``dp.reduce(local_weight=0)`` (its ``.grad``
        become the global mean) and step the optimizer like every rank::

            for batch in dp.join(loader):
                n = 0
                if batch is not None:
                    x, y = batch
                    loss_fn(model(x), y, reduction="sum").backward()
                    n = y.numel()
                dp.reduce(local_weight=n)
                opt.step(); dp.zero_grad()
        """
        if self._overlap is None:
            return self._core.join(batches)
        return self._join_overlapped(self._core.join(batches))

    def _join_overlapped(self, steps: Iterator[T | None]) -> Iterator[T | None]:
        """:meth:`join`'s steps, each after a window this rank began ends (overlap: no bucket waits for a rank in join)."""
        while True:
            with self._between():
                try:
                    batch = next(steps)
                except StopIteration:
                    return
            yield batch

    def _between(self) -> AbstractContextManager[None]:
        """Around another mpidp operation: an overlapped window this rank began ends with it (collective)."""
        return nullcontext() if self._overlap is None else self._overlap.between()

    # ------------------------------------------------------------- checkpoints

    @property
    def session(self) -> core.DataParallel:
        """The core session under this adapter (for wings that work on sessions, such as :class:`mpidp.checkpoint.StopSignal`)."""
        return self._core

    def save_checkpoint(
        self, folder: str | os.PathLike[str], optimizer: Any = None, *, extras: Mapping[str, Any] | None = None, tag: str | None = None,
        replace: bool = False,
    ) -> Path:
        """Save the model, its buffers (root's), ``optimizer``'s state and ``extras`` into ``folder/tag`` (collective).

        Every rank writes its own share (safetensors files, one per rank)
        and nothing is gathered on one rank; the checkpoint is published
        whole or not at all, then ``folder/latest`` names it. ``optimizer``
        is a ``torch.optim`` optimizer (its ``state_dict()``, under its own
        state names) or a sharded one (each rank its slices). ``extras``:
        JSON values, NumPy arrays or tensors (a data position, RNG states),
        root's. Tag: ``window-<n>`` by default (the run's windows, counted
        on from a loaded checkpoint's); an existing tag is refused unless
        ``replace=True``, and a replacement is crash-safe. Returns the
        checkpoint's path; ContractError on every rank if any rank failed,
        the previous checkpoints then untouched. Call it between windows.
        """
        with self._between():
            return torch_checkpoint.save(self._core, self.module, self._refresh(), folder, optimizer, extras, tag, replace)

    def load_checkpoint(self, where: str | os.PathLike[str], optimizer: Any = None) -> dict[str, Any]:
        """Load a checkpoint written at any world size into the model, its buffers and ``optimizer`` (collective).

        ``where``: a checkpoint, or a folder of them (its ``latest``).
        Every rank resolves ``where`` and the ranks agree on what they
        resolved. Returns the extras (arrays as NumPy arrays). Raises
        ContractError on every rank, with nothing modified, when the
        checkpoint is missing, incomplete, truncated, damaged or mixed
        (checksums, ids), malformed, of another model (a name, shape, dtype,
        tie or buffer differs) or of another optimizer.
        """
        with self._between():
            return torch_checkpoint.load(self._core, self.module, self._refresh(), where, optimizer)

    # ----------------------------------------------------------------- buffers

    def broadcast_buffers(self) -> None:
        """Copy root's buffers into every rank's, byte for byte, in place.

        Collective. Every rank must hold buffers of the same names, shapes
        and dtypes, shared between the same names, each a dense CPU or CUDA
        tensor (checked first; ContractError on every rank otherwise, with
        nothing modified).
        """
        with self._between():
            core.broadcast_regions(self._core, torch_model.regions(torch_model.buffers(self.module)), "broadcast_buffers")

    # --------------------------------------------------------------- utilities

    def _refresh(self) -> dict[str, Any]:
        """Re-read the module's parameters into the mapping the core checks (same dict object)."""
        self._params.clear()
        self._params.update(self.module.named_parameters(remove_duplicate=False))
        return self._params

    def verify_replicas(self) -> None:
        """Check that every rank's parameters are bitwise equal to root's (collective).

        Buffers are not compared: they are local after construction.
        """
        self._refresh()
        with self._between():
            self._core.verify_replicas()

    def expect_weight(self, local_weight: int | torch.Tensor) -> None:
        """Give this window's local weight before its last backward, so that the division need not wait for ``reduce`` (local).

        Optional; only ``overlap="thread"`` (or ``True`` where it picks the
        thread) uses it: where every rank gave its weight for the window and
        none is 0, the communication thread divides each bucket by the global
        weight as soon as it is summed, and ``reduce`` has only the last
        buckets left. ``reduce(local_weight=...)`` still decides, and checks,
        as always: where the global weight it agrees on is not the one given
        here, the sums are taken again after backward (the same result,
        later). Elsewhere it does nothing. A weight that is not a non-negative
        int is this rank's error at the next ``reduce``, on every rank.
        """
        if self._overlap is not None:
            self._overlap.expect_weight(_as_int(local_weight))

    def no_sync(self) -> AbstractContextManager[None]:
        """A context for the backward passes of a window but the last: they only accumulate ``.grad`` (local).

        With ``overlap=True`` the last backward of a window starts the
        reductions as it goes; the ones before it should run under
        ``no_sync()`` (as with DDP's): a second backward outside it makes
        every rank sum the window again after backward (the same result,
        later). On the plain path every backward only accumulates anyway,
        and the context does nothing.
        """
        return nullcontext() if self._overlap is None else self._overlap.no_sync()

    def zero_grad(self) -> None:
        """Zero every trainable ``.grad`` in place, in mpidp's flat storage (local; one fill per dtype).

        ``optimizer.zero_grad()`` works too: its default ``set_to_none=True``
        lets the next backward allocate new gradients, which then cost one
        copy each into the flat storage; ``set_to_none=False`` or this method
        keep them there.
        """
        if self._overlap is not None:
            self._overlap.zero_grad()
            return
        self._core.zero_gradients()
        for head in self._core.trainable:
            p = self._params[head]
            if p.grad is not None and p.grad is not self._grads[head]:
                p.grad.zero_()
        self._marks.mark_all()

    def close(self) -> None:
        """Free the communicator (collective) and stop moving ``.grad`` into flat storage. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._overlap is None:
            self._core.close()
        elif self._overlap.owner.opened() and not self._overlap.owner.owed():  # agree first (a rank in reduce learns it), then finish the buckets
            try:
                # the buckets a backward that raised left unstarted go now, as they are: a rank in reduce may wait for
                # them before its agreement (the thread sums every queued bucket first)
                self._overlap.owner.interrupt()
                self._core.close(then=self._overlap.close)
            finally:
                self._overlap.close()  # idempotent; local where the session was closed already
        else:  # no window here (the owner opens one to close), or ranks opened it to close: finish the buckets, then agree
            try:
                self._overlap.close()
            finally:
                self._core.close()

    def __enter__(self) -> DataParallel:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _overlap_problem(model: torch.nn.Module, overlap: Any, bucket_bytes: Any) -> str | None:
    """Why ``overlap`` cannot serve this rank's model with these buckets, or None (local)."""
    if not isinstance(overlap, bool) and overlap not in ("hooks", "thread"):
        return f"overlap must be False, True, 'hooks' or 'thread', got {overlap!r}"
    if overlap is False:
        return None
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 4:
        return f"bucket_bytes must be an integer of at least 4, got {bucket_bytes!r}"
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type != "cpu":
            return f"overlap={overlap!r} reduces host (CPU) parameters only; parameter {name!r} is on {p.device}"
    return None



def _marker(marks: torch_model.Marks, head: str) -> Any:
    """What the hook of ``head`` calls after each backward: the mark of its storage."""
    return lambda: marks.mark(head)


def _as_int(weight: Any) -> Any:
    """Turn an integer tensor of one element into an int; anything else goes to the core's checks as it is."""
    if isinstance(weight, torch.Tensor) and weight.numel() == 1 and not weight.is_floating_point() and not weight.is_complex() and weight.dtype != torch.bool:
        return int(weight.item())
    if isinstance(weight, numbers.Integral) and not isinstance(weight, bool):
        return int(weight)
    return weight
