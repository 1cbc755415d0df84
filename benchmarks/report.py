"""Tables, targets and the chart of a benchmark result (plain data in, text or PNG out)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["chart", "markdown", "table", "targets"]

MIB = 1 << 20
#: sets too small for bandwidth targets: the latency target applies instead
LATENCY_SETS = ("tiny",)
#: "a few chunks": the most extra memory one reduce may take, in chunks
MEMORY_CHUNKS = 4


#: issue 20's targets at 4 ranks: variant -> ratio to the raw Allreduce limit
ISSUE_20 = {
    "mpidp_fp32_buffers": 1.10, "mpidp_mixed_buffers": 1.15, "mpidp_fp16_buffers": 1.15,
    "mpidp_fp32_arrays": 1.25, "mpidp_mixed_arrays": 1.35, "mpidp_mixed_arrays_numpy_casts": 1.35,
    "mpidp_mixed_arrays_numba_casts": 1.35,
}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 5's targets, evaluated on one result (reported, never asserted)."""
    out: list[dict[str, Any]] = []

    def add(what: str, name: str, key: str, threshold: float) -> None:
        v = result["sets"][name]["variants"].get(key)
        if v is not None:
            out.append({"target": what, "set": name, "variant": key, "ratio": v["ratio"], "threshold": threshold,
                        "met": v["ratio"] <= threshold})

    for name in result["sets"]:
        if name in LATENCY_SETS:
            for key in ("mpidp_fp32_buffers", "mpidp_fp32_arrays"):
                add("tiny set reduce <= 2x its raw Allreduce limit", name, key, 2.0)
            continue
        for key in ("mpidp_fp32_buffers", "mpidp_fp32_arrays"):
            add("fp32 reduce <= 1.3x the raw Allreduce limit", name, key, 1.3)
        for key in ("mpidp_mixed_buffers", "mpidp_mixed_arrays"):
            add("mixed bf16/fp32 reduce <= 1.5x the raw Allreduce limit", name, key, 1.5)
        for key in ("mpidp_initialize_flat", "mpidp_initialize"):
            add("initialize <= 1.3x the raw Bcast limit", name, key, 1.3)
    if result["meta"]["world_size"] == 4:  # issue 20's, at 4 ranks
        for name in result["sets"]:
            if name in LATENCY_SETS:
                continue
            for key, threshold in ISSUE_20.items():
                add(f"issue 20: {key.removeprefix('mpidp_')} <= {threshold}x at 4 ranks", name, key, threshold)
    chunk = result["meta"]["chunk_bytes"]
    for name, s in result["sets"].items():
        for key, v in s["variants"].items():
            mem = v.get("memory")
            if mem is None:
                continue
            extra = max(x for x in (mem["rss_extra_bytes"], mem["traced_peak_bytes"], 0) if x is not None)
            out.append({"target": f"extra memory during reduce <= {MEMORY_CHUNKS} chunks", "set": name, "variant": key,
                        "bytes": extra, "threshold_bytes": MEMORY_CHUNKS * chunk, "met": extra <= MEMORY_CHUNKS * chunk})
    return out


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def _pages(pages: dict[str, Any] | None) -> list[str]:
    """The huge-page line of a result that recorded it: on a VM, whether NumPy got them moved timings up to 3x."""
    if pages is None:  # results from before bench.py recorded it
        return []
    unset = "(unset: NumPy asks for them)"
    return [f"transparent huge pages: {pages['transparent_hugepage']}; NUMPY_MADVISE_HUGEPAGE={pages['NUMPY_MADVISE_HUGEPAGE'] or unset}"]


