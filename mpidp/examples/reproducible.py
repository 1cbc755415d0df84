"""The same parameter bits at any world size: a small transformer trained with the exact reduction.

Run: ``mpiexec -n N python -m mpi4py -m mpidp.examples.reproducible [--steps K] [--save DIR] [--resume DIR] [--overlap MODE]``

Every step trains on a fixed list of 12 micro-batches (made up from the
step's number and the micro-batch's, nothing to download); micro-batch
``i`` goes to rank ``i % N`` (:func:`mpidp.exact.shard`). Each rank folds
each micro-batch's gradient into the window's exact integer sums
(``dp.fold()``), and ``dp.reduce`` sums them over the ranks without an
order (``exact=True``). The last line is ``sha256 <hex>`` of the final
parameters: the same for every N, and after a resume from ``--save`` at
any other N (:meth:`mpidp.torch.DataParallel.save_checkpoint`: every rank
writes its share of the model and of AdamW's state, the extras hold the
step; ``load_checkpoint`` at any world size reads what each rank needs).
PyTorch runs on one thread per rank: the same kernels, the
same bits (docs/reproducibility.md). ``--overlap thread`` (or ``hooks``)
sums the buckets as integers during each window's last backward, the
others run under ``no_sync``: the same hash again.
"""

from __future__ import annotations

import argparse
import hashlib
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp.torch
from mpidp.exact import shard
from mpidp.examples import parse_args
from mpidp.examples.charlm import IGNORE, VOCAB, CharLM, Language, batch

MICRO_BATCHES = 12


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def micro_batch(lang: Language, seed: int, step: int, i: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``i`` of step ``step``: a fact of the two numbers alone, not of the rank that draws it."""
    rng = np.random.default_rng([seed, step, i])
    return batch(rng, lang, 1 + int(rng.integers(3)), context)


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> str:
    """Train, save or resume as the command line says, on ``comm`` (the world by default); the final parameters' SHA-256 hex."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps in all (a resumed run included)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="folder of checkpoints: one written at the end (mpidp.checkpoint)")
    parser.add_argument("--resume", type=Path, help="folder of checkpoints to continue from (its newest)")
    parser.add_argument("--plain", action="store_true", help="the float32 reduction instead (its bits change with N)")
    parser.add_argument("--overlap", choices=("hooks", "thread"), help="sum the buckets during each window's last backward")
    args = parse_args(parser, argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    torch.set_num_threads(1)  # one thread: the same kernels on every rank, at every world size
    torch.manual_seed(args.seed)
    lang = Language()
    model = CharLM(dim=32, layers=2, heads=4, context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dp = mpidp.torch.DataParallel(model, comm, exact=not args.plain, overlap=args.overlap or False)
    start = 0
    if args.resume is not None:  # written at any world size: every rank reads what it needs
        start = int(dp.load_checkpoint(args.resume, optimizer)["step"])
    for step in range(start, args.steps):
        tokens = 0
        mine = list(shard(MICRO_BATCHES, dp.rank, dp.world_size))  # micro-batch i on rank i % N
        for j, i in enumerate(mine):
            last = args.overlap is not None and j == len(mine) - 1  # with overlap, its hooks fill the buckets
            x, y = micro_batch(lang, args.seed, step, i, args.context)
            loss_sum = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1), ignore_index=IGNORE, reduction="sum")
            with nullcontext() if last or args.overlap is None else dp.no_sync():
                loss_sum.backward()
            if not args.plain and not last:
                dp.fold()  # this micro-batch's gradient, into the window's exact sums; .grad back to zero
            tokens += int((y != IGNORE).sum())
        dp.reduce(local_weight=tokens, step=step)  # .grad: the exact global token mean, the same bits at any N
        optimizer.step()
        dp.zero_grad()
    dp.verify_replicas()
    if args.save is not None:  # collective: published when every rank has written its share
        dp.save_checkpoint(args.save, optimizer, extras={"step": args.steps}, tag=f"step-{args.steps:08d}")
    dp.close()
    out = digest(model)
    if comm.rank == 0:
        how = ("float32 (plain)" if args.plain else "exact") + (f", overlap={args.overlap}" if args.overlap else "")
        print(f"reproducible: {args.steps} steps of {MICRO_BATCHES} micro-batches on {comm.size} rank(s), {how} reduction")
        print(f"sha256 {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
