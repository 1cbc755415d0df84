"""The sharded AdamW against the replicated one, and mpidp.checkpoint against torch.save, on a 30.0 M GPT-2.

Run it from the checkout's root, without mpiexec: it starts every job itself::

    python benchmarks/sharded.py --what memory,step,checkpoint --out benchmarks/results/sharded
    python benchmarks/sharded.py --what step --pairs 3 --steps 8     # only the training step
    python benchmarks/sharded.py --quick --out /tmp/sharded          # a smoke run, tiny model, seconds

The model is ``gpt2-29m`` of ``benchmarks/train_step.py`` (GPT-2's shape from
``torch.nn``: vocabulary 50,257, width 384, 6 layers, the head tied to the
embedding; 29,958,528 parameters, batch 1x32), one thread per rank. Every
variant runs in its own ``mpiexec`` job (so that its peak RSS is its own),
with ``NUMPY_MADVISE_HUGEPAGE=0``; jobs that are compared alternate.

* ``memory``: the optimizer's bytes per rank after one step, at 1, 2 and 4
  ranks: ``ShardedAdamW``'s ``opt.sharded.nbytes`` (its two moments and,
  for bfloat16 parameters, float32 masters of the slice it owns) against
  the replicated AdamW of the README's loop (``dp.reduce``, then
  ``torch.optim.AdamW.step``: its ``exp_avg`` and ``exp_avg_sq`` bytes; for
  bfloat16 parameters, the float32 masters a mixed-precision loop keeps and
  their moments); the bound the issue sets is replicated / N + one bucket
  (``chunk_bytes``, 4 MiB). Peak RSS per rank (``ru_maxrss``).
* ``step``: the training step at 2 ranks, sharded (``loss_sum.backward();
  opt.step(local_weight=n); dp.zero_grad()``) against replicated
  (``loss_sum.backward(); dp.reduce(local_weight=n); opt.step();
  dp.zero_grad()``), float32, no clipping in either; each job times
  ``--steps`` steps after 2 of warm-up, each step the slowest rank's from a
  barrier, also in two parts (forward+backward; the rest). The jobs
  alternate, pair by pair (the first of a pair changes each pair); the
  ratio is the median of the pairs' ratios of median steps.
* ``checkpoint``: the parameters and AdamW's state (360 MB in float32)
  saved and loaded with ``dp.save_checkpoint`` / ``dp.load_checkpoint`` at
  1, 2 and 4 ranks (``ShardedAdamW``: each rank writes and reads its own
  slices) against ``torch.save`` / ``torch.load`` of the model's and a
  ``torch.optim.AdamW``'s ``state_dict()`` on one rank (also with an
  ``fsync`` after the save, as mpidp fsyncs every file), into a temporary
  folder on the local disk; loads read what the save just wrote, from the
  page cache. Medians of ``--repeats``.

Writes ``<out>/memory.json``, ``step.json``, ``checkpoint.json`` (every
job's raw result with the load average at its start and end, the numba
install, versions) and prints a table of each. Nothing gates on time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
quick = [False]  # the driver's --quick, passed on to its jobs
MODEL = "gpt2-29m"
QUICK_MODEL = "gpt2-tiny"


# ------------------------------------------------------------------ the jobs (under mpiexec)


def build(name: str, dtype: str) -> tuple[Any, Callable[[int, Any], tuple[Any, Any]]]:
    """``train_step.py``'s model ``name`` in ``dtype`` (seed 0) and its batch maker."""
    import torch

    sys.path.insert(0, str(HERE))
    from train_step import MODELS

    torch.manual_seed(0)
    make, data = MODELS[name]
    return make().to(getattr(torch, dtype)), data


def forward_backward(model: Any, data: Callable[[int, Any], tuple[Any, Any]], rank: int, step: int) -> int:
    """One micro-batch's loss *sum*, back-propagated; its token count."""
    import torch
    import torch.nn.functional as F

    idx, target = data(rank, torch.Generator().manual_seed(1000 * step + rank))
    logits = model(idx)
    F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), ignore_index=-100, reduction="sum").backward()
    return int((target != -100).sum())