def table(result: dict[str, Any]) -> str:
    """The human-readable report of one result."""
    m = result["meta"]
    la0, la1 = m["load_average_start"][0], m.get("load_average_end", [float("nan")])[0]
    lines = [
        (f"mpidp benchmark: {m['world_size']} ranks on {m['machine']['cores']} cores ({m['machine']['cpu']}), "
         f"{m['machine']['mpi']}; load average {la0:.2f} -> {la1:.2f}; {m['reps']} paired repetitions"),
        f"command: {m['command']}",
        f"16-bit casts: {m.get('casts', 'numpy')} (torch's kernels when the process has imported torch, else NumPy / ml_dtypes)",
        *_pages(m["machine"].get("huge_pages")),
        "ratio = median over repetitions of (candidate / raw limit timed next to it)",
    ]
    for name, s in result["sets"].items():
        ar, bc = s["limits"]["allreduce"], s["limits"]["bcast"]
        lines += [
            "",
            (f"{s['description']} ({name}): {s['tensors']} tensors, {s['parameters'] / 1e6:.2f} M parameters, "
             f"{s['fp32_bytes'] / MIB:.1f} MiB in fp32"),
            (f"  raw limit: Allreduce {ar['seconds'] * 1e3:.2f} ms ({ar['best_chunk_bytes'] // MIB} MiB chunks), "
             f"Bcast {bc['seconds'] * 1e3:.2f} ms ({bc['best_chunk_bytes'] // MIB} MiB chunks)"),
            f"  {'variant':<36} {'ms':>10} {'limit ms':>10} {'ratio':>7} {'min-max':>12} {'extra MiB':>10}",
        ]
        for v in s["variants"].values():
            mem = v.get("memory")
            extra = None if mem is None else max(mem["rss_extra_bytes"] or 0, mem["traced_peak_bytes"])
            lines.append(
                f"  {v['label']:<36} {v['seconds'] * 1e3:10.2f} {v['limit_seconds'] * 1e3:10.2f} "
                f"{v['ratio']:6.2f}x {v['ratio_min']:5.2f}-{v['ratio_max']:<5.2f}  {_mib(extra):>9}"
            )
    c = result.get("chunks")
    if c:
        lines += ["", (f"chunk_bytes sweep on {c['set']} (mpidp default {c['default_chunk_bytes'] // MIB} MiB); "
                       "ratios to the best raw chunked Allreduce"),
                  f"  {'chunk MiB':>9} {'raw':>7} {'mpidp fp32':>11} {'mpidp mixed':>12}"]
        for r in c["rows"]:
            lines.append(f"  {r['chunk_bytes'] // MIB:9d} {r['raw_ratio']:6.2f}x {r['mpidp_fp32_ratio']:10.2f}x "
                         f"{r['mpidp_mixed_ratio']:11.2f}x")
    if result.get("targets"):
        lines += ["", "targets (issue 5; issue 20's named)"]
        for t in result["targets"]:
            got = f"{t['ratio']:.2f}x <= {t['threshold']}x" if "ratio" in t else \
                f"{_mib(t['bytes'])} MiB <= {_mib(t['threshold_bytes'])} MiB"
            lines.append(f"  {'met ' if t['met'] else 'MISS'}  {t['set']:<10} {t['variant']:<22} {got:<22} {t['target']}")
    return "\n".join(lines)


def markdown(paths: Sequence[Path]) -> str:
    """The README's table: the ratio of every variant per set and rank count, from result files.

    Several runs of one rank count are summarised as the median over runs
    and, in brackets, the lowest and highest run.
    """
    results = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda r: (r["meta"]["world_size"], r["meta"]["started"]))
    if not results:
        return ""
    sizes = sorted({r["meta"]["world_size"] for r in results})
    runs = {n: [r for r in results if r["meta"]["world_size"] == n] for n in sizes}
    sets: list[str] = []
    for r in results:
        sets += [s for s in r["sets"] if s not in sets]
    columns = [(name, n) for name in sets for n in sizes if any(name in r["sets"] for r in runs[n])]
    keys: list[str] = []
    labels: dict[str, str] = {}
    descriptions: dict[str, str] = {}
    for r in results:
        for name, s in r["sets"].items():
            descriptions[name] = s["description"]
            for k, v in s["variants"].items():
                if k not in keys:
                    keys.append(k)
                    labels[k] = v["label"]

    def cell(values: list[float], fmt: str) -> str:
        if not values:
            return "-"
        mid = statistics.median(values)
        if len(values) == 1:
            return fmt.format(mid)
        return f"{fmt.format(mid)} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    head = [f"{descriptions[name]}, {n} ranks" for name, n in columns]
    lines = ["| variant | " + " | ".join(head) + " |", "|---|" + "---:|" * len(columns)]
    for kind, what in (("allreduce", "raw Allreduce limit, ms"), ("bcast", "raw Bcast limit, ms")):
        cells = [cell([r["sets"][name]["limits"][kind]["seconds"] * 1e3 for r in runs[n] if name in r["sets"]], "{:.2f}")
                 for name, n in columns]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    for k in keys:
        cells = [cell([r["sets"][name]["variants"][k]["ratio"] for r in runs[n]
                       if name in r["sets"] and k in r["sets"][name]["variants"]], "{:.2f}x") for name, n in columns]
        lines.append(f"| {labels[k]} | " + " | ".join(cells) + " |")
    m = results[-1]["meta"]
    mach = m["machine"]
    commands = sorted({r["meta"]["command"] for r in results})
    dates = sorted({r["meta"]["started"][:10] for r in results})
    lines += [
        "",
        (f"Ratio to the raw limit timed next to it (median of paired repetitions; `initialize` against Bcast, "
         f"everything else against Allreduce); {', '.join(f'{len(runs[n])} runs at {n} ranks' for n in sizes)}: "
         f"median over runs (lowest-highest run). Machine: {mach['cpu']}, {mach['cores']} cores, "
         f"{mach['memory_bytes'] / (1 << 30):.0f} GiB, {mach['system']}, {' '.join(mach['mpi'].split())}, "
         f"NumPy {mach['versions']['numpy']}, torch {mach['versions'].get('torch', '-')} "
         f"(16-bit casts: {m.get('casts', 'numpy')}); {', '.join(dates)}. "
         f"Commands: {'; '.join(f'`{c}`' for c in commands)}."),
    ]
    return "\n".join(lines)


