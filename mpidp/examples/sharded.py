"""A sharded AdamW: each rank keeps 1/N of the optimizer state, and with ``--exact`` the same bits at any world size.

Run: ``mpiexec -n N python -m mpi4py -m mpidp.examples.sharded [--steps K] [--exact] [--save DIR --stop-after K] [--resume DIR]``

The small transformer and made-up sentences of :mod:`mpidp.examples.charlm`,
trained with :class:`mpidp.torch.ShardedAdamW` (weight decay on matrices
and embeddings, none on biases and norms; the global gradient norm clipped
to 1.0). Every window trains on a fixed list of 10 micro-batches, each a fact
of the window's number and its own, never of the rank that draws it;
micro-batch ``i`` goes to rank ``i % N`` (:func:`mpidp.shard`). Each
micro-batch's loss *sum* is back-propagated, and ``opt.step(local_weight=n,
max_norm=1.0)`` replaces ``dp.reduce``: the gradients are reduce-scattered
to the ranks that own their slice of the optimizer state, each owner updates
its slice, and the parameters are gathered.

With ``--exact`` every micro-batch's gradient is folded into the window's
exact integer sums (``dp.fold()``) as in :mod:`mpidp.examples.reproducible`,
so the reduction, the clipping norm and every update have the same bits at
1, 2, 3, 4 or 5 ranks, and so has the final hash. Without it the float32
path runs, whose last bits change with N.

``--save DIR --stop-after K`` saves a checkpoint into ``DIR`` after window
``K`` (:meth:`mpidp.torch.DataParallel.save_checkpoint`: every rank writes
its own slices; the extras hold the next window) and exits; ``--resume DIR``
loads ``DIR``'s newest checkpoint at this job's world size, whatever wrote
it, and continues to ``--steps`` windows in all: with ``--exact`` it ends
with the hash of the run that never stopped.

The last two lines rank 0 prints are ``optimizer bytes per rank <n>``
(rank 0's ``opt.sharded.nbytes``: AdamW's two float32 moments of the
elements rank 0 owns; the cut gives ranks ``T // N`` or ``T // N + 1`` of the
``T`` elements, so ranks differ by at most a few bytes) and ``sha256 <hex>``
of the final parameters. PyTorch runs on one thread per rank: the same
kernels, the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp.torch
from mpidp.examples import parse_args
from mpidp.examples.charlm import IGNORE, VOCAB, CharLM, Language, batch

MICRO_BATCHES = 10


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings; none on biases and norms (1-D tensors)."""
    params = [p for _, p in model.named_parameters()]  # a tied parameter once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def micro_batch(lang: Language, seed: int, window: int, i: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``i`` of window ``window``: a fact of the two numbers alone, not of the rank that draws it."""
    rng = np.random.default_rng([seed, window, i])
    return batch(rng, lang, 1 + int(rng.integers(3)), context)


def window(dp: mpidp.torch.DataParallel, model: CharLM, lang: Language, w: int, args: argparse.Namespace) -> tuple[float, int]:
    """Back-propagate this rank's micro-batches of window ``w`` (folded with --exact); its loss sum and tokens."""
    loss, tokens = 0.0, 0
    mine = list(mpidp.shard(MICRO_BATCHES, dp.rank, dp.world_size))  # micro-batch i on rank i % N
    for j, i in enumerate(mine):
        x, y = micro_batch(lang, args.seed, w, i, args.context)
        loss_sum = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1), ignore_index=IGNORE, reduction="sum")
        loss_sum.backward()
        if args.exact and j < len(mine) - 1:
            dp.fold()  # into the window's exact sums; step adds the last .grad as the window's last micro-batch
        loss += float(loss_sum.detach())
        tokens += int((y != IGNORE).sum())
    return loss, tokens


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> str:
    """Train, save or resume as the command line says, on ``comm`` (the world by default); the final parameters' SHA-256 hex."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="windows (optimizer steps) in all, a resumed run's included")
    parser.add_argument("--exact", action="store_true", help="the exact reduction: the same bits at any world size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="folder of checkpoints; with --stop-after")
    parser.add_argument("--stop-after", type=int, help="save into --save after this window and stop")
    parser.add_argument("--resume", type=Path, help="folder of checkpoints to continue from (its newest)")
    args = parse_args(parser, argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    if (args.save is None) != (args.stop_after is None):  # every rank parsed the same line: every rank stops here
        if comm.rank == 0:
            parser.error("--save and --stop-after go together")
        raise SystemExit(0)
    torch.set_num_threads(1)  # one thread: the same kernels on every rank, at every world size
    torch.manual_seed(args.seed)
    lang = Language()
    model = CharLM(dim=32, layers=2, heads=4, context=args.context)
    dp = mpidp.torch.DataParallel(model, comm, exact=args.exact)
    opt = mpidp.torch.ShardedAdamW(dp, param_groups(model, args.weight_decay), lr=args.lr)
    start = 0
    if args.resume is not None:  # written at any world size: each rank reads the slices it owns now
        start = int(dp.load_checkpoint(args.resume, opt)["next"])
    end = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    loss = norm = float("nan")
    for w in range(start, end):
        loss_sum, tokens = window(dp, model, lang, w, args)
        opt.step(local_weight=tokens, max_norm=1.0)  # replaces dp.reduce: reduce-scatter, clip, update, gather
        dp.zero_grad()
        assert opt.last is not None
        loss = comm.allreduce(loss_sum) / opt.last.global_weight  # user traffic (mpidp keeps its own communicator), for show
        norm = float("nan") if opt.last.norm is None else opt.last.norm  # the global gradient norm, before clipping
    dp.verify_replicas()
    saved = None
    if args.save is not None:
        saved = dp.save_checkpoint(args.save, opt, extras={"next": end}, tag=f"window-{end:08d}")
    nbytes = opt.sharded.nbytes
    dp.close()
    out = digest(model)
    if comm.rank == 0:
        how = "exact" if args.exact else "float32"
        print(
            f"sharded: windows {start}..{end} of {args.steps} ({MICRO_BATCHES} micro-batches each) on {comm.size} rank(s), "
            f"{how} reduction; last window: loss {loss:.3f}, gradient norm {norm:.3f} (clipped at 1.0)"
        )
        if saved is not None:
            print(f"saved {saved} (next window {end}, {comm.size} ranks)")
        print(f"optimizer bytes per rank {nbytes}")
        print(f"sha256 {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
