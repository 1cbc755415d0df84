"""Time mpidp's 16-bit host casts against torch's, on one thread (no MPI).

For each cast (bfloat16 and float16, up to float32 and down from it, the
downcast with the division by the global weight mpidp does before it), the
casts a process can get: NumPy / ml_dtypes (``astype``), mpidp's NumPy bit
arithmetic (:mod:`mpidp.casts`, what it uses without numba), the compiled
kernels of :mod:`mpidp.kernels` (numba) and torch's. Every way is timed in
rotating order within each round; the table gives medians and the ratio
to torch's, whose whole cast is the yardstick (issue 20: within 1.2x).

    python benchmarks/casts.py --sizes 1048576,4194304 --rounds 7 --out benchmarks/results/casts/casts.json
    python benchmarks/casts.py --report benchmarks/results/casts/casts.json   # the Markdown table
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mpidp import casts as room

BF16 = np.dtype(ml_dtypes.bfloat16)


def timer(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call, the median of ``calls`` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ways(n: int, torch: Any) -> dict[str, dict[str, Callable[[], object]]]:
    """For each cast, its ways by name: closures over arrays of ``n`` values."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(3)
    h, b = x.astype(np.float16), x.astype(BF16)
    out, out16, outb = np.empty(n, np.float32), np.empty(n, np.float16), np.empty(n, BF16)
    scratch = np.empty(room.BLOCK, np.uint32)
    w = np.float32(3)  # a global weight that is not a power of two: a real division
    table: dict[str, dict[str, Callable[[], object]]] = {
        "bfloat16 -> float32": {
            "NumPy / ml_dtypes": lambda: np.copyto(out, b),
            "mpidp bit arithmetic": lambda: room.bf16_to_f32(b, out),
        },
        "float16 -> float32": {
            "NumPy / ml_dtypes": lambda: np.copyto(out, h),
            "mpidp bit arithmetic": lambda: room.f16_to_f32(h, out),
        },
        "float32 / w -> bfloat16": {
            "NumPy / ml_dtypes": lambda: np.copyto(outb, x / w),
            "mpidp bit arithmetic": lambda: room.f32_to_bf16(np.divide(x, w, out=out), outb, scratch),
        },
        "float32 / w -> float16": {
            "NumPy / ml_dtypes": lambda: np.divide(x, w, out=out16, casting="unsafe"),
            "mpidp bit arithmetic": lambda: np.divide(x, w, out=out16, casting="unsafe"),  # mpidp keeps NumPy's here
        },
    }
    if room.Casts("numba").fastest() == "numba":  # numba installed and its kernels loaded
        from mpidp import kernels

        table["bfloat16 -> float32"]["mpidp.kernels (numba)"] = lambda: kernels.bf16_to_f32(b.view(np.uint16), out.view(np.uint32))
        table["float16 -> float32"]["mpidp.kernels (numba)"] = lambda: kernels.f16_to_f32(h.view(np.uint16), out)
        table["float32 / w -> bfloat16"]["mpidp.kernels (numba)"] = lambda: kernels.f32_to_bf16(x, outb.view(np.uint16), w, False)
        table["float32 / w -> float16"]["mpidp.kernels (numba)"] = lambda: kernels.f32_to_f16(x, out16.view(np.uint16), w, False)
    if torch is not None:
        tx, to, th = torch.from_numpy(x), torch.from_numpy(out), torch.from_numpy(h)
        tb = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
        t16, tbo = torch.from_numpy(out16), torch.from_numpy(outb.view(np.int16)).view(torch.bfloat16)
        scaled = torch.empty(n, dtype=torch.float32)
        table["bfloat16 -> float32"]["torch"] = lambda: to.copy_(tb)
        table["float16 -> float32"]["torch"] = lambda: to.copy_(th)
        table["float32 / w -> bfloat16"]["torch"] = lambda: tbo.copy_(torch.div(tx, float(w), out=scaled))
        table["float32 / w -> float16"]["torch"] = lambda: t16.copy_(torch.div(tx, float(w), out=scaled))
    return table


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table: ms per cast (ratio to torch's) for each size, cast and way."""
    sizes = list(result["sizes"])
    ways_seen = list(dict.fromkeys(w for rows in result["sizes"].values() for by in rows.values() for w in by))
    lines = ["| values | cast | " + " | ".join(ways_seen) + " |", "|---:|---|" + "---:|" * len(ways_seen)]
    for n in sizes:
        for cast, by in result["sizes"][n].items():
            cells = []
            for w in ways_seen:
                v = by.get(w)
                if v is None:
                    cells.append("-")
                else:
                    cells.append(f"{v['ms']:.3f}" + ("" if v["to_torch"] is None or w == "torch" else f" ({v['to_torch']:.2f}x)"))
            lines.append(f"| {int(n):,} | {cast} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1048576,4194304", help="values per cast, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; each times every way once, in rotating order")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing (median)")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out (as in a process without it)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--report", type=Path, help="print the Markdown table of a JSON result and exit")
    args = parser.parse_args()
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
        else:
            torch.set_num_threads(1)
    result: dict[str, Any] = {
        "meta": {"machine": platform.processor() or platform.machine(), "numpy": np.__version__,
                 "torch": None if torch is None else torch.__version__, "rounds": args.rounds, "calls": args.calls,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "sizes": {},
    }
    for n in (int(s) for s in args.sizes.split(",")):
        table = ways(n, torch)
        samples: dict[str, dict[str, list[float]]] = {cast: {w: [] for w in by} for cast, by in table.items()}
        for r in range(args.rounds):
            for cast, by in table.items():
                names = list(by)
                for w in names[r % len(names) :] + names[: r % len(names)]:
                    samples[cast][w].append(timer(by[w], args.calls))
        rows = {}
        print(f"== {n} values, ms per cast (median of {args.rounds} rounds); x: ratio to torch's")
        for cast, by in samples.items():
            ms = {w: statistics.median(t) * 1e3 for w, t in by.items()}
            ref = ms.get("torch")
            rows[cast] = {w: {"ms": v, "to_torch": None if ref is None else v / ref} for w, v in ms.items()}
            cells = "  ".join(f"{w} {v:.3f}" + ("" if ref is None else f" (x{v / ref:.2f})") for w, v in ms.items())
            print(f"   {cast:<24} {cells}")
        result["sizes"][str(n)] = rows
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