class Replicated:
    """The README's loop: ``dp.reduce``, then torch's AdamW; float32 masters (and their moments) for 16-bit parameters."""

    def __init__(self, dp: Any, model: Any) -> None:
        import torch

        self.dp, self.params = dp, [p for p in model.parameters()]
        self.sixteen = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().requires_grad_() for p in self.params] if self.sixteen else self.params
        self.opt = torch.optim.AdamW(self.masters, lr=3e-4, weight_decay=0.01)

    def step(self, tokens: int) -> None:
        import torch

        self.dp.reduce(local_weight=tokens)
        if self.sixteen:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
        self.opt.step()
        if self.sixteen:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)

    @property
    def nbytes(self) -> int:
        state = sum(v.nbytes for s in self.opt.state.values() for v in s.values() if v.dim() > 0)
        return state + (sum(m.nbytes for m in self.masters) if self.sixteen else 0)


class Sharded:
    """``ShardedAdamW``: ``opt.step(local_weight=n)`` replaces ``dp.reduce``."""

    def __init__(self, dp: Any, model: Any) -> None:
        import mpidp.torch

        self.opt = mpidp.torch.ShardedAdamW(dp, lr=3e-4, weight_decay=0.01)

    def step(self, tokens: int) -> None:
        self.opt.step(local_weight=tokens)

    @property
    def nbytes(self) -> int:
        return int(self.opt.sharded.nbytes)


def peak_rss() -> int:
    """This process's peak resident set, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this MPI job; the result, the same on every rank."""
    import torch
    from mpi4py import MPI

    import mpidp.torch

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    start = os.getloadavg()
    model, data = build(args.model, args.dtype)
    dp = mpidp.torch.DataParallel(model, comm)
    out: dict[str, Any] = {"variant": args.variant, "kind": args.job, "ranks": comm.size, "dtype": args.dtype, "model": args.model,
                           "parameters": sum(p.numel() for p in model.parameters()), "load_average_start": start}
    if args.job == "checkpoint":
        out.update(checkpoint_job(args, dp, model, data, comm))
    else:
        opt = Sharded(dp, model) if args.variant == "sharded" else Replicated(dp, model)
        times = []
        for s in range(args.warmup + args.steps):
            comm.Barrier()
            t0 = time.perf_counter()
            tokens = forward_backward(model, data, comm.rank, s)
            t1 = time.perf_counter()
            opt.step(tokens)
            dp.zero_grad()
            t2 = time.perf_counter()
            if s >= args.warmup:
                times.append([comm.allreduce(x, op=MPI.MAX) for x in (t2 - t0, t1 - t0, t2 - t1)])  # the slowest rank's
        out["optimizer_bytes_per_rank"] = comm.allgather(opt.nbytes)
        out["chunk_bytes"] = dp.session.facts().chunk_bytes
        if times:
            out["step_s"] = statistics.median(t[0] for t in times)
            out["forward_backward_s"] = statistics.median(t[1] for t in times)
            out["reduce_and_update_s"] = statistics.median(t[2] for t in times)
            out["steps_s"] = [t[0] for t in times]
    out["peak_rss_per_rank"] = comm.allgather(peak_rss())
    dp.close()
    out["load_average_end"] = os.getloadavg()
    return out