#: the chart's bars: variant -> plain label (float32 gradients; the raw Allreduce is the line at 1)
CHART_BARS = {
    "mpidp_fp32_buffers": "mpidp, gradient_buffers()",
    "mpidp_fp32_arrays": "mpidp, your own arrays",
    "horovod_fusion": "Horovod-style 4 MiB fusion",
    "per_tensor": "one Allreduce per tensor",
    "gloo_buckets": "torch.distributed gloo (DDP buckets)",
}


def chart(paths: Sequence[Path], png: Path, sets: Sequence[str] | None = None, ranks: Sequence[int] | None = None,
          note: str = "") -> Path | None:
    """A chart read at a glance: per gradient set, a few float32 reductions against the raw MPI Allreduce (= 1).

    One panel per set, one horizontal bar per way of summing (:data:`CHART_BARS`)
    and rank count, the median over the result files of its ratio to the raw
    Allreduce limit timed next to it. ``sets`` and ``ranks`` choose what is
    drawn (default: everything in the files); ``note`` is added to the title.
    """
    results = [json.loads(Path(p).read_text()) for p in paths]
    results = [r for r in results if ranks is None or r["meta"]["world_size"] in ranks]
    names: list[str] = []
    for r in results:
        names += [s for s in r["sets"] if s not in names and (sets is None or s in sets)]
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["meta"]["world_size"] for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 1.2 + 0.45 * len(CHART_BARS) * len(sizes)),
                             squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names):
        _panel(ax, name, results, sizes)
    axes[0, 0].set_yticks([i for i in range(len(CHART_BARS))], list(CHART_BARS.values()), fontsize=10)
    axes[0, 0].invert_yaxis()
    m = results[0]["meta"]["machine"]
    ranks_text = " and ".join(str(n) for n in sizes) + " ranks"
    fig.suptitle(f"Summing float32 gradients, {ranks_text}: time / raw MPI Allreduce of the same bytes (lower is faster)\n"
                 f"{m['cpu']}, {m['cores']} cores, {' '.join(m['mpi'].split())}{'; ' + note if note else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _panel(ax: Any, name: str, results: list[dict[str, Any]], sizes: list[int]) -> None:
    """One set's bars: the median ratio of each way over the runs of each rank count, labelled with its value."""
    height = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        runs = [r["sets"][name]["variants"] for r in results if r["meta"]["world_size"] == n and name in r["sets"]]
        ys, xs = [], []
        for j, key in enumerate(CHART_BARS):
            got = [v[key]["ratio"] for v in runs if key in v]
            if got:
                ys.append(j + (i - (len(sizes) - 1) / 2) * height)
                xs.append(statistics.median(got))
        bars = ax.barh(ys, xs, height, label=f"{n} ranks")
        ax.bar_label(bars, labels=[f"{x:.1f}x" for x in xs], padding=3, fontsize=9)
    ax.axvline(1.0, color="k", lw=1)
    ax.text(1.0, -0.7, " raw MPI limit", fontsize=8, va="bottom")
    desc = next(r["sets"][name]["description"] for r in results if name in r["sets"])
    ax.set_title(desc, fontsize=11)
    ax.set_xlim(0, 1.25 * max((b.get_width() for b in ax.patches), default=1.0))
    ax.set_xlabel("times the raw MPI Allreduce")
    if len(sizes) > 1:
        ax.legend(fontsize=8, loc="lower right")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the Markdown table of result files, or (``--chart PNG``) draw the chart from them."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", nargs="+", type=Path, help="bench-np<N>.json files")
    ap.add_argument("--chart", type=Path, default=None, help="draw the chart into this PNG instead of printing the table")
    ap.add_argument("--sets", default=None, help="comma-separated sets to draw (default: all)")
    ap.add_argument("--ranks", default=None, help="comma-separated rank counts to draw (default: all)")
    ap.add_argument("--note", default="", help="added to the chart's title")
    a = ap.parse_args(argv)
    if a.chart is None:
        print(markdown(a.results))
        return 0
    sets = a.sets.split(",") if a.sets else None
    ranks = [int(n) for n in a.ranks.split(",")] if a.ranks else None
    return 0 if chart(a.results, a.chart, sets, ranks, a.note) else 1


if __name__ == "__main__":  # python benchmarks/report.py benchmarks/results/runs/*.json: the notes' table
    raise SystemExit(main())
