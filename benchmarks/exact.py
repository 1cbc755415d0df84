"""The exact reduction (``exact=True``): its precision against float64, and its speed against the raw MPI limit.

Precision (one process; ranks simulated, as the arithmetic is all there is)::

    python benchmarks/exact.py precision [--ranks 4] [--micro-batches 12]

computes one float32 gradient per micro-batch of a GPT-2-like model (tied
embedding) and a ResNet-like CNN (benchmarks/train_step.py's), then per
tensor the worst error against the float64 mean of those gradients, scaled
by the tensor's largest reference magnitude, of (a) the default float32
path (each simulated rank accumulates its micro-batches in float32, the
ranks' sums are added in float32, divided once) and (b) the exact
reduction (mpidp.exact, the protocol run by hand). Prints the worst tensor
of each model and how many tensors (b) beats or ties (a) on.

Speed (collective)::

    NUMPY_MADVISE_HUGEPAGE=0 mpiexec -n 2 python -m mpi4py benchmarks/exact.py speed [--values 25000000]

times ``reduce`` on gradient buffers of ``--values`` float32 values in 160
tensors, default path and exact, alternating with the raw chunked float32
Allreduce of the same bytes (4 MiB calls), and prints each median as a
ratio to the raw limit measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def gradients(name: str, count: int) -> tuple[list[str], list[list[np.ndarray]]]:
    """``count`` micro-batches' float32 gradients of one of train_step's models (fixed seeds)."""
    import torch
    import torch.nn.functional as F
    from train_step import GPT, ResNet

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if name == "gpt2":
        model: torch.nn.Module = GPT(vocab=2048, width=128, layers=2, heads=4, context=64)
    else:
        model = ResNet((16, 32, 64, 128), classes=100)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        model.zero_grad(set_to_none=True)
        if name == "gpt2":
            x = torch.randint(2048, (2, 64), generator=g)
            loss = F.cross_entropy(model(x).flatten(0, 1), torch.randint(2048, (128,), generator=g), reduction="sum")
        else:
            loss = F.cross_entropy(model(torch.randn(8, 3, 32, 32, generator=g)), torch.randint(100, (8,), generator=g), reduction="sum")
        loss.backward()
        params = dict(model.named_parameters())
        out.append([params[n].grad.detach().numpy().reshape(-1).copy() for n in names])
    return names, out


def exact_mean(batches: list[list[np.ndarray]], ranks: int, weight: int) -> list[np.ndarray]:
    """The exact reduction's result, the ranks simulated as accumulators (micro-batch i on rank i % ranks)."""
    from mpidp import exact

    sizes = [g.size for g in batches[0]]
    accs = [exact.Accumulator(sizes) for _ in range(ranks)]
    for j, b in enumerate(batches):
        for i, g in enumerate(b):
            accs[j % ranks].fold(i, g)
    facts = [exact.Facts([a.word(i) for a in accs if a.present(i)]) for i in range(len(sizes))]
    total = np.zeros(sum(sizes), np.int64)
    for a in accs:
        a.finish(facts)
        total += a.buffer()
    out, lo = [], 0
    for i, n in enumerate(sizes):
        r = np.empty(n, np.float32)
        exact.result(total[lo : lo + n], facts[i].quantum, weight, r)
        out.append(r)
        lo += n
    return out


def float32_mean(batches: list[list[np.ndarray]], ranks: int, weight: int) -> list[np.ndarray]:
    """The default path: float32 accumulation per rank, a float32 sum over the ranks, one division."""
    out = []
    for i in range(len(batches[0])):
        partial = [np.zeros_like(batches[0][i]) for _ in range(ranks)]
        for j, b in enumerate(batches):
            partial[j % ranks] += b[i]
        total = partial[0].copy()
        for p in partial[1:]:
            total += p
        out.append(total / np.float32(weight))
    return out


def precision(args: argparse.Namespace) -> None:
    weight = 1000
    print(f"worst error per tensor / its largest reference magnitude, {args.micro_batches} micro-batches on {args.ranks} simulated ranks")
    print(f"{'model':8} {'tensors':>7} {'float32 path':>13} {'exact':>10} {'exact <= float32':>17}")
    for name in ("gpt2", "resnet"):
        names, batches = gradients(name, args.micro_batches)
        ref = [sum(b[i].astype(np.float64) for b in batches) / weight for i in range(len(names))]
        errors = []
        for got in (float32_mean(batches, args.ranks, weight), exact_mean(batches, args.ranks, weight)):
            errors.append([float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-300)) for g, r in zip(got, ref)])
        wins = sum(e <= f for f, e in zip(*errors))
        print(f"{name:8} {len(names):7d} {max(errors[0]):13.2e} {max(errors[1]):10.2e} {wins:10d} of {len(names)}")


def speed(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import mpidp

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, 160).astype(np.float64)
    sizes = np.maximum(1, (sizes / sizes.sum() * args.values).astype(int)).tolist()
    total = sum(sizes)
    raw = np.ones(total, np.float32)
    chunk = (4 << 20) // 4
    sessions = {}
    for exact in (False, True):
        p = {f"p{i:03d}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}
        dp = mpidp.DataParallel.initialize(p, comm, exact=exact)
        sessions["exact" if exact else "default"] = (dp, dp.gradient_buffers())
    times: dict[str, list[float]] = {"raw": [], "default": [], "exact": []}
    for _ in range(args.reps):
        for key in ("raw", "default", "exact"):
            if key != "raw":
                dp, g = sessions[key]
                for v in g.values():
                    v.fill(1.0)
            comm.Barrier()
            t = time.perf_counter()
            if key == "raw":
                for lo in range(0, total, chunk):
                    comm.Allreduce(MPI.IN_PLACE, raw[lo : lo + chunk], MPI.SUM)
            else:
                dp.reduce(g, 3)
            times[key].append(time.perf_counter() - t)
    for dp, _ in sessions.values():
        dp.close()
    if comm.rank == 0:
        limit = statistics.median(times["raw"])
        print(f"{comm.size} ranks, {total / 1e6:.1f} M float32 values in {len(sizes)} gradient buffers, {args.reps} reps")
        print(f"raw chunked float32 Allreduce: {limit * 1e3:.1f} ms")
        for key in ("default", "exact"):
            m = statistics.median(times[key])
            print(f"reduce, {key:8}: {m * 1e3:7.1f} ms  {m / limit:5.2f}x the raw limit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("precision")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=12)
    s = sub.add_parser("speed")
    s.add_argument("--values", type=int, default=25_000_000)
    s.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    precision(args) if args.what == "precision" else speed(args)


if __name__ == "__main__":
    main()
