"""A LightningModule language model trained by ``lightning.pytorch.Trainer`` with ``MPIDPStrategy``: the same bits at any world size.

Run: ``mpiexec -n N python -m mpi4py -m mpidp.examples.lightning [--steps K] [--exact] [--sharded] [--overlap thread] [--precision P] [--save DIR --stop-after K] [--resume DIR]``

The small transformer and made-up sentences of :mod:`mpidp.examples.charlm`
as a LightningModule. Every epoch is one optimizer step over 12
micro-batches, each a fact of the epoch's number and its own (never of the
rank that draws it); Lightning's distributed sampler shares an epoch's 12
micro-batches among the ranks and the Trainer accumulates ``12 / N`` of them
per rank (N divides 12: 1, 2, 3, 4, 6 or 12 ranks), so every window holds
the same 12 at every world size. ``training_step`` returns the
micro-batch's loss *sum* and its token count, ``{"loss": loss_sum,
"weight": tokens}``: the window's gradient is the exact mean over every
token of the 12 micro-batches. AdamW with weight decay on matrices and
embeddings, a StepLR schedule, the global gradient norm clipped to 1.0
(``gradient_clip_val``).

With ``--exact`` (``MPIDPStrategy(exact=True)``) each micro-batch is folded
into the window's exact sums, and the hash is the same at 1, 2, 3 or 4 ranks
(with ``--precision bf16-mixed`` or ``bf16-true`` too, ``--overlap thread``: the reduction
during the window's last backward, and ``--sharded``: the optimizer state
in slices, one per rank). ``--save DIR --stop-after K`` stops after K steps
and saves ``DIR/step-K`` (``trainer.save_checkpoint``: every rank writes its
slices; Lightning's loops and scheduler go with them); ``--resume DIR`` goes
on from ``DIR``'s newest checkpoint (``trainer.fit(ckpt_path=DIR)``) at this
job's world size, whatever wrote it, to ``--steps`` in all: with ``--exact``
it ends with the hash of the run that never stopped. The last line rank 0
prints is ``sha256 <hex>`` of the final parameters; every rank returns it.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader, TensorDataset

from mpidp.examples import parse_args
from mpidp.examples.charlm import IGNORE, VOCAB, CharLM, Language, batch
from mpidp.lightning import MPIDPStrategy

MICRO_BATCHES = 12


class CharModule(L.LightningModule):
    """CharLM as a LightningModule whose training step returns a loss sum and its token count."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.lang = Language()
        self.model = CharLM(dim=32, layers=2, heads=4, context=args.context)

    def training_step(self, micro: list[torch.Tensor], _: int) -> dict[str, Any]:
        (index,) = micro
        rng = np.random.default_rng([self.args.seed, self.current_epoch, int(index[0])])  # micro-batch i of this epoch
        x, y = batch(rng, self.lang, 1 + int(rng.integers(3)), self.args.context)
        loss_sum = F.cross_entropy(self.model(x).view(-1, VOCAB), y.view(-1), ignore_index=IGNORE, reduction="sum")
        return {"loss": loss_sum, "weight": int((y != IGNORE).sum())}

    def configure_optimizers(self) -> Any:
        params = [p for _, p in self.model.named_parameters()]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.args.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.args.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order (any dtype: bfloat16 with ``--precision bf16-true``)."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer(strategy: MPIDPStrategy, size: int, epochs: int, args: argparse.Namespace) -> L.Trainer:
    """A quiet Trainer: one optimizer step per epoch, over 12 micro-batches shared by ``size`` ranks."""
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, accumulate_grad_batches=MICRO_BATCHES // size,
        gradient_clip_val=1.0, precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (epochs of 12 micro-batches) in all, a resumed run's included")
    parser.add_argument("--exact", action="store_true", help="MPIDPStrategy(exact=True): the same bits at any world size")
    parser.add_argument("--sharded", action="store_true", help="MPIDPStrategy(sharded=True): AdamW's state in slices, one per rank")
    parser.add_argument("--overlap", default="", choices=("", "thread", "hooks"), help="MPIDPStrategy(overlap=...): reduce during backward")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision: 32-true, bf16-mixed, ...")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="folder of checkpoints; with --stop-after")
    parser.add_argument("--stop-after", type=int, help="save into --save after this many steps and stop")
    parser.add_argument("--resume", type=Path, help="folder of checkpoints to go on from (its newest)")
    args = parse_args(parser, argv)
    if (args.save is None) != (args.stop_after is None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            parser.error("--save and --stop-after go together")
        raise SystemExit(0)
    return args


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> str:
    """Train, save or resume as the command line says, on ``comm`` (the world by default); the final parameters' SHA-256 hex."""
    args = arguments(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    if MICRO_BATCHES % comm.size:
        raise SystemExit(f"{MICRO_BATCHES} micro-batches per step cannot be shared by {comm.size} ranks: run 1, 2, 3, 4, 6 or 12")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec|litlogger).*")
    torch.set_num_threads(1)  # one thread: the same kernels on every rank, at every world size
    torch.manual_seed(args.seed)
    module = CharModule(args)
    strategy = MPIDPStrategy(comm, exact=args.exact, sharded=args.sharded, overlap=args.overlap or False)
    epochs = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    run = trainer(strategy, comm.size, epochs, args)
    data = DataLoader(TensorDataset(torch.arange(MICRO_BATCHES)), batch_size=1)  # the distributed sampler gives each rank 12 / N of them
    run.fit(module, data, ckpt_path=args.resume)
    if args.save is not None:
        run.save_checkpoint(args.save / f"step-{epochs:06d}")
    strategy.close()
    out = digest(module)
    if comm.rank == 0:
        how = "exact" if args.exact else "float32"
        print(f"lightning: {run.global_step} steps of {args.steps} on {comm.size} rank(s), {how} reduction, "
              f"{'sharded' if args.sharded else 'replicated'} AdamW, precision {args.precision}")
        print(f"sha256 {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