def checkpoint_job(args: argparse.Namespace, dp: Any, model: Any, data: Any, comm: Any) -> dict[str, Any]:
    """Save and load the model and AdamW's state ``args.repeats`` times; median seconds (the slowest rank's)."""
    import torch
    from mpi4py import MPI

    sharded = args.variant == "mpidp"
    opt: Any = Sharded(dp, model) if sharded else Replicated(dp, model)
    opt.step(forward_backward(model, data, comm.rank, 0))  # the moments exist
    dp.zero_grad()
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="mpidp-bench-ckpt-", dir=args.tmp) if comm.rank == 0 else None))
    saves, loads, saves_fsync, nbytes = [], [], [], 0
    try:
        for r in range(args.repeats):
            folder = root / f"r{r}"
            comm.Barrier()
            t0 = time.perf_counter()
            if sharded:
                path = dp.save_checkpoint(folder, opt.opt, extras={"step": 1})
            else:
                folder.mkdir()
                path = folder / "state.pt"
                torch.save({"model": model.state_dict(), "optimizer": opt.opt.state_dict()}, path)
                saves.append(time.perf_counter() - t0)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            t1 = time.perf_counter()
            (saves_fsync if not sharded else saves).append(comm.allreduce(t1 - t0, op=MPI.MAX))
            nbytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if comm.rank == 0 else 0
            comm.Barrier()
            t0 = time.perf_counter()
            if sharded:
                dp.load_checkpoint(folder, opt.opt)
            else:
                state = torch.load(path, weights_only=True)
                model.load_state_dict(state["model"])
                opt.opt.load_state_dict(state["optimizer"])
            loads.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            comm.Barrier()
            if comm.rank == 0:
                shutil.rmtree(folder)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    out = {"repeats": args.repeats, "checkpoint_bytes": comm.bcast(nbytes), "save_s": statistics.median(saves), "load_s": statistics.median(loads),
           "saves_s": saves, "loads_s": loads}
    if saves_fsync:
        out.update(save_fsync_s=statistics.median(saves_fsync), saves_fsync_s=saves_fsync)
    return out


# ------------------------------------------------------------------ the driver (no MPI)


def meta() -> dict[str, Any]:
    import platform

    return {
        "machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
        "numba": importlib.util.find_spec("numba") is not None, "NUMPY_MADVISE_HUGEPAGE": "0",
        "torch": _version("torch"), "numpy": _version("numpy"), "mpi4py": _version("mpi4py"), "mpidp": _version("mpidp"),
    }


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - a missing package is recorded as None
        return None


def launch(ranks: int, job_args: list[str], timeout: int) -> dict[str, Any]:
    """Run one job under ``mpiexec -n ranks``; its result (rank 0's last line, ``RESULT {json}``)."""
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPIR_CVAR_"))}
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "--job", *job_args]
    if quick[0]:
        command.append("--quick")
    p = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"job failed ({p.returncode}): {' '.join(command)}\n{p.stdout[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    result["command"] = f"NUMPY_MADVISE_HUGEPAGE=0 mpiexec -n {ranks} python -m mpi4py benchmarks/sharded.py --job {' '.join(job_args)}"
    print(f"  {result['command']}: load {result['load_average_start'][0]:.2f}", flush=True)
    return result


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    jobs = []
    for dtype in ("float32", "bfloat16"):
        for variant in ("replicated", "sharded"):
            for ranks in (1, 2, 4) if not args.quick else (1, 2):
                jobs.append(launch(ranks, ["memory", "--variant", variant, "--dtype", dtype, "--model", args.model, "--steps", "1", "--warmup", "0"], args.timeout))
    return {"meta": meta(), "jobs": jobs}


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    jobs, ratios = [], []
    for pair in range(args.pairs):
        order = ("sharded", "replicated") if pair % 2 == 0 else ("replicated", "sharded")
        got = {v: launch(2, ["step", "--variant", v, "--model", args.model, "--steps", str(args.steps)], args.timeout) for v in order}
        jobs += list(got.values())
        ratios.append(got["sharded"]["step_s"] / got["replicated"]["step_s"])
    return {"meta": meta(), "jobs": jobs, "ratios": ratios, "ratio": statistics.median(ratios)}


