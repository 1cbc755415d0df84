"""A Lightning Trainer step with MPIDPStrategy against DDPStrategy over gloo: Hugging Face's GPT-2 29.0 M, batch 1x32.

Run the driver (it starts every job itself, each variant in its own
``mpiexec`` job, the variants alternating round after round)::

    python benchmarks/lightning_step.py                                  # 2 ranks, 3 rounds, minutes
    python benchmarks/lightning_step.py --ranks 2 --rounds 5 --steps 20 --out benchmarks/results/lightning/step.json

Variants, each ``lightning.pytorch.Trainer(accelerator="cpu")`` training a
LightningModule around nothing but ``GPT2LMHeadModel`` (vocabulary 32,000,
width 512, 4 layers, 8 heads: 29.0 M parameters; randomly initialized,
nothing downloaded) with AdamW, a mean loss, batch 1x32 per rank, one
thread per rank:

* ``mpidp``: ``MPIDPStrategy()`` (the reduction after backward, before the step);
* ``mpidp_sharded``: ``MPIDPStrategy(sharded=True)`` (the AdamW becomes mpidp's sharded one);
* ``mpidp_thread``: ``MPIDPStrategy(overlap="thread")`` (a communication thread sums buckets during backward);
* ``mpidp_hooks``: ``MPIDPStrategy(overlap="hooks")`` (the gradient hooks start and progress non-blocking sums of
  the buckets during backward, no thread);
* ``ddp_gloo``: ``DDPStrategy(process_group_backend="gloo")`` with Lightning's own
  ``MPIEnvironment`` (ranks from MPI; DDP's 25 MiB buckets reduced during backward).

A step is timed by a callback from ``on_train_batch_start`` (after a barrier
of the strategy) to ``on_train_batch_end``: the forward, backward,
reduction, optimizer step and zero_grad, nothing of the data loading;
the Trainer's own overhead inside the step is the same code in both. The
slowest rank's median step of a job counts; the table gives medians over
the rounds and, against ``ddp_gloo``, the median of each round's ratio (the
jobs of a round run back to back, so that a change of load cancels). Writes JSON to ``--out`` with
the load average (``os.getloadavg``) at the start and the end: on a shared
machine, a loaded run says so. Wall-clock numbers: never a CI gate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from torch_distributed import run  # one job under mpiexec, its RESULT line (benchmarks/ is the script's folder)

VARIANTS = ("mpidp", "ddp_gloo", "mpidp_sharded", "mpidp_thread", "mpidp_hooks")
OVERLAP = {"mpidp_thread": "thread", "mpidp_hooks": "hooks"}


def step_job(variant: str, steps: int, warmup: int) -> dict[str, Any]:
    """Fit ``warmup + steps`` steps with ``variant``'s strategy; this rank's median step (collective)."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.environments import MPIEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from mpi4py import MPI
    from transformers import GPT2Config, GPT2LMHeadModel

    from mpidp.lightning import MPIDPStrategy

    torch.set_num_threads(1)
    size = MPI.COMM_WORLD.Get_size()

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = GPT2LMHeadModel(GPT2Config(vocab_size=32000, n_embd=512, n_layer=4, n_head=8, n_positions=32))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.lm(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            trainer.strategy.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    if variant == "ddp_gloo":
        strategy: Any = DDPStrategy(process_group_backend="gloo", cluster_environment=MPIEnvironment())
    else:
        strategy = MPIDPStrategy(sharded=variant == "mpidp_sharded", overlap=OVERLAP.get(variant, False))
    g = torch.Generator().manual_seed(MPI.COMM_WORLD.Get_rank())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 32000, (warmup + steps, 32), generator=g)), batch_size=1)
    clock, model = Clock(), GPT()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=size if variant == "ddp_gloo" else 1, max_steps=warmup + steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[clock])
    trainer.fit(model, data)
    if variant != "ddp_gloo":
        strategy.close()
    return {"median_s": statistics.median(clock.times[warmup:]), "parameters": sum(p.numel() for p in model.parameters())}


def job_main(args: argparse.Namespace) -> None:
    """One job: run the variant, gather the slowest rank's median on rank 0 and print it as JSON."""
    from mpi4py import MPI

    mine = step_job(args.variant, args.steps, args.warmup)
    every = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps({"median_s": max(m["median_s"] for m in every), "parameters": mine["parameters"]}), flush=True)


def drive(args: argparse.Namespace) -> None:
    """Alternate the variants' jobs for ``rounds`` rounds (the order rotates); print medians and ratios, write JSON."""
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    steps: dict[str, list[float]] = {v: [] for v in variants}
    load_start, parameters = os.getloadavg(), 0
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            got = run(args.ranks, "--job", "--variant", v, "--steps", str(args.steps), "--warmup", str(args.warmup), script=__file__)
            steps[v].append(got["median_s"])
            parameters = got["parameters"]
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    load_end = os.getloadavg()
    med = {v: statistics.median(t) for v, t in steps.items()}
    print(f"\nTrainer step, Hugging Face GPT-2 {parameters / 1e6:.1f} M, batch 1x32 per rank, AdamW, {args.ranks} ranks, "
          f"medians of {args.rounds} jobs each (load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end):")
    # the median of each round's ratio: the jobs of a round ran back to back, so a change of load cancels there
    paired = {v: statistics.median(a / b for a, b in zip(steps[v], steps["ddp_gloo"])) for v in variants} if "ddp_gloo" in med else {}
    for v in variants:
        ratio = f"   {paired[v]:.2f}x DDPStrategy over gloo (median of the rounds' ratios)" if paired else ""
        print(f"  {v:<14} {med[v] * 1e3:8.1f} ms{ratio}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "ranks": args.ranks, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "parameters": parameters,
            "median_seconds": med, "step_seconds": steps, "ratio_to_ddp_gloo": paired,
            "loadavg_start": load_start, "loadavg_end": load_end, "cpus": os.cpu_count(),
        }, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="jobs per variant, alternating")
    ap.add_argument("--steps", type=int, default=12, help="timed Trainer steps per job")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--out", default="", help="write the medians, every job's number and the load average here as JSON")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job_main(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
