"""Logistic regression with NumPy, data split unevenly over ranks.

Run: ``mpiexec -n 4 python -m mpi4py -m mpidp.examples.logreg``

Every rank draws its own batch size each window (the last rank often draws
zero samples), computes the gradient of its loss *sum*, and passes the
number of samples as the local weight. mpidp returns the exact global mean
gradient, so the run matches single-process training on the union of the
batches whatever the split.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpidp
from mpidp.examples import parse_args


def batch(rng: np.random.Generator, w_true: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n`` synthetic samples whose labels follow a logistic model."""
    x = rng.standard_normal((n, w_true.size - 1)).astype(np.float32)
    logits = x @ w_true[:-1] + w_true[-1]
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return x, y


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size

    w_true = np.random.default_rng(1234).standard_normal(args.features + 1).astype(np.float32)
    rng = np.random.default_rng(args.seed + 1000 * rank)  # every rank its own data
    # each rank starts from different noise: initialize() broadcasts rank 0's
    params = {"w": rng.standard_normal(args.features).astype(np.float32), "b": np.zeros(1, np.float32)}
    params = mpidp.flat_parameters(params)  # one buffer: initialize broadcasts it in one call
    dp = mpidp.DataParallel.initialize(params, comm)
    grads = dp.gradient_buffers()  # persistent, reduced without packing

    t0 = time.perf_counter()
    samples = 0
    loss = float("nan")
    for step in range(1, args.steps + 1):
        # uneven shards: rank r draws up to 16 * (r + 1) samples (rank 0 at least 8, so that the
        # global batch is never empty); the last rank is empty every third window
        low = 8 if rank == 0 else 0
        n = 0 if (rank == size - 1 and step % 3 == 0 and size > 1) else int(rng.integers(low, 16 * (rank + 1) + 1))
        x, y = batch(rng, w_true, n)
        p = 1 / (1 + np.exp(-(x @ params["w"] + params["b"])))
        eps = 1e-7
        loss_sum = float(-(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)).sum())
        dp.zero_gradients()
        grads["w"][...] = x.T @ (p - y)  # gradient of the loss SUM
        grads["b"][...] = (p - y).sum()
        out = dp.reduce(grads, local_weight=n)
        params["w"] -= args.lr * out.gradients["w"]
        params["b"] -= args.lr * out.gradients["b"]
        total = comm.allreduce(loss_sum)  # the user's own traffic; mpidp uses a private duplicate
        loss = total / out.global_weight
        samples += out.global_weight
        if rank == 0 and (step % 25 == 0 or step == 1):
            print(f"step {step:4d}  global batch {out.global_weight:4d}  loss {loss:.4f}", flush=True)
    dp.verify_replicas()  # every rank holds bitwise the same model
    if rank == 0:
        err = float(np.abs(np.append(params["w"], params["b"]) - w_true).mean())
        elapsed = time.perf_counter() - t0
        print(
            f"done: {args.steps} steps on {size} ranks, {samples} samples, "
            f"{samples / elapsed:.0f} samples/s, final loss {loss:.4f}, mean |w - w_true| {err:.3f}"
        )
    dp.close()
    return loss


if __name__ == "__main__":
    main()
