"""The "mpidp" torch.distributed backend against Gloo: a DDP step of Hugging Face's GPT-2 29.0 M, and all-reduce bandwidth.

Run the driver (it starts every job itself, each variant in its own
``mpiexec`` job, the variants alternating round after round)::

    python benchmarks/torch_distributed.py                       # 2 ranks, 3 rounds, minutes
    python benchmarks/torch_distributed.py --ranks 2 --rounds 5 --steps 20

Variants: ``step`` jobs train ``GPT2LMHeadModel`` (vocabulary 32,000, width
512, 4 layers, 8 heads: 29.0 M parameters; batch 1x32 per rank; randomly
initialized, nothing downloaded) under ``DistributedDataParallel`` with its
default 25 MiB buckets and AdamW, one thread per rank, over "mpidp" and over
"gloo"; the slowest rank's median step counts. ``allreduce`` jobs time
``dist.all_reduce`` of 1-64 MiB float32 over each backend, and
``MPI_Allreduce`` of the same NumPy buffer through mpi4py (``mpi``: the raw
limit). Prints a table of medians over the rounds and the ratios; writes
JSON to ``--out``. Wall-clock numbers: never a CI gate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES_MIB = (1, 4, 16, 64)


def step_job(backend: str, steps: int, warmup: int) -> dict[str, Any]:
    """Train the model for ``warmup + steps`` steps over ``backend``; this rank's step times (collective)."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import mpidp.torch.distributed  # noqa: F401 - registers "mpidp" and the MPI rendezvous

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32000, n_embd=512, n_layer=4, n_head=8, n_positions=32))
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for i in range(warmup + steps):
        tokens = torch.randint(0, 32000, (1, 32), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"median_s": statistics.median(times), "parameters": parameters}


def allreduce_job(backend: str, repeats: int) -> dict[str, Any]:
    """Median seconds of one all-reduce of each size over ``backend`` (``mpi``: mpi4py's Allreduce; collective)."""
    import numpy as np
    from mpi4py import MPI

    out = {}
    if backend == "mpi":
        for mib in (0, *SIZES_MIB):  # 0: one float32, the latency
            buf = np.ones(max(1, mib * 2**18), dtype=np.float32)
            out[str(mib)] = _timed(lambda buf=buf: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), MPI.COMM_WORLD.Barrier, repeats)
        return out
    import torch
    import torch.distributed as dist

    import mpidp.torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    for mib in (0, *SIZES_MIB):
        t = torch.ones(max(1, mib * 2**18))
        out[str(mib)] = _timed(lambda t=t: dist.all_reduce(t), dist.barrier, repeats)
    dist.destroy_process_group()
    return out


def _timed(call: Any, barrier: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def job_main(args: argparse.Namespace) -> None:
    """One job: run the variant, gather the slowest rank's numbers on rank 0 and print them as JSON."""
    from mpi4py import MPI

    if args.job == "step":
        mine: dict[str, Any] = step_job(args.backend, args.steps, args.warmup)
    else:
        mine = allreduce_job(args.backend, args.repeats)
    every = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        worst = {k: (max(m[k] for m in every) if k != "parameters" else v) for k, v in mine.items()}
        print("RESULT " + json.dumps(worst), flush=True)


def run(ranks: int, *argv: str, script: str = __file__) -> dict[str, Any]:
    """Start one job of ``script`` (this file; lightning_step.py passes its own) under ``mpiexec``; its RESULT line.

    The job's environment has none of torchrun's variables: the job sets its own.
    """
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    p = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", script, *argv],
                       check=False, capture_output=True, text=True, env={**env, "PYTHONWARNINGS": "ignore"}, timeout=1800)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"job {argv} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def drive(args: argparse.Namespace) -> None:
    """Alternate the variants' jobs for ``rounds`` rounds; print medians and ratios, write JSON."""
    steps: dict[str, list[float]] = {"mpidp": [], "gloo": []}
    bandwidth: dict[str, dict[str, list[float]]] = {b: {str(m): [] for m in (0, *SIZES_MIB)} for b in ("mpidp", "gloo", "mpi")}
    parameters = 0
    for r in range(args.rounds):
        for backend in ("mpidp", "gloo") if not args.no_step else ():
            got = run(args.ranks, "--job", "step", "--backend", backend, "--steps", str(args.steps), "--warmup", str(args.warmup))
            steps[backend].append(got["median_s"])
            parameters = got["parameters"]
        for backend in ("mpidp", "gloo", "mpi"):
            got = run(args.ranks, "--job", "allreduce", "--backend", backend, "--repeats", str(args.repeats))
            for mib, seconds in got.items():
                bandwidth[backend][mib].append(seconds)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    if not args.no_step:
        med = {b: statistics.median(v) for b, v in steps.items()}
        print(f"\nDDP step, Hugging Face GPT-2 {parameters / 1e6:.1f} M, batch 1x32 per rank, {args.ranks} ranks, medians of {args.rounds} jobs each:")
        print(f"  mpidp {med['mpidp'] * 1e3:8.1f} ms   gloo {med['gloo'] * 1e3:8.1f} ms   mpidp/gloo {med['mpidp'] / med['gloo']:.2f}x")
    latency = {b: statistics.median(bandwidth[b]["0"]) * 1e6 for b in bandwidth}
    print(f"\nall_reduce of one float32: mpidp {latency['mpidp']:.0f} us, gloo {latency['gloo']:.0f} us, mpi {latency['mpi']:.0f} us")
    print("\nall_reduce of float32, GB/s (algorithm bandwidth: bytes / seconds), and against the raw MPI_Allreduce:")
    print(f"  {'MiB':>4} {'mpidp':>8} {'gloo':>8} {'mpi':>8} {'mpidp/mpi':>10} {'mpidp/gloo':>11}")
    table = {}
    for mib in SIZES_MIB:
        s = {b: statistics.median(bandwidth[b][str(mib)]) for b in bandwidth}
        gbs = {b: mib * 2**20 / s[b] / 1e9 for b in s}
        table[mib] = {"seconds": s, "GB/s": gbs}
        print(f"  {mib:>4} {gbs['mpidp']:8.2f} {gbs['gloo']:8.2f} {gbs['mpi']:8.2f} {gbs['mpidp'] / gbs['mpi']:10.2f} {gbs['mpidp'] / gbs['gloo']:11.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"ranks": args.ranks, "rounds": args.rounds, "parameters": parameters,
                                              "step_seconds": steps, "allreduce": table, "latency_us": latency}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="jobs per variant, alternating")
    ap.add_argument("--steps", type=int, default=12, help="timed DDP steps per job")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="timed all-reduces per size per job")
    ap.add_argument("--no-step", action="store_true", help="the all-reduce jobs only")
    ap.add_argument("--out", default="", help="write the medians and every job's numbers here as JSON")
    ap.add_argument("--job", choices=("step", "allreduce"), help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=("mpidp", "gloo", "mpi"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job_main(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
