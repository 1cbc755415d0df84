"""mpidp against the raw MPI limits on a network: ranks on simulated hosts, links shaped with tc netem.

Two ways to run it. The campaign (as root, on Linux; a few minutes) builds
the hosts with scripts/multihost.py for every configuration in
:data:`CONFIGS`, runs this file under MPI there, and writes one JSON per
configuration and a table of ratios::

    python benchmarks/netbench.py --campaign benchmarks/results/multihost-<date>

One configuration by hand (what the campaign runs)::

    python scripts/multihost.py run --hosts 4 --ppn 1 --rate 1gbit --delay 100us -- \\
        python -m mpi4py benchmarks/netbench.py --label 1gbit-100us --out DIR

Each run measures, collectively:

- ``pingpong``: one-way time of a message of n bytes between the first ranks
  of host 0 and host 1 (half a round trip), for n from 8 B to 16 MiB: the
  link's latency and per-byte cost, which benchmarks/scaling_model.py fits.
- ``allreduce``: one fp32 ``Allreduce`` of n bytes over all ranks, same sizes:
  what the model must predict from the ping-pong fit.
- ``reduce_local``: seconds per byte of ``MPI.SUM`` on fp32 in local memory:
  the reduction cost.
- ``set``: a gradient set (GPT-2 layout, 4 layers of width 256: 5.4 M
  parameters) reduced by mpidp (fp32; and bf16 matrices, which mpidp sums in
  fp32 and sends as fp32 today) and by two raw limits of reduce-scatter +
  allgather (fp32 both ways; fp32 reduce-scatter and a 16-bit allgather, the
  bytes of the path mpidp has not got yet), each timed in pairs with the raw
  chunked fp32 ``Allreduce`` of the same element count; the ratio is the
  median of ``candidate / limit`` over the pairs, as in bench.py.

Nothing here gates on time. Standard set-up: the MPICH wheel's mpiexec.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench
import gradsets

import mpidp
from mpidp.packing import DEFAULT_CHUNK_BYTES

COMM = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parent.parent
#: (label, hosts, ranks per host, tc netem rate, one-way delay); None: the bare veth link
CONFIGS: list[tuple[str, int, int, str | None, str | None]] = [
    ("veth-2x1", 2, 1, None, None),
    ("10gbit-2x1", 2, 1, "10gbit", None),
    ("1gbit-2x1", 2, 1, "1gbit", None),
    ("10gbit-25us-2x1", 2, 1, "10gbit", "25us"),
    ("1gbit-100us-2x1", 2, 1, "1gbit", "100us"),
    ("1gbit-4x1", 4, 1, "1gbit", None),
]
# 2 ranks on this 2-core machine are the clean fit; 4 ranks oversubscribe the cores (MPICH busy-polls),
# which costs milliseconds on latency-bound calls but little on bandwidth-bound ones: the p = 4 check.
# A rate alone is shaped with tc tbf; a delay needs tc netem, which some kernels lack (then it is skipped).
#: message sizes of the ping-pong and Allreduce sweeps (bytes)
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
SET_NAME = "gpt2-4x256"
SET_LAYOUT = gradsets.gpt2(layers=4, width=256, vocab=8192, context=512)
#: --quick (a smoke run of seconds, for the tests): fewer sizes, a set of 0.1 M parameters
QUICK_SIZES = [8, 4 << 10, 256 << 10, 1 << 20]
QUICK_SET = ("gpt2-1x64", gradsets.gpt2(layers=1, width=64, vocab=1024, context=64))


def log(msg: str) -> None:
    if COMM.rank == 0:
        print(msg, file=sys.stderr, flush=True)


def times(fn: bench.Fn, reps: int, target: float) -> dict[str, float]:
    """Seconds per call (the slowest rank's): the minimum and median of ``reps`` timings; collective.

    The fit uses the minimum: on a shared machine noise only ever adds time.
    """
    fn()
    inner = bench.inner_for(bench.timed(fn, 1), target)
    samples = [bench.timed(fn, inner) for _ in range(reps)]
    return {"min": min(samples), "median": statistics.median(samples)}


def pingpong(nbytes: int, peer: int, reps: int, target: float) -> dict[str, float]:
    """One-way seconds of ``nbytes`` between rank 0 and ``peer`` (half a round trip); collective."""
    buf = np.zeros(max(1, nbytes), np.uint8)
    rank = COMM.rank

    def run() -> None:
        if rank == 0:
            COMM.Send(buf, peer, 7)
            COMM.Recv(buf, peer, 7)
        elif rank == peer:
            COMM.Recv(buf, 0, 7)
            COMM.Send(buf, 0, 7)

    return {k: v / 2 for k, v in times(run, reps, target).items()}


def allreduce(nbytes: int, reps: int, target: float) -> dict[str, float]:
    buf = np.zeros(max(1, nbytes // 4), np.float32)
    return times(lambda: COMM.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), reps, target)


def reduce_local(nbytes: int = 16 << 20, reps: int = 5) -> float:
    """Seconds per byte of an fp32 MPI.SUM into local memory, the slowest rank's."""
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    return times(lambda: MPI.SUM.Reduce_local(a, b), reps, 0.05)["min"] / nbytes


def rsag(n: int, chunk_bytes: int, gather_16: bool) -> tuple[bench.Fn, list[np.ndarray]]:
    """Raw limit of reduce-scatter + allgather in chunks: fp32 sums, then fp32 or 16-bit shards gathered.

    Every chunk is padded to a multiple of the world size (as any
    implementation must); the 16-bit allgather moves each rank's reduced shard
    as bfloat16, the bytes the reduce-scatter / 16-bit allgather path sends.
    """
    size = COMM.size
    per = max(size, (chunk_bytes // 4) // size * size)
    chunks = [min(per, n - s) for s in range(0, n, per)]
    bufs = [np.zeros(-(-c // size) * size, np.float32) for c in chunks]
    shards = [np.empty(len(b) // size, np.float32) for b in bufs]
    wide = [np.empty(len(b), gradsets.BF16 if gather_16 else np.float32) for b in bufs]
    narrow = [np.empty(len(s), gradsets.BF16) for s in shards] if gather_16 else shards

    def run() -> None:
        for buf, shard, half, out in zip(bufs, shards, narrow, wide):
            COMM.Reduce_scatter_block(buf, shard, MPI.SUM)
            if gather_16:
                half[...] = shard  # the owner's cast of its shard back to 16 bits
                COMM.Allgather(half.view(np.uint16), out.view(np.uint16))
            else:
                COMM.Allgather(shard, out)

    return run, bufs


def bench_set(name: str, layout: list[tuple[str, tuple[int, ...]]], reps: int, target: float) -> dict[str, Any]:
    """mpidp and the reduce-scatter + allgather limits against the chunked fp32 Allreduce; collective."""
    n = gradsets.count(layout)
    limit_buf = np.zeros(n, np.float32)
    limit = bench.raw_allreduce(limit_buf, DEFAULT_CHUNK_BYTES)
    inner = bench.inner_for(bench.timed(limit, 1), target)
    out: dict[str, Any] = {"name": name, "tensors": len(layout), "parameters": n, "fp32_bytes": 4 * n,
                           "chunk_bytes": DEFAULT_CHUNK_BYTES, "limit": "raw fp32 Allreduce in chunk_bytes chunks",
                           "variants": {}}

    def zero_limit() -> None:
        limit_buf.fill(0)

    def record(key: str, label: str, res: dict[str, Any]) -> None:
        res.pop("samples", None)
        out["variants"][key] = {"label": label, **res}
        log(f"   {label:<52} {res['seconds'] * 1e3:9.2f} ms  x{res['ratio']:.2f}  (limit {res['limit_seconds'] * 1e3:.2f} ms)")

    for gather_16 in (False, True):
        fn, bufs = rsag(n, DEFAULT_CHUNK_BYTES, gather_16)
        label = "raw Reduce_scatter + Allgather, " + ("16-bit allgather" if gather_16 else "fp32")
        record("raw_rs_ag16" if gather_16 else "raw_rs_ag", label,
               bench.paired(limit, fn, reps, 1, inner, bench.reset_values(bufs), zero_limit))
    for mix in ("fp32", "mixed"):
        params = bench.random_arrays(layout, mix, 3000 + COMM.rank)
        with mpidp.DataParallel.initialize(params, COMM) as dp:
            grads = dp.gradient_buffers()
            fn = bench.mpidp_reduce(dp, grads)
            label = f"mpidp reduce {mix}" + (" (bf16 matrices: fp32 on the wire)" if mix == "mixed" else "")
            record(f"mpidp_{mix}", label, bench.paired(limit, fn, reps, 1, inner, bench.reset_values(list(grads.values())), zero_limit))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    hosts = COMM.allgather(MPI.Get_processor_name())
    # the first rank on another host; on one host (a smoke run), rank 1
    peer = next((r for r, h in enumerate(hosts) if h != hosts[0]), 1 if COMM.size > 1 else None)
    result: dict[str, Any] = {
        "meta": {
            "label": args.label,
            "command": " ".join(["python -m mpi4py benchmarks/netbench.py", *sys.argv[1:]]),
            "world_size": COMM.size,
            "hosts": hosts,
            "pingpong_peer": peer,
            "link": {"rate": args.rate, "delay": args.delay},
            "netmod": os.environ.get("MPIR_CVAR_CH4_NETMOD", "default"),
            "machine": bench.machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average_start": os.getloadavg(),
        }
    }
    log(f"== {args.label}: {COMM.size} ranks on {len(set(hosts))} hosts; ping-pong rank 0 <-> rank {peer}")
    result["reduce_local_seconds_per_byte"] = reduce_local()
    sizes = QUICK_SIZES if args.quick else SIZES
    result["pingpong"] = {} if peer is None else {str(s): pingpong(s, peer, args.reps, args.target) for s in sizes}
    result["allreduce"] = {str(s): allreduce(s, args.reps, args.target) for s in sizes}
    for s in sizes:
        pp = result["pingpong"].get(str(s), {}).get("min", float("nan"))
        log(f"   {s:>9} B  ping-pong {pp * 1e6:10.1f} us   Allreduce {result['allreduce'][str(s)]['min'] * 1e6:10.1f} us (minima)")
    result["set"] = bench_set(*(QUICK_SET if args.quick else (SET_NAME, SET_LAYOUT)), args.reps, args.target)
    result["meta"]["load_average_end"] = os.getloadavg()
    return result


def table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown table: each variant's ratio to the raw chunked fp32 Allreduce, per configuration."""
    keys = list(results[0]["set"]["variants"])
    head = "| variant | " + " | ".join(r["meta"]["label"] for r in results) + " |"
    rows = [head, "|" + "---|" * (len(results) + 1)]
    limit = "| raw fp32 Allreduce, chunked (the limit), ms | " + " | ".join(
        f"{r['set']['variants'][keys[0]]['limit_seconds'] * 1e3:.1f}" for r in results) + " |"
    rows.append(limit)
    for key in keys:
        label = results[0]["set"]["variants"][key]["label"]
        rows.append(f"| {label} | " + " | ".join(f"x{r['set']['variants'][key]['ratio']:.2f}" for r in results) + " |")
    return "\n".join(rows)


def campaign(out: Path, reps: int, target: float, netmod: str) -> int:
    """Run every configuration of :data:`CONFIGS` on fresh simulated hosts; write JSON and the table."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for label, hosts, ppn, rate, delay in CONFIGS:
        shape = [*(["--rate", rate] if rate else []), *(["--delay", delay] if delay else [])]
        cmd = [sys.executable, str(ROOT / "scripts" / "multihost.py"), "run", "--hosts", str(hosts), "--ppn", str(ppn),
               "--timeout", "600", "--netmod", netmod, "--strict-skip", *shape, "--", sys.executable, "-m", "mpi4py",
               str(Path(__file__).resolve()), "--label", label, "--out", str(out), "--reps", str(reps),
               "--target", str(target), *(["--rate", rate] if rate else []), *(["--delay", delay] if delay else [])]
        code = subprocess.run(cmd, check=False).returncode
        if code == 77 and not rate and not delay:
            print("netbench: cannot simulate hosts here (see above); nothing measured", file=sys.stderr)
            return 0
        if code == 77:
            print(f"netbench: {label} skipped: this kernel cannot shape links so (see above)", file=sys.stderr)
            continue
        if code != 0:
            print(f"netbench: {label} failed with exit code {code}", file=sys.stderr)
            return code
        results.append(json.loads((out / f"{label}.json").read_text()))
    text = table(results)
    (out / "ratios.md").write_text(text + "\n")
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--campaign", metavar="DIR", help="run every configuration on simulated hosts, results into DIR")
    p.add_argument("--label", default="run", help="name of this configuration (the JSON file's name)")
    p.add_argument("--rate", help="the link's tc netem rate, recorded in the JSON")
    p.add_argument("--delay", help="the link's tc netem one-way delay, recorded in the JSON")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "multihost"))
    p.add_argument("--reps", type=int, default=5, help="timings per point (medians), paired repetitions per variant")
    p.add_argument("--target", type=float, default=0.02, help="seconds one timing should last")
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds: fewer sizes, a tiny set, 2 timings")
    p.add_argument("--netmod", choices=("ucx", "ofi"), default="ucx", help="campaign: MPICH netmod for TCP")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.target = 2, 0.002
    if args.campaign:
        return campaign(Path(args.campaign), args.reps, args.target, args.netmod)
    result = measure(args)
    if COMM.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.label}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(table([result]))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