def run_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    jobs = []
    for round_ in range(args.rounds):
        order: list[tuple[str, int]] = [("torch", 1), ("mpidp", 1), ("mpidp", 2), ("mpidp", 4)]
        for variant, ranks in order if round_ % 2 == 0 else order[::-1]:
            jobs.append(launch(ranks, ["checkpoint", "--variant", variant, "--model", args.model, "--repeats", str(args.repeats)], args.timeout))
    return {"meta": meta(), "jobs": jobs}


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def tables(name: str, result: dict[str, Any]) -> str:
    jobs = result["jobs"]
    if name == "memory":
        rows = ["| dtype | optimizer | ranks | optimizer bytes per rank (MiB, max) | replicated / N + 4 MiB | peak RSS per rank (MiB, max) | load |", "|---|---|---|---|---|---|---|"]
        for j in jobs:
            rep = next(k for k in jobs if k["dtype"] == j["dtype"] and k["variant"] == "replicated" and k["ranks"] == 1)
            bound = max(rep["optimizer_bytes_per_rank"]) / j["ranks"] + j["chunk_bytes"]
            rows.append(f"| {j['dtype']} | {j['variant']} | {j['ranks']} | {mib(max(j['optimizer_bytes_per_rank']))} | "
                        f"{mib(bound) if j['variant'] == 'sharded' else ''} | {mib(max(j['peak_rss_per_rank']))} | {j['load_average_start'][0]:.2f} |")
        return "\n".join(rows)
    if name == "step":
        rows = ["| job | optimizer | step (ms) | forward+backward | reduce + update | peak RSS per rank (MiB) | load |", "|---|---|---|---|---|---|---|"]
        for k, j in enumerate(jobs):
            rows.append(f"| {k} | {j['variant']} | {1e3 * j['step_s']:.0f} | {1e3 * j['forward_backward_s']:.0f} | {1e3 * j['reduce_and_update_s']:.0f} | "
                        f"{mib(max(j['peak_rss_per_rank']))} | {j['load_average_start'][0]:.2f} |")
        rows.append(f"\nsharded / replicated step: median {result['ratio']:.3f} of pairs {', '.join(f'{r:.3f}' for r in result['ratios'])}")
        return "\n".join(rows)
    rows = ["| how | ranks | save (s) | save + fsync (s) | load (s) | bytes (MB) | load |", "|---|---|---|---|---|---|---|"]
    for j in jobs:
        fsync = j.get("save_fsync_s", j["save_s"])
        rows.append(f"| {'mpidp.checkpoint' if j['variant'] == 'mpidp' else 'torch.save/load'} | {j['ranks']} | "
                    f"{j['save_s']:.2f} | {fsync:.2f} | {j['load_s']:.2f} | {j['checkpoint_bytes'] / 1e6:.0f} | {j['load_average_start'][0]:.2f} |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="memory,step,checkpoint", help="comma-separated: memory, step, checkpoint")
    ap.add_argument("--out", default="benchmarks/results/sharded", help="folder for the JSON files")
    ap.add_argument("--pairs", type=int, default=3, help="step: alternating pairs of jobs")
    ap.add_argument("--steps", type=int, default=8, help="step: timed steps per job (after 2 of warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="checkpoint: rounds of the four jobs, alternating order")
    ap.add_argument("--repeats", type=int, default=3, help="checkpoint: saves and loads per job")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny model, one of everything")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job")
    ap.add_argument("--job", choices=("memory", "step", "checkpoint"), help=argparse.SUPPRESS)  # one job, inside mpiexec
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=MODEL, help="a model of benchmarks/train_step.py, e.g. hf-gpt2-29m (Hugging Face's GPT-2, 29.0 M: pip install transformers)")
    ap.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help="checkpoint: the folder for the temporary checkpoints (default: the system's)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.pairs, args.steps, args.rounds, args.repeats = QUICK_MODEL, 1, 2, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.job is not None:
        from mpi4py import MPI

        result = job(args)
        if MPI.COMM_WORLD.rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    quick[0] = args.quick
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runners = {"memory": run_memory, "step": run_step, "checkpoint": run_checkpoint}
    for name in args.what.split(","):
        print(f"{name}:", flush=True)
        started = os.getloadavg()
        result = runners[name](args)
        result["meta"].update(load_average_start=started, load_average_end=os.getloadavg(), quick=args.quick,
                              command=f"python benchmarks/sharded.py {' '.join(sys.argv[1:] if argv is None else argv)}")
        path = out / f"{'quick-' if args.quick else ''}{name}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(tables(name, result), f"\nwrote {path}\n", sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
