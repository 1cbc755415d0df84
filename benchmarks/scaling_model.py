"""Fit an alpha-beta-gamma cost model to netbench runs and predict mpidp's window time at scale.

    python benchmarks/scaling_model.py benchmarks/results/multihost-2026-12-04

prints, as Markdown (docs/scaling.md shows this output):

1. per run: alpha (seconds per message), beta (seconds per byte on the link),
   gamma (seconds per byte of a local fp32 sum) and mpidp's own cost per byte
   beyond the raw Allreduce (delta: upcast, divide, cast back);
2. the check: measured fp32 Allreduce of 1-16 MiB against the model's
   prediction for the same p and n;
3. predictions: one window's gradient synchronisation for GPT-2 small and
   ResNet-50 at 8-1,024 ranks on 100/200/400 Gbit/s links, by algorithm, and
   the scaling efficiency ``compute / (compute + communication)`` it implies
   (mpidp reduces after the window: nothing overlaps).

Pure: reads JSON, needs no MPI. The formulas (Thakur, Rabenseifner and
Gropp, 2005; Patarasuk and Yuan, 2009 for the ring), with p ranks, n bytes:

- ring allreduce:   2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
- tree allreduce:   2 log2(p) (a + n b) + log2(p) n g    (binomial reduce, then broadcast)
- RS + AG:          2 log2(p) a + 2(p-1)/p n b + (p-1)/p n g    (recursive halving, then doubling)
- RS + 16-bit AG:   2 log2(p) a + 1.5 (p-1)/p n b + (p-1)/p n g  (fp32 reduce-scatter, bf16 allgather)

and mpidp's chunking multiplies the latency term by the number of chunks.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: parameters of the gradient sets (benchmarks/gradsets.py counts the same)
SETS = {"GPT-2 small": 124_439_808, "ResNet-50": 25_557_032}
#: assumed compute time of one window per rank (see docs/scaling.md): GPT-2 small, 8 x 1,024 tokens,
#: ~6 x 124 M x 8,192 FLOP at ~100 TFLOP/s; ResNet-50, 64 images at ~2,500 images/s (A100-class, mixed precision)
COMPUTE_SECONDS = {"GPT-2 small": 0.060, "ResNet-50": 0.025}
RANKS = (8, 64, 256, 1024)
LINKS_GBIT = (100, 200, 400)
CHUNK_BYTES = 4 << 20
#: reduction cost per byte in GPU memory: read two fp32 values, write one, at ~2 TB/s (HBM-class)
GAMMA_DEVICE = 12 / 4 / 2e12
#: assumed per-message latency of a data-centre fabric (RDMA-class); this machine's TCP is fitted, not assumed
ALPHA_FABRIC = 5e-6

Model = Callable[[int, float, float, float, float], float]


def ring(p: int, n: float, a: float, b: float, g: float) -> float:
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def tree(p: int, n: float, a: float, b: float, g: float) -> float:
    steps = math.ceil(math.log2(p))
    return 2 * steps * (a + n * b) + steps * n * g


def rsag(p: int, n: float, a: float, b: float, g: float) -> float:
    return 2 * math.ceil(math.log2(p)) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def rsag16(p: int, n: float, a: float, b: float, g: float) -> float:
    return 2 * math.ceil(math.log2(p)) * a + 1.5 * (p - 1) / p * n * b + (p - 1) / p * n * g


def chunked(model: Model, chunk: int) -> Model:
    """The same algorithm called once per ``chunk`` bytes: every call pays the latency term again."""

    def run(p: int, n: float, a: float, b: float, g: float) -> float:
        calls = max(1, math.ceil(n / chunk))
        return calls * model(p, n / calls, a, b, g)

    return run


ALGORITHMS: dict[str, Model] = {
    "ring, one call": ring,
    "ring, 4 MiB chunks": chunked(ring, CHUNK_BYTES),
    "tree": tree,
    "RS+AG, 4 MiB chunks": chunked(rsag, CHUNK_BYTES),
    "RS+AG 16-bit, 4 MiB chunks": chunked(rsag16, CHUNK_BYTES),
}


def slope(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through ``(x, y)``: (intercept, slope)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fit(run: dict[str, Any]) -> dict[str, float]:
    """alpha, beta from the ping-pong minima; gamma from the local sum; delta from mpidp's paired ratio."""
    pp = {int(k): v["min"] for k, v in run["pingpong"].items()}
    alpha = statistics.median(t for n, t in pp.items() if n <= 4096)
    _, beta = slope([(n, t) for n, t in pp.items() if n >= 256 << 10])
    s = run["set"]
    v = s["variants"]["mpidp_fp32"]
    delta = max(0.0, (v["ratio"] - 1) * v["limit_seconds"] / s["fp32_bytes"])
    return {"alpha": alpha, "beta": beta, "gamma": run["reduce_local_seconds_per_byte"], "delta": delta,
            "p": run["meta"]["world_size"]}


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def report(runs: dict[str, dict[str, Any]], compute: dict[str, float], alpha_fabric: float) -> str:
    out = ["## Fitted on this machine (ping-pong minima; gamma: MPI.SUM on fp32 in memory)", "",
           "| run | p | alpha | beta (ns/B) | link (Gbit/s) | gamma (ns/B) | mpidp delta (ns/B) |",
           "|---|---|---|---|---|---|---|"]
    fits = {label: fit(r) for label, r in runs.items()}
    for label, f in fits.items():
        out.append(f"| {label} | {f['p']} | {fmt_time(f['alpha'])} | {f['beta'] * 1e9:.3f} | {8 / f['beta'] / 1e9:.2f} | "
                   f"{f['gamma'] * 1e9:.3f} | {f['delta'] * 1e9:.3f} |")
    out += ["", "## Check: measured fp32 Allreduce (minimum) against RS+AG with the run's own fit", "",
            "| run | p | bytes | measured | model | measured / model |", "|---|---|---|---|---|---|"]
    for label, r in runs.items():
        f = fits[label]
        for n_text, t in r["allreduce"].items():
            n = int(n_text)
            if n < 1 << 20:
                continue
            model = rsag(f["p"], n, f["alpha"], f["beta"], f["gamma"])
            out.append(f"| {label} | {f['p']} | {n >> 20} MiB | {fmt_time(t['min'])} | {fmt_time(model)} | {t['min'] / model:.2f} |")
    gamma = statistics.median(f["gamma"] for f in fits.values())
    delta = statistics.median(f["delta"] for f in fits.values())
    out += ["", f"## Predictions: one window's gradient synchronisation, alpha = {alpha_fabric * 1e6:g} us, beta = 8 / link rate", "",
            (f"Algorithm columns: network-bound (gamma = {GAMMA_DEVICE * 1e9:g} ns/B, a sum in GPU memory). "
            f"Efficiency = compute / (compute + synchronisation), nothing overlapped: *device* with RS+AG in 4 MiB chunks "
            f"(what a CUDA-aware MPI gives mpidp), *16-bit AG* the same with a bf16 allgather (issue 20), *host* with "
            f"this machine's fitted CPU costs added (gamma {gamma * 1e9:.3f} ns/B for MPI's sum, delta {delta * 1e9:.3f} ns/B "
            f"for mpidp's upcast, divide and cast), as mpidp runs on host memory today."), ""]
    for name, params in SETS.items():
        n = 4 * params
        c = compute[name]
        out += [f"### {name}: {params:,} parameters, {n / 1e6:.0f} MB in fp32; compute {c * 1e3:g} ms per window", "",
                "| link | ranks | " + " | ".join(ALGORITHMS) + " | efficiency: device | 16-bit AG | host |",
                "|---|---|" + "---|" * (len(ALGORITHMS) + 3)]
        for gbit in LINKS_GBIT:
            beta = 8 / (gbit * 1e9)
            for p in RANKS:
                times = {k: m(p, n, alpha_fabric, beta, GAMMA_DEVICE) for k, m in ALGORITHMS.items()}
                device = times["RS+AG, 4 MiB chunks"]
                half = times["RS+AG 16-bit, 4 MiB chunks"]
                host = chunked(rsag, CHUNK_BYTES)(p, n, alpha_fabric, beta, gamma) + delta * n
                cells = " | ".join(fmt_time(t) for t in times.values())
                effs = " | ".join(f"{c / (c + t):.0%}" for t in (device, half, host))
                out.append(f"| {gbit} Gbit/s | {p} | {cells} | {effs} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder of netbench JSON files (one per run)")
    p.add_argument("--alpha-us", type=float, default=ALPHA_FABRIC * 1e6, help="per-message latency of the predictions")
    p.add_argument("--compute-ms", default=None, help="compute per window, e.g. 'GPT-2 small=60,ResNet-50=25'")
    args = p.parse_args(argv)
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(Path(args.folder).glob("*.json"))}
    runs = {k: v for k, v in runs.items() if v.get("pingpong")}
    if not runs:
        print(f"no netbench runs with a ping-pong in {args.folder}", file=sys.stderr)
        return 1
    compute = dict(COMPUTE_SECONDS)
    for item in filter(None, (args.compute_ms or "").split(",")):
        name, _, ms = item.partition("=")
        compute[name.strip()] = float(ms) / 1e3
    print(report(runs, compute, args.alpha_us * 1e-6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
